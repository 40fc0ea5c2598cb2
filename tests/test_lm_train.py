"""Lesson 11's training (mgpu_helpers.lm_train, scripts/train_lm.py): the loss falls, every
parallelism equals one device, DCP checkpoints resume exactly, and torchrun restarts a killed rank.

make test runs one cheap end-to-end check (a quick one-process run and its resume, in this
process) and the unit tests; the torchrun jobs are marked slow (make test-long).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from procs import sigterm_once_written

import mgpu_helpers.lm_train as lm_train
from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.jobs import JobResult, run_jobs
from mgpu_helpers.launch import launch
from mgpu_helpers.lm import GPT, GPTConfig, get_batch, lm_loss, stdlib_bytes
from mgpu_helpers.lm_train import (
    LMRun,
    _probe,
    check_backend,
    check_parallel,
    find_checkpoint,
    lesson_apply_fsdp,
    lr_at,
    make_optimizer,
    parallelize,
    save_checkpoint,
    train_lm,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_lm.py"
# One store per attempt (scripts/train_ddp.py says why) and one thread per rank, so every run
# sums in the same order.
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
TIMEOUT = 300  # seconds for a wave of torchrun jobs; each takes ~10-30 s on a busy 2-core machine
ONE_CPU = DistEnv(0, 0, 1, torch.device("cpu"), "gloo")
QUICK = LMRun(
    model=GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4), steps=20, batch_size=8,
    lr=3e-3, warmup=5, data_limit=300_000, val_limit=60_000, eval_every=10, eval_batches=2,
    sample_bytes=0,
)  # fmt: skip


# --- one cheap end-to-end check (make test) ------------------------------------------------------
def test_quick_run_learns_and_resumes_bit_for_bit(tmp_path):
    """The quick budget lowers both losses; a run resumed from its step-10 checkpoint ends with
    the uninterrupted run's weights and losses, bit for bit (one process, in this one)."""
    run = replace(QUICK, snapshot=tmp_path / "ck", snapshot_every=10, out=tmp_path / "a")
    whole = train_lm(ONE_CPU, run)
    losses, val = whole["history"]["train_loss"], whole["evals"]["val_loss"]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, f"train loss did not fall: {losses}"
    assert whole["evals"]["step"] == [0, 10, 20] and val[-1] < val[0] - 0.5, val
    assert whole["checkpoints_written"] == 2 and whole["resumed_from"] is None
    # Step 20's checkpoint removed: the one of step 10 (now .prev) is what a restart finds.
    shutil.rmtree(tmp_path / "ck")
    again = train_lm(ONE_CPU, replace(run, out=tmp_path / "b"))
    assert again["resumed_from"]["step"] == 10 and again["resumed_from"]["path"].endswith("prev")
    assert again["history"] == whole["history"] and again["evals"] == whole["evals"]
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)
    result = json.loads((tmp_path / "a" / "result.json").read_text())
    assert result["config"]["model"]["d_model"] == 64 and result["parameters"] > 0
    assert result["dtype"] == "float32" and result["grad_scaler"] is False  # the CPU: no autocast


# --- unit tests ----------------------------------------------------------------------------------
def test_learning_rate_warms_up_then_decays_to_a_tenth():
    run = LMRun(steps=100, lr=1e-3, warmup=10)
    assert lr_at(0, run) == pytest.approx(1e-4) and lr_at(9, run) == pytest.approx(1e-3)
    rates = [lr_at(s, run) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert rates[-1] == pytest.approx(1e-4)


def test_weight_decay_spares_norms_and_the_position_embedding():
    torch.manual_seed(0)
    model = GPT(QUICK.model)
    decay, rest = make_optimizer(model, QUICK).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == QUICK.weight_decay and rest["weight_decay"] == 0
    assert "tok_emb.weight" in {names[id(p)] for p in decay["params"]}  # the tied head's too
    assert {names[id(p)] for p in rest["params"]} >= {"pos_emb.weight", "norm.weight"}


@pytest.mark.parametrize(
    "parallel, world_size, changes, match",
    [
        ("single", 2, {}, "one process"),
        ("fsdp_tp", 2, {}, "at least 4"),
        ("fsdp_tp", 6, {"tp": 4}, "multiple of 4"),
        ("fsdp_tp", 4, {"model": GPTConfig(n_heads=1, d_model=32)}, "HEADS|heads"),
        ("ddp", 3, {}, "batch-size 16 does not split over 3"),
        ("pipeline", 2, {}, "parallel must be one of"),
    ],
)
def test_ranks_that_do_not_fit_are_refused_saying_why(parallel, world_size, changes, match):
    with pytest.raises(ValueError, match=match):
        check_parallel(replace(LMRun(), parallel=parallel, **changes), world_size)


@pytest.mark.parametrize("parallel", ["fsdp", "fsdp_tp"])
def test_fsdp_on_gpus_shared_over_gloo_is_refused_saying_what_to_do(parallel):
    run = replace(LMRun(), parallel=parallel)
    shared = DistEnv(0, 0, 4, torch.device("cuda", 0), "gloo")  # what from_environ gives them
    with pytest.raises(ValueError, match="one rank per GPU.*--nproc-per-node.*--device cpu"):
        check_backend(run, shared)
    check_backend(run, DistEnv(0, 0, 4, torch.device("cpu"), "gloo"))  # the CPU: fine
    check_backend(run, DistEnv(0, 0, 4, torch.device("cuda", 0), "nccl"))
    check_backend(replace(run, parallel="ddp"), shared)  # DDP over gloo on GPUs: lesson 04's


def test_fsdp_wrap_is_lesson_08bs_own():
    """lesson_apply_fsdp reads apply_fsdp from lesson 08b's notebook: renaming it fails here."""
    apply_fsdp = lesson_apply_fsdp()
    assert apply_fsdp.__name__ == "apply_fsdp" and "08b" in apply_fsdp.__code__.co_filename


def test_fitting_meshes():
    assert check_parallel(replace(LMRun(), parallel="fsdp_tp"), 4) == (2, 2)
    assert check_parallel(replace(LMRun(), parallel="fsdp_tp", tp=2), 8) == (4, 2)
    assert check_parallel(replace(LMRun(), parallel="ddp"), 2) == (2, 1)


def _saved(folder: Path, step: int, run: LMRun = QUICK) -> None:
    torch.manual_seed(0)
    model = GPT(run.model)
    meta = {"settings": {**run.settings(), "world_size": 1}, "step": step, "history": {},
            "evals": {}}
    save_checkpoint(folder, ONE_CPU, model, make_optimizer(model, run), meta)


def test_checkpoint_replaces_atomically_and_keeps_the_previous(tmp_path):
    ck = tmp_path / "ck"
    _saved(ck, 5)
    _saved(ck, 10)
    assert json.loads((ck / "meta.json").read_text())["step"] == 10
    assert json.loads((tmp_path / "ck.prev" / "meta.json").read_text())["step"] == 5
    assert not (tmp_path / "ck.tmp").exists()


def test_incomplete_checkpoint_is_moved_aside_and_prev_used(tmp_path):
    ck = tmp_path / "ck"
    _saved(ck, 5)
    _saved(ck, 10)
    (ck / "meta.json").unlink()  # killed before rank 0 wrote it
    (tmp_path / "ck.tmp").mkdir()  # and a leftover of a later write
    where, meta, notes = _probe(ck)
    assert where == tmp_path / "ck.prev" and meta["step"] == 5
    assert (tmp_path / "ck.corrupt").is_dir() and not (tmp_path / "ck.tmp").exists()
    assert any("moved aside" in n for n in notes) and any("leftover" in n for n in notes)


def test_checkpoint_of_other_settings_is_refused_naming_the_setting(tmp_path):
    _saved(tmp_path / "ck", 5)
    now = {**replace(QUICK, lr=1e-3).settings(), "world_size": 1}
    with pytest.raises(SystemExit, match="lr was 0.003 in the checkpoint's run, 0.001 now.*delete"):
        find_checkpoint(tmp_path / "ck", ONE_CPU, now)
    same = {**QUICK.settings(), "world_size": 1}
    assert find_checkpoint(tmp_path / "ck", ONE_CPU, same)[1]["step"] == 5


def test_checkpoint_of_another_format_is_refused_not_moved_aside(tmp_path):
    _saved(tmp_path / "ck", 5)
    meta_file = tmp_path / "ck" / "meta.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "version": 0}))
    now = {**QUICK.settings(), "world_size": 1}
    with pytest.raises(SystemExit, match="checkpoint format 0, this code reads"):
        find_checkpoint(tmp_path / "ck", ONE_CPU, now)
    assert meta_file.is_file() and not (tmp_path / "ck.corrupt").exists()  # kept, not discarded


def _script() -> types.ModuleType:
    """scripts/train_lm.py as a module (its top level runs, main() does not)."""
    spec = importlib.util.spec_from_file_location("train_lm_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_without_torchrun_says_how_to_start_it(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    script = _script()
    with pytest.raises(SystemExit, match=r"(?s)at least 4.*torchrun --standalone "
                       r"--nproc-per-node=4 .*train_lm.py --parallel fsdp_tp"):
        script.main(["--parallel", "fsdp_tp", "--quick"])
    args = script.parse_args(["--quick", "--steps", "4"])
    assert script.run_options(args, 1).steps == 4  # a value given wins over quick mode's
    assert script.run_options(args, 1).model.d_model == 64


def test_script_args_give_the_script_the_same_run_and_quick_run_applies_quick_mode():
    """Lesson 11 runs its notebook's training as scripts/train_lm.py: the options script_args
    writes must parse back into the same LMRun (quick mode's sizes included), whatever
    $MGPU_QUICK says."""
    script = _script()
    for run in (lm_train.quick_run(LMRun(parallel="fsdp", seed=3, snapshot_every=10)),
                LMRun(parallel="fsdp_tp", steps=7, lr=1e-3, data_limit=None, tp=2)):
        parsed = script.run_options(script.parse_args(lm_train.script_args(run)), 4)
        assert replace(parsed, kill_rank=0) == run
    quick = lm_train.quick_run(LMRun(seed=5))
    assert quick.model.d_model == lm_train.QUICK["d_model"]
    assert quick.steps == lm_train.QUICK["steps"]
    assert quick.seed == 5 and quick.model.vocab_size == 256
    with pytest.raises(ValueError, match="no option for weight_decay"):
        lm_train.script_args(LMRun(weight_decay=0.0))


# --- gradients and checkpoints on real ranks (mgpu_helpers.launch) -----------------------------
def _gradients(env: DistEnv, parallel: str, summed: bool = False) -> dict[str, torch.Tensor]:
    """The full gradients after one forward and backward of QUICK's GPT on step 0's batch under
    ``parallel``, no optimizer step, keyed by the plain model's names. ``summed``: the loss times
    the data-parallel size, which is what summing the ranks' gradients instead of averaging gives.
    """
    run = replace(QUICK, parallel=parallel)
    torch.manual_seed(run.seed)
    model, dp_rank, dp_size = parallelize(GPT(run.model).to(env.device), run, env)
    x, y = get_batch(stdlib_bytes("train", run.data_limit), 0, run.batch_size, run.model.seq_len,
                     run.seed, dp_rank, dp_size, env.device)
    (lm_loss(model(x), y) * (dp_size if summed else 1)).backward()
    grads = {}
    for name, param in model.named_parameters():  # full_tensor(): a collective, on every rank
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[name.removeprefix("module.")] = grad.detach().cpu().clone()
    return grads


def _blind_rank_refused(env: DistEnv, folder: Path) -> str | None:
    """save_checkpoint with rank 1 made not to see the finished checkpoint (as on node-local
    storage of another node): what this rank raised (None: nothing)."""
    torch.manual_seed(0)
    model = GPT(QUICK.model)
    meta = {"settings": QUICK.settings(), "step": 0, "history": {}, "evals": {}}
    sees = lm_train._sees
    lm_train._sees = lambda path: env.rank != 1 and sees(path)
    try:
        save_checkpoint(folder / "ck", env, model, make_optimizer(model, QUICK), meta)
    except RuntimeError as exc:
        return str(exc)
    finally:
        lm_train._sees = sees
    return None


def _on_two_ranks(env: DistEnv, folder: Path) -> dict:
    """The 2-rank launch: DDP's and FSDP2's gradients, right and summed; a rank that is blind."""
    out = {p + (" summed" if summed else ""): _gradients(env, p, summed)
           for p in ("ddp", "fsdp") for summed in (False, True)}  # fmt: skip
    return {"grads": out if env.is_main else None, "blind": _blind_rank_refused(env, folder)}


def _on_four_ranks(env: DistEnv) -> dict | None:
    """The 4-rank launch: FSDP2 x TP's gradients on the 2 x 2 mesh, right and summed."""
    out = {"fsdp_tp" + (" summed" if s else ""): _gradients(env, "fsdp_tp", s) for s in (0, 1)}
    return out if env.is_main else None


@pytest.fixture(scope="module")
def one_device_gradients() -> dict[str, torch.Tensor]:
    return _gradients(ONE_CPU, "single")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("two_ranks")
    return launch(_on_two_ranks, 2, folder, device="cpu", echo=False, timeout=60)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return launch(_on_four_ranks, 4, device="cpu", echo=False, timeout=90)


# One backward, no optimizer step: the only difference from one device is the order of float32
# sums (two half-batch means averaged; TP's row-parallel products summed in two parts). Measured
# on 2 and 4 CPU ranks: 1.2e-7 of the largest gradient entry for each. A gradient summed over 2
# data-parallel ranks instead of averaged is off by the whole gradient: 1.0, 1e5 times GRAD_RTOL.
GRAD_RTOL = 1e-5


def _gradient_gap(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest difference from the reference's gradients, over its largest entry."""
    assert grads.keys() == reference.keys()
    largest = max(g.abs().max().item() for g in reference.values())
    return max((grads[k] - reference[k]).abs().max().item() for k in grads) / largest


@pytest.mark.slow  # make test-long: one 2-rank and one 4-rank launch
@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "fsdp_tp"])
def test_gradients_equal_one_devices_and_summed_ones_do_not(
    parallel, one_device_gradients, two_ranks, four_ranks
):
    """Averaged, not summed: AdamW hides a factor in the gradient (it divides by the gradient's
    own size), so the weights after 20 steps barely show it; the gradients themselves do."""
    grads = (four_ranks if parallel == "fsdp_tp" else two_ranks)[0]
    grads = grads if parallel == "fsdp_tp" else grads["grads"]
    gap = _gradient_gap(grads[parallel], one_device_gradients)
    assert gap < GRAD_RTOL, f"{parallel}: gradients {gap:.1e} (relative) from one device's"
    summed = _gradient_gap(grads[parallel + " summed"], one_device_gradients)
    assert summed > 1000 * GRAD_RTOL, f"{parallel}: a summed gradient passed ({summed:.1e})"


@pytest.mark.slow  # make test-long: the same 2-rank launch
def test_a_rank_that_cannot_see_the_checkpoint_stops_every_rank(two_ranks):
    """Rank 1 made not to see the checkpoint rank 0 renamed into place: both ranks raise at
    once, naming the rank and the rule (no rank waits for it until the timeout)."""
    for result in two_ranks:
        assert result["blind"] is not None, "a blind rank was not noticed"
        assert "rank(s) [1] do not see" in result["blind"]
        assert "--snapshot must be on storage every node sees" in result["blind"]


# --- torchrun jobs (make test-long) --------------------------------------------------------------
def _cmd(out: Path, parallel: str, nproc: int, *extra: str, restarts: int = 0) -> list[str]:
    """The script under torchrun (or one plain process for ``single``), quick mode on the CPU."""
    args = [str(SCRIPT), "--device", "cpu", "--quick", "--parallel", parallel, "--out", str(out),
            *extra]
    if parallel == "single":
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", *args]


def _result(out: Path, job: JobResult) -> dict:
    assert job.ok, f"exit status {job.returncode}:\n{job.tail()}"
    return json.loads((out / "result.json").read_text())


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


VARIANTS = {"single": 1, "ddp": 2, "fsdp": 2, "fsdp_tp": 4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Wave 1: each parallelism's quick run. Wave 2: DDP, FSDP (2 ranks) and FSDP2 x TP (4) with
    a rank killed at step 12 and one restart, resuming from the step-10 checkpoint (checkpoints
    every 5 steps)."""
    tmp = tmp_path_factory.mktemp("train_lm")
    first = run_jobs([_cmd(tmp / p, p, n) for p, n in VARIANTS.items()], timeout=TIMEOUT,
                     env=ENV, cwd=ROOT, echo=False)
    kill = ("--snapshot-every", "5", "--kill-at-step", "12")
    killed = {p: tmp / f"{p}_killed" for p in ("ddp", "fsdp", "fsdp_tp")}
    second = run_jobs(
        [_cmd(out, p, VARIANTS[p], "--snapshot", str(out / "ck"), *kill, restarts=1)
         for p, out in killed.items()],
        timeout=TIMEOUT, env=ENV, cwd=ROOT, echo=False,
    )  # fmt: skip
    results = {p: _result(tmp / p, job) for p, job in zip(VARIANTS, first, strict=True)}
    jobs = dict(zip(killed, second, strict=True))
    return {"tmp": tmp, "results": results, "killed": killed, "jobs": jobs}


# Tolerances against one device: DDP and FSDP average two half-batch means where one device takes
# one mean over the whole batch, and tensor parallelism sums each row-parallel product in two
# parts; float32 rounds those sums differently, so nothing here is bitwise. Measured on 2-4 CPU
# ranks over the 20 quick steps: losses within 5e-7, weights within 6e-6. Adam divides each
# update by the gradient's own size, so a rounding difference in a near-zero gradient can move a
# weight by up to lr (3e-3) a step: 1e-4 for the weights is far under that, and far over what
# rounding gave. A rank reading the wrong rows changes the losses by 1e-2 or more.
LOSS_ATOL, WEIGHT_ATOL = 1e-5, 1e-4


@pytest.mark.slow  # make test-long
@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "fsdp_tp"])
def test_every_parallelism_equals_one_device(runs, parallel):
    one, other = runs["results"]["single"], runs["results"][parallel]
    assert other["world_size"] == VARIANTS[parallel] and other["backend"] == "gloo"
    assert other["mesh"] == ([2, 2] if parallel == "fsdp_tp" else [VARIANTS[parallel], 1])
    for key, series in (("history", "train_loss"), ("evals", "val_loss")):
        a, b = torch.tensor(one[key][series]), torch.tensor(other[key][series])
        assert len(a) == len(b) and (a - b).abs().max() < LOSS_ATOL, f"{series}: {a} vs {b}"
    w1, w2 = _weights(runs["tmp"] / "single"), _weights(runs["tmp"] / parallel)
    assert w1.keys() == w2.keys()
    gap = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert gap < WEIGHT_ATOL, f"weights {gap:.1e} from one device's after 20 steps"
    assert one["history"]["train_loss"][-1] < one["history"]["train_loss"][0] - 1.0


@pytest.mark.slow  # make test-long
@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "fsdp_tp"])
def test_killed_rank_restarts_and_resumes_bit_for_bit(runs, parallel):
    """fsdp_tp: 2-D DTensor weights and AdamW state through DCP, 4 ranks, the last one killed."""
    out, job = runs["killed"][parallel], runs["jobs"][parallel]
    result = _result(out, job)
    assert "SIGKILL to myself after 12 optimizer steps" in job.output
    assert result["restart_count"] == 1 and result["resumed_from"]["step"] == 10
    reference = runs["results"][parallel]
    assert result["history"] == reference["history"] and result["evals"] == reference["evals"]
    ref_w, w = _weights(runs["tmp"] / parallel), _weights(out)
    assert [k for k in w if not torch.equal(w[k], ref_w[k])] == []


@pytest.mark.parametrize("option", ["--steps", "--batch-size", "--tp", "--d-model"])
def test_a_count_of_zero_is_refused(option, capsys):
    with pytest.raises(SystemExit):
        _script().parse_args([option, "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_the_slurm_script_options_parse():
    """scripts/slurm/train_ddp.sbatch passes these to $TRAIN_SCRIPT: train_lm.py takes them."""
    sbatch = (ROOT / "scripts" / "slurm" / "train_ddp.sbatch").read_text()
    passed = ("--device", "--snapshot", "--snapshot-every", "--out")
    assert all(f'  {opt} "' in sbatch for opt in passed)  # still what the sbatch script passes
    args = _script().parse_args(["--device", "auto", "--snapshot", "run/snapshot.pt",
                              "--snapshot-every", "0", "--out", "run"])
    assert args.snapshot == Path("run/snapshot.pt") and args.out == Path("run")


@pytest.mark.slow  # make test-long
def test_sigterm_to_torchrun_stops_with_a_checkpoint_and_resumes_bit_for_bit(runs):
    """SIGTERM to the agent (scancel, SLURM's time limit): the ranks agree on one step, a DCP
    checkpoint of it is written, no result.json; the same command resumes to the reference."""
    folder = runs["tmp"] / "sigterm"
    cmd = _cmd(folder, "fsdp", 2, "--snapshot", str(folder / "ck"), "--snapshot-every", "5")
    # once step 5's checkpoint is complete
    text = sigterm_once_written(cmd, folder / "ck" / "meta.json", runs["tmp"] / "sigterm.log",
                                ROOT, ENV, TIMEOUT)  # fmt: skip
    stops = re.findall(r"stopped by a signal after step (\d+)", text)
    assert len(stops) == 1, text
    meta = json.loads((folder / "ck" / "meta.json").read_text())
    assert meta["step"] == int(stops[0]) and 5 <= meta["step"] < 20, text
    assert not (folder / "result.json").exists(), "a stopped run wrote a result"
    (resumed,) = run_jobs([cmd], timeout=TIMEOUT, env=ENV, cwd=ROOT, echo=False)
    result = _result(folder, resumed)
    assert result["resumed_from"]["step"] == meta["step"]
    assert result["history"] == runs["results"]["fsdp"]["history"]
    ref_w, w = _weights(runs["tmp"] / "fsdp"), _weights(folder)
    assert [k for k in w if not torch.equal(w[k], ref_w[k])] == []


# --- on a GPU (scripts/gpu_check.sh) -------------------------------------------------------------
@pytest.mark.gpu
def test_quick_run_on_a_gpu_trains_in_the_training_dtype_and_learns(tmp_path):
    """On CUDA the script trains under autocast: bfloat16 from compute capability 8.0, float16
    with a GradScaler before; result.json says which, and the quick budget still lowers the loss
    (the MFU of lesson 11 divides its tokens/s by that dtype's peak)."""
    cmd = [sys.executable, str(SCRIPT), "--device", "cuda", "--quick", "--parallel", "single",
           "--out", str(tmp_path)]
    (job,) = run_jobs([cmd], timeout=180, env=ENV, cwd=ROOT, echo=False)
    result = _result(tmp_path, job)
    bf16 = torch.cuda.get_device_capability(0) >= (8, 0)  # GPU_CHECKLIST: not is_bf16_supported()
    assert result["device"].startswith("cuda"), result["device"]
    assert result["dtype"] == ("bfloat16" if bf16 else "float16")
    assert result["grad_scaler"] is (not bf16)
    losses, val = result["history"]["train_loss"], result["evals"]["val_loss"]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, f"train loss did not fall: {losses}"
    assert val[-1] < val[0] - 0.5, val
