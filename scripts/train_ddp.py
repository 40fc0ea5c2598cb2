"""Lesson 04b's DDP training as a script for ``torchrun``, with snapshots (lesson 07).

``train_ddp`` below is lesson 04b's worker (notebooks/04b_ddp_training_run.ipynb, section 2) plus
the lines a job on a cluster needs: it takes snapshots as it trains (model, optimizer, grad
scaler, epoch, position in the epoch, step, running metrics, history and every rank's random
number generators), and a restarted job resumes from the newest one, so that it ends exactly
where an uninterrupted run would: bitwise on the CPU with two ranks. With three or more, the
weights agree to the last bits only: DDP reorders its gradient buckets after a process's first
step, so the first step after a restart all-reduces in the initial order, and gloo's ring adds
three or more values in an order that depends on where a value sits in its bucket (two values
add alike in either order). Lesson 07 shows it as a diff against lesson 04b's worker; the
snapshot machinery sits in small functions around it.

One machine, two processes (``--standalone``: the agent finds a free port itself)::

    torchrun --standalone --nproc-per-node=2 scripts/train_ddp.py --epochs 5 --out runs/a

Two machines with 4 GPUs each: the same command on both, pointing at the first one's address
(c10d rendezvous; ``--rdzv-id`` names the job, the same on every node)::

    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=node0.example:29400 --rdzv-id=job42 \\
        scripts/train_ddp.py --dataset cifar10 --snapshot /scratch/job42/snapshot.pt

A rank that dies makes ``torchrun`` restart the whole group (up to ``--max-restarts`` times);
each new attempt resumes from the snapshot. ``--kill-at-step`` kills a rank on purpose::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 \\
        --max-restarts=1 scripts/train_ddp.py \\
        --snapshot /tmp/s.pt --snapshot-every 5 --kill-at-step 12 --out /tmp/run

Why the variable: by default ``torchrun`` keeps one key-value store for all attempts, and the
restarted ranks may read the dead ranks' addresses from it and fail to connect ("Connection
refused"; now and then, not on every restart: pytorch/pytorch#167288, open). With it set,
every attempt gets a fresh store.

Ctrl-C or SIGTERM to ``torchrun`` (``kill -TERM <agent>``, ``scancel``, SLURM's time limit):
the agent passes the signal to every worker; the ranks agree to stop after the step in
progress, rank 0 writes a snapshot, and the same command resumes from it.

Under SLURM, ``scripts/slurm/`` holds an sbatch script that starts one ``torchrun`` per node.
Started without ``torchrun`` (``python scripts/train_ddp.py``), the script says how to start it.
"""

# ruff: noqa: E501  (train_ddp keeps lesson 04b's lines as the notebook has them)
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler  # noqa: F401  (lesson 04b reads both)

from mgpu_helpers.config import DATASETS, MODELS, LessonConfig, apply_quick, course_root
from mgpu_helpers.data import build_datasets, make_loader
from mgpu_helpers.dist_env import DistEnv, exit_at_once
from mgpu_helpers.lesson_code import load_lesson_code
from mgpu_helpers.models import build_model
from mgpu_helpers.run_control import (  # lesson 07's pieces, shared with lesson 11's train_lm.py
    STOP_SIGNALS,
    job_restarts,
    maybe_die,
    node_name,
    on_stop_signal,
    retries_refuse_alike,
    sibling,
    stop_requested,
    torchrun_hint,
    warn_if_store_shared,
)
from mgpu_helpers.timing import synchronize
from mgpu_helpers.train import EpochResult, History, seed_everything

# Lesson 04b's own evaluation, read from its notebook: one copy of it exists, the lesson's.
NOTEBOOKS = course_root() / "notebooks"  # the course's, wherever the script is started from
lesson_04 = load_lesson_code("04b", ["real_samples", "evaluate_distributed"], globals(), NOTEBOOKS)
evaluate_distributed = lesson_04.evaluate_distributed

SNAPSHOT_VERSION = 1  # bumped when the snapshot's layout changes
# The settings a snapshot must share with the run that resumes from it; epochs may grow.
MUST_MATCH = ("dataset", "model", "batch_size", "lr", "momentum", "seed", "train_samples",
              "test_samples", "augment", "amp", "sync_bn")
METRICS = ("epoch", "train_loss", "train_acc", "test_loss", "test_acc")  # history kept and shown


@dataclass(frozen=True)
class RunOptions:
    """What the script adds to lesson 04b's parameters: snapshots, precision, output, faults."""

    snapshot: Path | None  # the snapshot file (None: no snapshots, no resume)
    snapshot_every: int  # also snapshot every N optimizer steps (0: after each epoch only)
    out: Path | None  # rank 0 writes result.json and model.pt here at the end
    amp: bool  # autocast as in lesson 06c: bf16 where supported, else fp16 with a GradScaler
    sync_bn: bool  # SyncBatchNorm, as lesson 04b's sync_bn (GPUs only)
    kill_at_step: int | None  # fault injection: a rank dies right before this global step
    kill_rank: int  # ... this rank
    restarts: int = 0  # torchrun's restarts before this attempt, the most any node's agent counts


# --- the worker: lesson 04b's train_ddp plus the snapshot lines ----------------------------------
def train_ddp(env: DistEnv, cfg: LessonConfig, run: RunOptions) -> dict[str, Any]:
    """Train cfg's model with DDP on this rank, snapshotting and resuming; returns the result."""
    device = env.device  # this rank's device
    # every rank seeds alike, but DDP's wrap copies rank 0's initial weights to all of them
    seed_everything(cfg.seed)  # the same initial weights and batch order every run
    train_set, test_set, info = build_datasets(cfg)
    sampler = ResumableSampler(train_set, env.world_size, env.rank, seed=cfg.seed)
    batch = cfg.batch_size // env.world_size  # per rank; the ranks together make the global batch
    train_loader = make_loader(train_set, batch, device, sampler=sampler)
    test_sampler = DistributedSampler(test_set, env.world_size, env.rank, shuffle=False)
    test_loader = make_loader(test_set, 256, device, sampler=test_sampler)
    snap = find_snapshot(env, run.snapshot, settings(cfg, run))  # the same on every rank
    model = build_model(cfg.model, info).to(device)
    if snap is not None:
        model.load_state_dict(snap["model"])  # before the wrap, which broadcasts rank 0's
    if run.sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # before the wrap
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    amp_dtype = autocast_dtype(device)  # lesson 06c: bf16 where supported, else fp16
    # fp16 needs its loss scaled (lesson 06c); disabled, the scaler passes everything through
    scaler = torch.amp.GradScaler(device.type, enabled=run.amp and amp_dtype == torch.float16)
    history = History()
    first_epoch, step, written = 0, 0, 0  # step: optimizer steps of the whole run
    if snap is not None:
        first_epoch, step, history = restore(snap, optimizer, scaler)
    for epoch in range(first_epoch, cfg.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        model.train()
        sums = torch.zeros(2, device=device)  # loss x samples, correct answers
        samples = 0  # counted on the host: the CPU knows every batch's size
        resuming = snap is not None and epoch == first_epoch  # part of this epoch is done
        if resuming:
            sums, samples = resume_epoch(snap, env, sampler)  # this rank's sums, skip what's done
        synchronize(device)  # earlier queued work (the last evaluation) is not this epoch's
        start = time.perf_counter()
        batches = iter(train_loader)  # draws a seed from the global RNG: restore it after this
        if resuming:
            set_rng_states(snap["ranks"], env)  # the RNG as the interrupted run had it here
        for inputs, targets in batches:
            if step == run.kill_at_step:
                maybe_die(env, run)  # fault injection (first attempt only)
            inputs, targets = inputs.to(device), targets.to(device)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=run.amp):
                outputs = model(inputs)
                loss = F.cross_entropy(outputs, targets)
            optimizer.zero_grad()
            # DDP averages the gradients over the ranks during backward()
            scaler.scale(loss).backward()  # with a disabled scaler: loss.backward()
            scaler.step(optimizer)  # with a disabled scaler: optimizer.step()
            scaler.update()
            sums[0] += loss.detach() * len(targets)
            sums[1] += (outputs.argmax(dim=1) == targets).sum()
            samples += len(targets)
            step += 1
            stopping = stop_requested(device)  # Ctrl-C or SIGTERM on any rank: all stop here
            # right after a step: every N steps, after the epoch's last (before evaluating), on a stop
            if snapshot_due(run, step, samples == sampler.num_samples) or (stopping and run.snapshot):
                state = {"epoch": epoch, "position": samples * env.world_size, "step": step}
                save_snapshot(run.snapshot, env, settings(cfg, run), state, model.module,
                              optimizer, scaler, sums, samples, history)
                written += 1
            if stopping:
                return stopped(env, run, step)
        dist.all_reduce(sums)  # the sums over all ranks, on every rank; waits for the slowest
        samples *= env.world_size  # the sampler gives every rank as many samples: the total
        loss_sum, correct = sums.tolist()  # waits for the device: one read per epoch
        seconds = time.perf_counter() - start
        result = EpochResult(loss_sum / samples, correct / samples, samples, seconds)
        test = evaluate_distributed(model, test_loader, device)  # each test sample counted once
        history.append(epoch + 1, result, test)
        if env.is_main:
            print(f"epoch {epoch + 1}: train loss {result.loss:.4f}, test accuracy {test.accuracy:.3f}")
    outcome = run_result(env, cfg, run, snap, step, history, written)
    if env.is_main and run.out is not None:  # every rank holds the same weights: one writes them
        write_outputs(run.out, model.module, outcome)
    dist.barrier()  # outside the if: no rank goes on before the files are complete
    return outcome


# --- where a resumed epoch starts ---------------------------------------------------------------
class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start its next pass part-way through (a resumed epoch).

    ``skip(position)`` takes the epoch's position in GLOBAL samples: the ranks together read
    interleaved slices of one shuffled list (rank r reads entries r, r + W, ...), so after
    ``position`` samples each rank has read its first ``position // W`` entries, whatever the
    world size W that read them (the global batch is a multiple of W). Only the next pass is
    shortened; later epochs are whole.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start = 0  # entries of this rank's list the next pass leaves out

    def skip(self, position: int) -> None:
        self.start = min(position // self.num_replicas, self.num_samples)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.start :]
        self.start = 0  # once: the next epoch starts at its beginning
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self.start


def snapshot_due(run: RunOptions, step: int, epoch_done: bool) -> bool:
    """Whether to snapshot after this optimizer step (every N steps, and at each epoch's end)."""
    if run.snapshot is None:
        return False
    return epoch_done or (run.snapshot_every > 0 and step % run.snapshot_every == 0)


# --- a clean stop: Ctrl-C or SIGTERM to torchrun, which passes it on to every worker --------------
def stopped(env: DistEnv, run: RunOptions, step: int) -> dict[str, Any]:
    """What a stopped rank returns (no result.json: the run is not over)."""
    if env.is_main:
        where = f"snapshot {run.snapshot} written" if run.snapshot else "no --snapshot: nothing kept"
        print(f"stopped by a signal after step {step}: {where}; the same command resumes", flush=True)
    return {"stopped_after_step": step}


# --- precision and fault injection -------------------------------------------------------------
def autocast_dtype(device: torch.device) -> torch.dtype:
    """Lesson 06c's choice: bf16 on CPUs and GPUs of compute capability 8.0+, else fp16.

    ``torch.cuda.is_bf16_supported()`` also says True where bf16 is only emulated (slowly),
    so the compute capability decides, as in lesson 06c.
    """
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return torch.float16
    return torch.bfloat16


# --- writing a snapshot -------------------------------------------------------------------------
def settings(cfg: LessonConfig, run: RunOptions) -> dict[str, Any]:
    """The run's configuration as plain values (in snapshots and result.json)."""
    values = asdict(cfg)
    keep = ("dataset", "model", "batch_size", "epochs", "lr", "momentum", "seed", "quick",
            "train_samples", "test_samples", "augment", "world_size")
    return {**{k: values[k] for k in keep}, "amp": run.amp, "sync_bn": run.sync_bn}


def rng_states(device: torch.device) -> dict[str, Any]:
    """This process's random number generators, as tensors and plain values only
    (``torch.load(weights_only=True)`` refuses NumPy arrays)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, state, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": [version, list(state), gauss_next],
    }


def set_rng_states(ranks: list[dict[str, Any]], env: DistEnv) -> None:
    """Give this rank its generators back, if the snapshot has one entry per rank as now.

    Called after the resumed epoch's iterator exists (creating it draws from the global RNG).
    DataLoader workers (CIFAR-10 on GPUs) draw their augmentation from seeds of their own,
    which this does not restore: such a run resumes the data order, not the augmentation.
    """
    if len(ranks) != env.world_size:
        return  # another world size: no state to give (resume_epoch said so)
    states = ranks[env.rank]["rng"]
    torch.set_rng_state(states["torch"].cpu())  # map_location may have moved it to the GPU
    if env.device.type == "cuda" and states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"].cpu(), env.device)
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, state, gauss_next = states["python"]
    random.setstate((version, tuple(state), gauss_next))


def save_snapshot(
    path: Path,
    env: DistEnv,
    config: dict[str, Any],
    state: dict[str, int],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    sums: torch.Tensor,
    samples: int,
    history: History,
) -> None:
    """Every rank sends rank 0 its RNG states and running sums; rank 0 writes the snapshot.

    A collective (every rank calls it), which returns once the snapshot is on disk: a rank that
    went on at once could die in its next step while rank 0 still writes, and torchrun would
    stop rank 0 mid-write, losing this snapshot. ``config``: the run's settings; ``state``:
    epoch (from 0), position (global samples of the epoch done) and step (optimizer steps done).
    """
    mine = {"rng": rng_states(env.device), "sums": sums.detach().cpu(), "samples": samples}
    ranks = [None] * env.world_size if env.is_main else None
    dist.gather_object(mine, ranks, dst=0)  # rank 0 gets every rank's entry, in rank order
    if env.is_main:
        snapshot = {
            "version": SNAPSHOT_VERSION,
            "settings": config,
            "world_size": env.world_size,
            **state,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),  # {} when disabled
            "history": {k: v for k, v in history.as_dict().items() if k in METRICS},
            "ranks": ranks,
        }
        write_atomically(path, snapshot)
    dist.barrier()  # outside the if: no rank goes on before the snapshot is complete


def write_atomically(path: Path, snapshot: dict[str, Any]) -> None:
    """Write ``snapshot`` to ``path`` so that a complete snapshot exists at every moment.

    The bytes go to ``PATH.tmp`` in the same folder (a rename is atomic only within one file
    system), forced to disk with fsync; then the current snapshot becomes ``PATH.prev`` and the
    new one takes its place with ``os.replace``, an atomic rename. A process killed mid-write
    leaves only a partial ``PATH.tmp``, which is never read; killed between the two renames, it
    leaves ``PATH.prev``, which the next start falls back to.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, prev = sibling(path, ".tmp"), sibling(path, ".prev")
    with open(tmp, "wb") as f:
        torch.save(snapshot, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the snapshot
    if path.exists():
        os.replace(path, prev)
    os.replace(tmp, path)
    if hasattr(os, "O_DIRECTORY"):  # the renames themselves reach the disk (POSIX)
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        except OSError:
            pass  # some network file systems refuse it; the renames are still atomic
        finally:
            os.close(folder)


# --- finding and loading a snapshot -------------------------------------------------------------
def probe(path: Path) -> tuple[dict[str, Any] | None, bytes | None, list[str]]:
    """This node's newest valid snapshot: its summary and bytes (None: none), and notes to show.

    Looks at ``PATH``, then ``PATH.prev``. A file that does not load (truncated, corrupt, not a
    snapshot) is renamed to ``<file>.corrupt``, so that a restart does not trip over it again,
    and the next candidate is tried. A leftover ``PATH.tmp`` (a write that was killed) is never
    read; it is removed. A file that cannot be read at all (permissions, a failing disk) is no
    proof of a bad snapshot: that is an error, and the file stays where it is.
    """
    notes = []
    tmp = sibling(path, ".tmp")
    if tmp.exists():
        notes.append(f"{tmp} is a leftover of an interrupted write: ignored and removed")
        tmp.unlink(missing_ok=True)
    for candidate in (path, sibling(path, ".prev")):
        try:
            data = candidate.read_bytes()
            snap = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            check_layout(snap)
        except FileNotFoundError:
            continue  # not there (or, on shared storage, another node moved it aside just now)
        except OSError as exc:
            raise RuntimeError(
                f"train_ddp.py: cannot read {candidate} ({exc.strerror or exc}); fix its "
                "permissions or storage, or move it away to start without it"
            ) from exc
        except Exception as exc:  # truncated zip, bad pickle, wrong contents: all unusable
            reason = str(exc).strip().split(". ")[0] or type(exc).__name__  # its first sentence
            notes.append(f"{candidate} is unreadable ({reason}); {move_aside(candidate)}")
            continue
        summary = {key: snap[key] for key in ("epoch", "position", "step")}
        return {**summary, "path": str(candidate), "node": node_name()}, data, notes
    return None, None, notes


def move_aside(candidate: Path) -> str:
    """Rename an unusable snapshot to ``<file>.corrupt``; what happened, for the note."""
    aside = sibling(candidate, ".corrupt")
    try:
        os.replace(candidate, aside)
    except FileNotFoundError:  # shared storage: another node's probe moved it first
        return f"another node moved it aside to {aside}"
    except OSError:
        return "left in place (its folder is read-only) and skipped"
    return f"moved aside to {aside}"


def check_layout(snap: object) -> None:
    """Raise ValueError unless ``snap`` is a snapshot this script wrote (probe's test)."""
    needed = {"version", "settings", "world_size", "epoch", "position", "step", "model",
              "optimizer", "scaler", "history", "ranks"}
    if not isinstance(snap, dict) or not needed <= snap.keys():
        raise ValueError("not a snapshot of scripts/train_ddp.py (keys missing)")
    if snap["version"] != SNAPSHOT_VERSION:
        raise ValueError(f"snapshot format {snap['version']}, this script reads {SNAPSHOT_VERSION}")


def mismatch(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why this run cannot resume from a snapshot with ``saved`` settings (None: it can)."""
    for key in MUST_MATCH:
        if saved.get(key) != now.get(key):
            return f"{key} was {saved.get(key)!r} in the snapshot's run and is {now.get(key)!r} now"
    return None


def find_snapshot(env: DistEnv, path: Path | None, now: dict[str, Any]) -> dict[str, Any] | None:
    """The newest valid snapshot any node holds, loaded on every rank (None: a fresh start).

    Without shared storage only the machine of the rank 0 that wrote it holds the file, and
    after a restart rank 0 may run on another machine. So the local rank 0 of every node
    probes the path it sees, the ranks agree on the newest copy, and the rank holding it
    broadcasts its bytes. A collective: every rank calls it and gets the same answer.
    """
    if path is None:
        if env.is_main:
            print("no --snapshot: this run takes no snapshots and cannot resume")
        return None
    summary, data, notes = probe(path) if env.local_rank == 0 else (None, None, [])
    for note in notes:
        print(f"[{node_name()}] {note}")
    found: list[dict[str, Any] | None] = [None] * env.world_size
    dist.all_gather_object(found, summary)  # every rank learns what every node holds
    holders = [rank for rank, s in enumerate(found) if s is not None]
    if not holders:
        if env.is_main:
            print(f"no usable snapshot at {path}: a fresh start")
        return None
    source = max(holders, key=lambda rank: (found[rank]["step"], -rank))  # newest, then lowest
    payload = [data if env.rank == source else None]
    dist.broadcast_object_list(payload, src=source)  # the bytes, from the rank that has them
    snap = torch.load(io.BytesIO(payload[0]), map_location=env.device, weights_only=True)
    chosen = found[source]
    refuse_if_different(snap, now, path, env)
    if env.is_main:
        others = "" if len(holders) == 1 else f" (newest of {len(holders)} nodes' copies)"
        print(
            f"resuming from {chosen['path']} on {chosen['node']}{others}: epoch "
            f"{chosen['epoch'] + 1}, {chosen['position']} samples into it, step "
            f"{chosen['step']}"
        )
    snap["source"] = chosen
    return snap


def refuse_if_different(
    snap: dict[str, Any], now: dict[str, Any], path: Path, env: DistEnv
) -> None:
    """SystemExit naming the differing setting if the snapshot comes from another configuration.

    Every rank decides alike (they all hold the same snapshot); one rank per node says why.
    """
    why = mismatch(snap["settings"], now)
    if why is None and snap["epoch"] >= now["epochs"]:
        why = f"the snapshot is in epoch {snap['epoch'] + 1}, past --epochs {now['epochs']}"
    if why is not None and env.local_rank != 0:
        raise SystemExit(1)
    if why is not None:
        again = retries_refuse_alike()
        raise SystemExit(
            f"train_ddp.py: cannot resume from {path}: {why}. Start this configuration with "
            f"another --snapshot path, or delete the snapshot (and its .prev) to start afresh{again}."
        )


def restore(
    snap: dict[str, Any], optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> tuple[int, int, History]:
    """Load the optimizer and scaler states; the epoch to go on with, the step and the history."""
    optimizer.load_state_dict(snap["optimizer"])
    if scaler.is_enabled() and snap["scaler"]:  # a bf16 or float32 run saved none
        scaler.load_state_dict(snap["scaler"])
    history = History(**snap["history"])
    history.samples_per_sec = [float("nan")] * len(history.epoch)  # not kept: speed, not state
    return snap["epoch"], snap["step"], history


def resume_epoch(
    snap: dict[str, Any], env: DistEnv, sampler: ResumableSampler
) -> tuple[torch.Tensor, int]:
    """Skip the part of the resumed epoch already done; this rank's running sums and count."""
    sampler.skip(snap["position"])
    ranks = snap["ranks"]
    if len(ranks) == env.world_size:
        mine = ranks[env.rank]
        return mine["sums"].to(env.device), mine["samples"]
    # another world size (an elastic job that lost or gained a node): rank 0 carries every
    # rank's sums; the per-rank random generators cannot be handed over, so the data order
    # stays exact but random draws (dropout, augmentation) differ from an uninterrupted run
    if env.is_main:
        print(
            f"the snapshot was taken by {len(ranks)} ranks, this run has {env.world_size}: "
            "the random generators are not restored"
        )
    total = sum(r["sums"] for r in ranks) if env.is_main else torch.zeros(2)
    return total.to(env.device), snap["position"] // env.world_size


# --- what the run leaves behind -----------------------------------------------------------------
def run_result(
    env: DistEnv,
    cfg: LessonConfig,
    run: RunOptions,
    snap: dict[str, Any] | None,
    step: int,
    history: History,
    written: int,
) -> dict[str, Any]:
    """result.json's contents (see README: scripts/train_ddp.py)."""
    resumed = None
    if snap is not None:
        source = snap["source"]
        resumed = {
            "epoch": source["epoch"] + 1,  # counted from 1, as in the history
            "step": source["step"],
            "position": source["position"],
            "path": source["path"],
            "node": source["node"],
        }
    return {
        "world_size": env.world_size,
        "backend": env.backend,
        "device": str(env.device),
        "restart_count": run.restarts,
        "resumed_from": resumed,
        "steps": step,
        "history": {k: v for k, v in history.as_dict().items() if k in METRICS},
        "config": settings(cfg, run),
        "snapshots_written": written,
    }


def write_outputs(out: Path, model: nn.Module, outcome: dict[str, Any]) -> None:
    """DIR/model.pt (the unwrapped model's weights, on the CPU) and DIR/result.json."""
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out / "model.pt")
    (out / "result.json").write_text(json.dumps(outcome, indent=2) + "\n")


# --- the command line ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; argparse runs before any distributed code, so --help works anywhere."""
    parser = argparse.ArgumentParser(
        prog="train_ddp.py",
        description="Lesson 04b's DDP training under torchrun, with snapshots (lesson 07).",
        epilog="Start it with torchrun, e.g. torchrun --standalone --nproc-per-node=2 "
        "scripts/train_ddp.py --epochs 2 --snapshot /tmp/snap.pt --out /tmp/run",
    )
    add = parser.add_argument
    add("--dataset", choices=DATASETS, default="digits")
    add("--model", choices=MODELS, default="auto")
    add("--batch-size", type=int, default=64, help="global batch, split over the ranks (64)")
    add("--epochs", type=int, default=5, help="passes over the training set (5)")
    add("--lr", type=float, default=0.05, help="SGD learning rate (0.05)")
    add("--seed", type=int, default=0, help="seed of the weights and the data order (0)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=None,
                      help="cap epochs and samples (default: as $MGPU_QUICK says)")
    mode.add_argument("--full", dest="quick", action="store_false", help="no caps")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add("--timeout", type=float, default=120, help="seconds a collective may wait (120)")
    add("--amp", action="store_true", help="bf16 autocast where supported, else fp16 + GradScaler")
    add("--sync-bn", action="store_true", help="SyncBatchNorm, as in lesson 04 (GPUs only)")
    add("--snapshot", type=Path, metavar="PATH", help="snapshot file (none: no snapshots)")
    add("--snapshot-every", type=int, default=0, metavar="N",
        help="also snapshot every N optimizer steps (0: after each epoch's last step only)")
    add("--out", type=Path, metavar="DIR", help="rank 0 writes DIR/result.json and DIR/model.pt")
    add("--kill-at-step", type=int, metavar="S",
        help="fault injection: on the first attempt, rank --kill-rank dies (SIGKILL) after "
        "S optimizer steps of the run, before the next one")
    add("--kill-rank", type=int, metavar="R", help="the rank --kill-at-step kills (the last)")
    args = parser.parse_args(argv)
    for name in ("batch_size", "epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.snapshot_every < 0 or (args.kill_at_step is not None and args.kill_at_step < 0):
        parser.error("--snapshot-every and --kill-at-step cannot be negative")
    return args


@record  # an exception in a rank reaches torchrun's error summary with its traceback
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        raise SystemExit(
            "train_ddp.py runs one rank of a distributed job and reads RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT, which torchrun sets. Start it with torchrun:\n  "
            + torchrun_hint(__file__, argv)
        )
    if isinstance(sys.stdout, io.TextIOWrapper):  # output to a pipe or file: whole lines now
        sys.stdout.reconfigure(line_buffering=True)
    env = DistEnv.from_environ(args.device)  # the one placement decision: device and backend
    cfg = apply_quick(
        LessonConfig(
            dataset=args.dataset,
            model=args.model,
            batch_size=args.batch_size,
            epochs=args.epochs,
            lr=args.lr,
            seed=args.seed,
            world_size=env.world_size,
            progress=False,
        ),
        args.quick,
    )
    if cfg.batch_size % env.world_size:
        raise SystemExit(
            f"train_ddp.py: --batch-size {cfg.batch_size} is not a multiple of the world size "
            f"{env.world_size}; pick a global batch that splits evenly over the ranks"
        )
    if args.kill_rank is not None and not 0 <= args.kill_rank < env.world_size:
        raise SystemExit(
            f"train_ddp.py: --kill-rank {args.kill_rank} is not a rank of this job; "
            f"choose 0..{env.world_size - 1}"
        )
    if args.sync_bn and env.device.type != "cuda":
        raise SystemExit("train_ddp.py: --sync-bn needs GPUs (SyncBatchNorm); drop it on CPUs")
    run = RunOptions(  # restarts: counted once the group exists
        snapshot=args.snapshot,
        snapshot_every=args.snapshot_every,
        out=args.out,
        amp=args.amp,
        sync_bn=args.sync_bn,
        kill_at_step=args.kill_at_step,
        kill_rank=env.world_size - 1 if args.kill_rank is None else args.kill_rank,
    )
    for sig in STOP_SIGNALS:  # a stop from torchrun ends the run after a step, with a snapshot
        signal.signal(sig, on_stop_signal)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # before the group: NCCL must not pick cuda:0
    dist.init_process_group(
        env.backend,
        timeout=datetime.timedelta(seconds=args.timeout),  # how long a collective may wait
        device_id=env.device if env.backend == "nccl" else None,  # binds NCCL to this GPU
    )
    try:
        run = replace(run, restarts=job_restarts(env))
        if env.is_main:
            print(
                f"{env.world_size} ranks, backend {env.backend}, rank 0 on {env.device}, "
                f"attempt {run.restarts + 1}"
            )
            warn_if_store_shared()
        train_ddp(env, cfg, run)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_at_once(0)  # a gloo thread may still be busy: no Python shutdown (see its docstring)
