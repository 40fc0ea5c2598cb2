"""Training lesson 11's GPT on one device or several: the parallel wraps, the loop, DCP checkpoints.

``train_lm`` is one rank's training run; ``scripts/train_lm.py`` runs it under ``torchrun`` (or as
one process), and a notebook can run it with ``mgpu_helpers.launch``. The parallelisms come from
the lessons that taught them:

- ``ddp``: ``DistributedDataParallel`` (lesson 04);
- ``fsdp``: lesson 08b's own ``apply_fsdp``, read from its notebook (one FSDP2 group per block,
  then the root, which holds the tied embedding and head together);
- ``fsdp_tp``: a 2-D mesh ``(dp, tp)``: the GPT's tensor-parallel plan on the ``tp`` rows, then
  the same ``apply_fsdp`` on the ``dp`` columns, as lesson 09b's ``apply_2d`` does for its model.

Lesson 11 writes those wraps in its cells (``apply_gpt_tp``, ``parallelize``); this module reads
them from the notebook (:func:`lesson_parallelize`), and a notebook passes its own to ``train_lm``.

Checkpoints are ``torch.distributed.checkpoint`` (DCP) folders written through
``get_state_dict``/``set_state_dict``, so one code path saves and loads a plain module, DDP,
FSDP2 and DTensor tensor-parallel shards. They follow lesson 07's snapshot rules: written to
``DIR.tmp``, then renamed into place with the previous one kept as ``DIR.prev``; a checkpoint
from other settings is refused, naming the setting. Every rank writes its own shards, so with
several nodes ``DIR`` must be on storage every node sees: after each save every rank checks
that it sees the finished checkpoint, and all stop with a clear error if one does not.

Precision: on the CPU the run is float32 throughout. On CUDA, forward and loss run under
``torch.autocast`` in :func:`mgpu_helpers.mfu.training_dtype` (bfloat16 from compute capability
8.0, float16 before); weights, gradients and AdamW's state stay float32. float16 adds a
``torch.amp.GradScaler``, the plain one for every parallelism: DDP's gradients are averaged
before it looks at them, and DTensor's handler of its unscale op (``_amp_foreach_non_finite_
check_and_unscale_``) reduces the found-inf flag with a max over the sharded mesh dimensions of
the first gradient, so FSDP2's ranks skip the same steps (PyTorch's FSDP2 x TP tests use it too).
FSDP2 and FSDP2 x TP need one rank per GPU (NCCL): ranks sharing a GPU over gloo are refused
(:func:`check_backend`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import course_root
from .dist_env import DistEnv
from .lesson_code import load_lesson_code
from .lm import GPT, GPTConfig, evaluate, generate, get_batch, lm_loss, stdlib_bytes
from .mfu import training_dtype
from .progress import progress_bar
from .run_control import maybe_die, node_name, retries_refuse_alike, sibling, stop_requested
from .tensor_parallel import check_heads

__all__ = [
    "CHECKPOINT_VERSION",
    "MUST_MATCH",
    "PARALLELS",
    "LMRun",
    "check_backend",
    "check_parallel",
    "find_checkpoint",
    "QUICK",
    "lesson_apply_fsdp",
    "lesson_parallelize",
    "load_checkpoint",
    "lr_at",
    "make_optimizer",
    "parallelize",
    "quick_run",
    "save_checkpoint",
    "script_args",
    "train_lm",
    "training_autocast",
]

PARALLELS = ("single", "ddp", "fsdp", "fsdp_tp")
CHECKPOINT_VERSION = 1  # bumped when meta.json's layout changes
META = "meta.json"  # what DCP does not hold: settings, step, history (written by rank 0)
# The settings a checkpoint must share with the run that resumes from it; steps too: the
# learning-rate schedule depends on it.
MUST_MATCH = ("model", "steps", "batch_size", "lr", "warmup", "weight_decay", "seed",
              "data_limit", "val_limit", "eval_every", "eval_batches", "parallel", "tp",
              "world_size")


@dataclass(frozen=True)
class LMRun:
    """One training run of lesson 11's GPT: the model, the optimisation, the parallelism, files."""

    model: GPTConfig = field(default_factory=GPTConfig)
    steps: int = 150  # optimizer steps; the defaults: ~2 minutes on 2 CPU cores
    batch_size: int = 16  # global: sequences per step, all ranks together
    lr: float = 2e-3  # AdamW's peak learning rate
    warmup: int = 10  # steps of linear warm-up, then a cosine to a tenth of lr
    weight_decay: float = 0.1  # on the matrices only (not norms, not the position embedding)
    seed: int = 0  # the weights and the batches
    data_limit: int | None = None  # training bytes read (None: the whole standard library)
    val_limit: int | None = 500_000  # validation bytes read
    eval_every: int = 25  # validation loss every N steps, and after the last
    eval_batches: int = 4  # fixed validation batches per evaluation
    parallel: str = "single"  # one of PARALLELS
    tp: int = 2  # tensor-parallel ranks for fsdp_tp (the mesh is world_size // tp x tp)
    snapshot: Path | None = None  # the DCP checkpoint folder (None: none, no resume)
    snapshot_every: int = 0  # checkpoint every N steps (0: only at the end and on a stop)
    out: Path | None = None  # rank 0 writes result.json and model.pt here
    sample_bytes: int = 200  # bytes sampled from the trained model for result.json (0: none)
    kill_at_step: int | None = None  # fault injection: a rank dies before this step
    kill_rank: int = 0  # ... this rank
    restarts: int = 0  # the job's restarts before this attempt
    progress: bool = False  # rank 0 draws a progress bar over the steps (the notebook's runs)

    def settings(self) -> dict[str, Any]:
        """The run's settings as plain values (in checkpoints and result.json)."""
        keep = MUST_MATCH + ("snapshot_every",)
        values = {k: v for k, v in asdict(self).items() if k in keep}
        return {**values, "model": asdict(self.model)}


# Quick mode (tests, make course QUICK=1, scripts/train_lm.py --quick): a small model on a slice of
# the text, seconds on a CPU.
QUICK: dict[str, Any] = {
    "d_model": 64, "n_layers": 2, "seq_len": 64, "steps": 20, "batch_size": 8,
    "data_limit": 300_000, "val_limit": 60_000, "eval_every": 10, "eval_batches": 2,
    "lr": 3e-3, "warmup": 5,
}  # fmt: skip


def quick_run(run: LMRun) -> LMRun:
    """``run`` with QUICK's sizes and budget (lesson 11's quick mode); the rest as it was."""
    sizes = {k: v for k, v in QUICK.items() if k in GPTConfig.__dataclass_fields__}
    rest = {k: v for k, v in QUICK.items() if k not in sizes}
    return replace(run, model=replace(run.model, **sizes), **rest)


# What scripts/train_lm.py has no option for: a run that changed them cannot go to the script.
_NOT_ON_THE_COMMAND_LINE = ("vocab_size", "mlp_ratio", "weight_decay")


def script_args(run: LMRun) -> list[str]:
    """``scripts/train_lm.py``'s options for ``run``'s settings (lesson 11 runs the same training
    under torchrun); --snapshot, --out and the fault injection are the caller's to add.

    ValueError names a setting the script has no option for, when ``run`` changed it.
    """
    defaults = {**asdict(GPTConfig()), **asdict(LMRun())}
    given = {**asdict(run.model), **asdict(run)}
    if changed := [k for k in _NOT_ON_THE_COMMAND_LINE if given[k] != defaults[k]]:
        raise ValueError(f"scripts/train_lm.py has no option for {', '.join(changed)}: "
                         "keep their defaults to run this training as the script")  # fmt: skip
    names = ("d_model", "n_layers", "n_heads", "seq_len", "steps", "batch_size", "lr", "warmup",
             "eval_every", "eval_batches", "seed", "tp", "snapshot_every")  # fmt: skip
    values = {k: given[k] for k in names} | {k: given[k] or 0 for k in ("data_limit", "val_limit")}
    options = [f"--{k.replace('_', '-')}={v}" for k, v in values.items()]
    return ["--full", f"--parallel={run.parallel}", *options]


def lr_at(step: int, run: LMRun) -> float:
    """The learning rate of ``step`` (lesson 11): linear warm-up, then a cosine to lr / 10.

    A function of the step alone, so a resumed run needs no scheduler state.
    """
    if step < run.warmup:
        return run.lr * (step + 1) / run.warmup
    done = (step - run.warmup) / max(1, run.steps - run.warmup)
    return run.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


def make_optimizer(model: nn.Module, run: LMRun) -> torch.optim.AdamW:
    """AdamW with weight decay on the 2-D weights other than the position embedding (lesson 11)."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 and "pos_emb" not in name else rest).append(p)
    groups = [{"params": decay, "weight_decay": run.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=run.lr, betas=(0.9, 0.95))


def check_parallel(run: LMRun, world_size: int) -> tuple[int, int]:
    """The data-parallel and tensor-parallel sizes of ``run`` on ``world_size`` ranks (lesson 11).

    Raises ValueError, saying what to change, when the ranks do not fit the parallelism, the
    heads do not split over the tensor-parallel ranks, or the batch does not split over the
    data-parallel ones. Called before any rank talks to another.
    """
    if run.parallel not in PARALLELS:
        raise ValueError(f"parallel must be one of {PARALLELS}, got {run.parallel!r}")
    if run.parallel == "single" and world_size != 1:
        raise ValueError(
            f"--parallel single trains on one process, but this job has {world_size} ranks: "
            "start it without torchrun (or with --nproc-per-node=1), or choose ddp, fsdp or fsdp_tp"
        )
    tp = run.tp if run.parallel == "fsdp_tp" else 1
    if run.parallel == "fsdp_tp" and (tp < 1 or world_size % tp or world_size // tp < 2):
        raise ValueError(
            f"--parallel fsdp_tp needs a mesh of at least 2 data-parallel x {tp} tensor-parallel "
            f"ranks, so a world size that is a multiple of {tp} and at least {2 * tp}; this job "
            f"has {world_size}. Start {2 * tp} ranks (e.g. --nproc-per-node={2 * tp}), change "
            "--tp, or choose fsdp"
        )
    if tp > 1:
        check_heads(run.model.n_heads, tp)  # names the head rule and how to mend it
    dp = world_size // tp
    if run.batch_size % dp:
        raise ValueError(
            f"--batch-size {run.batch_size} does not split over {dp} data-parallel ranks: "
            f"choose a multiple of {dp}"
        )
    return dp, tp


def check_backend(run: LMRun, env: DistEnv) -> None:
    """Refuse FSDP2 (and FSDP2 x TP) on CUDA ranks that talk over gloo (lesson 11).

    ``DistEnv.from_environ`` gives ranks sharing a GPU the gloo backend; FSDP2's all-gathers and
    reduce-scatters of CUDA tensors over gloo are not what these lessons test, so such a run
    stops at once (ValueError) saying what to do instead.
    """
    if run.parallel in ("fsdp", "fsdp_tp") and env.backend == "gloo" and env.device.type == "cuda":
        raise ValueError(
            f"--parallel {run.parallel} on CUDA needs NCCL, one rank per GPU, but these ranks "
            "share GPUs over gloo: start at most as many ranks per node as it has GPUs "
            "(--nproc-per-node), or train on the CPU with --device cpu"
        )


@functools.lru_cache(maxsize=1)
def lesson_apply_fsdp() -> Callable[..., nn.Module]:
    """Lesson 08b's ``apply_fsdp``, read from its notebook (lesson 11 reuses it, never a copy).

    It wraps ``model.blocks`` one FSDP2 group each, then the root: the GPT has the same shape.
    """
    namespace = {
        "Net": nn.Module, "DeviceMesh": DeviceMesh, "MixedPrecisionPolicy": MixedPrecisionPolicy,
        "fully_shard": fully_shard, "dist": dist, "torch": torch, "nn": nn,
    }  # fmt: skip
    lesson = load_lesson_code("08b", ["apply_fsdp"], namespace, course_root() / "notebooks")
    return lesson.apply_fsdp


@functools.lru_cache(maxsize=1)
def lesson_parallelize() -> Callable[[GPT, LMRun, DistEnv], tuple[nn.Module, int, int]]:
    """Lesson 11's own ``parallelize``, read from its notebook with its ``apply_gpt_tp``.

    The lesson writes the wraps in its cells (DDP; 08b's ``apply_fsdp``; the GPT's
    tensor-parallel plan, then ``apply_fsdp`` on the 2-D mesh's ``dp`` columns);
    ``scripts/train_lm.py``, the benchmark and the tests run those cells' code, never a copy.
    """
    namespace = {
        "GPT": GPT, "LMRun": LMRun, "DistEnv": DistEnv, "DeviceMesh": DeviceMesh, "nn": nn,
        "DDP": DDP, "init_device_mesh": init_device_mesh, "check_parallel": check_parallel,
        "check_heads": check_heads, "parallelize_module": parallelize_module,
        "ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
        "apply_fsdp": lesson_apply_fsdp(),
    }  # fmt: skip
    lesson = load_lesson_code("11", ["apply_gpt_tp", "parallelize"], namespace,
                              course_root() / "notebooks")  # fmt: skip
    return lesson.parallelize


def parallelize(model: GPT, run: LMRun, env: DistEnv) -> tuple[nn.Module, int, int]:
    """``model`` wrapped for ``run.parallel`` by lesson 11's own ``parallelize`` (its notebook's
    cell); also this rank's data-parallel index and the data-parallel size."""
    return lesson_parallelize()(model, run, env)


# --- DCP checkpoints, by lesson 07's rules -------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when no group exists: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _fsync_folder(folder: Path) -> None:
    """Make renames in ``folder`` durable (POSIX); some network file systems refuse: fine."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    path: Path, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
) -> None:
    """Every rank writes its shards to ``PATH.tmp`` with DCP; rank 0 adds meta.json and renames.

    A collective that returns once the checkpoint is in place. The rename order keeps a
    complete checkpoint at every moment: the old ``PATH.prev`` is removed, ``PATH`` becomes
    ``PATH.prev``, ``PATH.tmp`` becomes ``PATH``. ``meta``: settings, step, history. Then every
    rank checks that it sees the result (:func:`_check_every_rank_sees`).
    """
    tmp, prev = sibling(path, ".tmp"), sibling(path, ".prev")
    if env.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a write that was killed: never read
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    with _one_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    if env.is_main:
        with open(tmp / META, "w") as f:
            json.dump({"version": CHECKPOINT_VERSION, **meta}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_folder(tmp)
        if path.exists():
            shutil.rmtree(prev, ignore_errors=True)
            os.replace(path, prev)
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    _barrier()  # no rank goes on before the checkpoint is in place
    _check_every_rank_sees(path, env)


def _sees(path: Path) -> bool:
    """Whether this rank sees the finished checkpoint ``path``: its meta.json, written last."""
    return (path / META).is_file()


def _check_every_rank_sees(path: Path, env: DistEnv) -> None:
    """Every rank says whether it sees the checkpoint rank 0 just renamed into place; if one does
    not, all raise the same error now (lesson 11). A collective.

    On node-local storage the other nodes' ranks would only fail at the next resume, inside
    ``dcp.load``, while the rest waited for them until the timeout.
    """
    flags = torch.zeros(env.world_size, device=env.device)
    flags[env.rank] = float(_sees(path))
    if _distributed():
        dist.all_reduce(flags)
    blind = [rank for rank, seen in enumerate(flags.tolist()) if seen < 1]
    if blind:
        raise RuntimeError(
            f"train_lm: rank(s) {blind} do not see the checkpoint {path} that this run just "
            "wrote (every rank wrote its shards, then rank 0 renamed the folder into place): "
            "--snapshot must be on storage every node sees (a shared file system), not a "
            "node-local folder such as /tmp"
        )


def _read_meta(folder: Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint folder; ValueError when it is not one."""
    if not (folder / ".metadata").is_file():
        raise ValueError("no DCP .metadata (the write did not finish)")
    meta = json.loads((folder / META).read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{META} holds no settings")
    return meta  # another format's version is refused by find_checkpoint, not moved aside


def _probe(path: Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest complete checkpoint among PATH and PATH.prev (rank 0 only), and notes."""
    notes = []
    tmp = sibling(path, ".tmp")
    if tmp.exists():
        notes.append(f"{tmp} is a leftover of an interrupted write: ignored and removed")
        shutil.rmtree(tmp, ignore_errors=True)
    for candidate in (path, sibling(path, ".prev")):
        if not candidate.exists():
            continue
        try:
            return candidate, _read_meta(candidate), notes
        except (OSError, ValueError) as exc:  # missing or unreadable meta.json, bad JSON too
            aside = sibling(candidate, ".corrupt")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(candidate, aside)
            notes.append(f"{candidate} is incomplete or unreadable ({exc}); moved aside to {aside}")
    return None, None, notes


def mismatch(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why a run with settings ``now`` cannot resume from ``saved`` ones (None: it can)."""
    for key in MUST_MATCH:
        if saved.get(key) != now.get(key):
            return f"{key} was {saved.get(key)!r} in the checkpoint's run, {now.get(key)!r} now"
    return None


def find_checkpoint(
    path: Path | None, env: DistEnv, now: dict[str, Any]
) -> tuple[Path, dict] | None:
    """The checkpoint to resume from, the same on every rank (None: a fresh start). A collective.

    Rank 0 looks at PATH, then PATH.prev; an incomplete one is moved aside to ``.corrupt``. One
    from other settings is refused (SystemExit naming the setting and what to do).
    """
    if path is None:
        return None
    found = _probe(path) if env.is_main else (None, None, [])
    for note in found[2]:
        print(f"[{node_name()}] {note}")
    shared = [None if found[0] is None else (str(found[0]), found[1])]
    if _distributed():
        dist.broadcast_object_list(shared, src=0)
    if shared[0] is None:
        if env.is_main:
            print(f"no usable checkpoint at {path}: a fresh start")
        return None
    where, meta = Path(shared[0][0]), shared[0][1]
    if meta.get("version") != CHECKPOINT_VERSION:  # written by another version of this code
        version = meta.get("version")
        why = f"it is in checkpoint format {version}, this code reads {CHECKPOINT_VERSION}"
    else:
        why = mismatch({**meta["settings"], "step": meta["step"]}, now)
    if why is not None:
        again = retries_refuse_alike()
        raise SystemExit(
            f"train_lm: cannot resume from {where}: {why}. Start this configuration with another "
            f"--snapshot folder, or delete {path} (and its .prev) to start afresh{again}."
            if env.local_rank == 0 else 1
        )
    if env.is_main:
        print(f"resuming from {where} at step {meta['step']}")
    return where, meta


def load_checkpoint(where: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a DCP checkpoint into the wrapped ``model`` and its ``optimizer``, in place."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with _one_process_quiet():
        dcp.load(state, checkpoint_id=where)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


# --- the run -------------------------------------------------------------------------------------
def _mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks (tensor-parallel ranks hold equal copies)."""
    if _distributed():
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def _stop(env: DistEnv) -> bool:
    return _distributed() and stop_requested(env.device)


def training_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Lesson 11's precision: autocast to ``training_dtype`` on CUDA (bfloat16 from compute
    capability 8.0, float16 before); on the CPU nothing, so the run stays float32."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=training_dtype(device))
    return contextlib.nullcontext()


def train_lm(
    env: DistEnv,
    run: LMRun,
    parallelize: Callable[[GPT, LMRun, DistEnv], tuple[nn.Module, int, int]] | None = None,
) -> dict[str, Any]:
    """One rank's training run of lesson 11's GPT; returns what result.json holds.

    The global batch of step s is ``get_batch(train, s, ...)``, each data-parallel rank taking its
    rows, so every parallelism trains on the same sequences as one device. Resumes from
    ``run.snapshot`` when a usable checkpoint is there. On CUDA in ``training_dtype``'s
    precision (autocast; float16 with a GradScaler), on the CPU in float32. ``parallelize``
    wraps the model (default: lesson 11's, read from its notebook; the notebook passes its own).
    """
    dp, _ = check_parallel(run, env.world_size)
    check_backend(run, env)
    dtype = training_dtype(env.device)  # float32 on the CPU
    scaler = torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16)
    cfg = run.model
    train = stdlib_bytes("train", run.data_limit)
    val = stdlib_bytes("val", run.val_limit)
    settings = {**run.settings(), "world_size": env.world_size}
    found = find_checkpoint(run.snapshot, env, settings)
    torch.manual_seed(run.seed)  # every rank builds the same weights; the wraps cut them
    wrap = parallelize if parallelize is not None else lesson_parallelize()
    model, dp_rank, dp_size = wrap(GPT(cfg).to(env.device), run, env)
    optimizer = make_optimizer(model, run)
    history: dict[str, list] = {"step": [], "train_loss": [], "lr": []}
    evals: dict[str, list] = {"step": [], "val_loss": []}
    start_step, written, resumed = 0, 0, None
    if found is not None:
        where, meta = found
        load_checkpoint(where, model, optimizer)
        start_step, history, evals = meta["step"], meta["history"], meta["evals"]
        if scaler.is_enabled() and "scaler" in meta:  # float16's loss scale goes on as it was
            scaler.load_state_dict(meta["scaler"])
        resumed = {"step": start_step, "path": str(where), "restarts": run.restarts}

    def checkpoint(step: int) -> None:
        nonlocal written
        meta = {"settings": settings, "step": step, "history": history, "evals": evals}
        if scaler.is_enabled():
            meta["scaler"] = scaler.state_dict()  # plain numbers: JSON holds them
        save_checkpoint(run.snapshot, env, model, optimizer, meta)
        written += 1

    def validate(step: int) -> None:
        with training_autocast(env.device):
            loss = evaluate(model, val, run.eval_batches, run.batch_size, cfg.seq_len, run.seed + 1,
                            dp_rank, dp_size, env.device)
        evals["step"].append(step)
        evals["val_loss"].append(_mean_over_ranks(torch.tensor(loss, device=env.device)))
        if env.is_main and not run.progress:  # a bar shows the run; the lesson plots these
            print(f"step {step}: validation loss {evals['val_loss'][-1]:.4f}", flush=True)

    if start_step == 0 and run.eval_every:
        validate(0)  # the untrained model's loss: about log(256) = 5.55
    model.train()
    seconds, timed_steps = 0.0, 0
    bar = progress_bar(total=run.steps, initial=start_step, desc=f"{run.parallel} steps",
                       unit="step", disable=not (run.progress and env.is_main))  # fmt: skip
    for step in range(start_step, run.steps):
        if step == run.kill_at_step:
            maybe_die(env, run)  # fault injection (first attempt only)
        began = time.perf_counter()
        lr = lr_at(step, run)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(train, step, run.batch_size, cfg.seq_len, run.seed, dp_rank, dp_size,
                         env.device)
        with training_autocast(env.device):
            loss = lm_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        # DDP and FSDP2 average the gradients over the data-parallel ranks. A disabled scaler
        # (bfloat16, float32) passes the loss through and calls optimizer.step() as it is.
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        history["step"].append(step + 1)
        history["train_loss"].append(_mean_over_ranks(loss))  # waits for the step: timed in it
        history["lr"].append(lr)
        if step > start_step:  # the attempt's first step also sets up (FSDP2, allocator): left out
            seconds += time.perf_counter() - began
            timed_steps += 1
        done = step + 1
        bar.update()
        bar.set_postfix(loss=f"{history['train_loss'][-1]:.3f}", refresh=False)
        if env.is_main and not run.progress and (done % 10 == 0 or done == run.steps):
            print(f"step {done}/{run.steps}: train loss {history['train_loss'][-1]:.4f}",
                  flush=True)
        if run.eval_every and (done % run.eval_every == 0 or done == run.steps):
            validate(done)
        stopping = _stop(env)
        if run.snapshot is not None and (
            stopping or done == run.steps or (run.snapshot_every and done % run.snapshot_every == 0)
        ):
            checkpoint(done)
        if stopping:
            bar.close()
            if env.is_main:
                print(f"stopped by a signal after step {done}: the same command resumes")
            return {"stopped_after_step": done}
    bar.close()
    tokens = timed_steps * run.batch_size * cfg.seq_len
    outcome = {
        "parallel": run.parallel, "world_size": env.world_size, "mesh": [dp, env.world_size // dp],
        "backend": env.backend if _distributed() else None, "device": str(env.device),
        "dtype": str(dtype).removeprefix("torch."), "grad_scaler": scaler.is_enabled(),
        "restart_count": run.restarts, "resumed_from": resumed, "steps": run.steps,
        "history": history, "evals": evals, "config": settings, "checkpoints_written": written,
        "tokens_per_s": tokens / seconds if seconds else None,
        "parameters": sum(p.numel() for p in GPT(cfg).parameters()),
    }  # fmt: skip
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
    if env.is_main:
        finish(run, full, outcome)
    _barrier()  # no rank goes on before the files are complete
    return outcome


def finish(run: LMRun, full_state: dict[str, torch.Tensor], outcome: dict[str, Any]) -> None:
    """Rank 0: a sample from the trained weights into ``outcome``; model.pt and result.json."""
    single = GPT(run.model)
    missing, unexpected = single.load_state_dict(full_state, strict=False)
    if unexpected or set(missing) - {"head.weight"}:  # the tied head may be listed once only
        raise RuntimeError(f"gathered weights do not fit the GPT: {missing=}, {unexpected=}")
    if run.sample_bytes:
        text = generate(single, b"def ", run.sample_bytes, temperature=0.8, seed=run.seed)
        outcome["sample"] = (b"def " + text).decode("utf-8", errors="replace")
    if run.out is not None:
        run.out.mkdir(parents=True, exist_ok=True)
        torch.save(single.state_dict(), run.out / "model.pt")
        (run.out / "result.json").write_text(json.dumps(outcome, indent=2) + "\n")
