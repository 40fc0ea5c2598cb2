"""Lesson 11's byte-level GPT trained as a script: one device, DDP, FSDP2 or FSDP2 x TP.

The run itself is ``mgpu_helpers.lm_train.train_lm`` (a notebook can launch the same function);
this script adds the command line and what ``torchrun`` needs, from lesson 07: the restart
count, ``--kill-at-step``, a clean stop on Ctrl-C or SIGTERM with a checkpoint. Checkpoints are
DCP folders (``--snapshot DIR``; ``DIR.prev`` keeps the one before), and a restarted or
re-submitted job resumes from the newest: with 2 CPU ranks it ends bit for bit where an
uninterrupted run ends. On GPUs it trains in bfloat16 (autocast; float16 with loss scaling
before compute capability 8.0), on the CPU in float32; result.json says which.

One process (no torchrun)::

    python scripts/train_lm.py --quick --out runs/lm1

Two ranks with DDP, or four as a 2 x 2 mesh of FSDP2 x tensor parallel::

    torchrun --standalone --nproc-per-node=2 scripts/train_lm.py --parallel ddp --out runs/lm2
    torchrun --standalone --nproc-per-node=4 scripts/train_lm.py --parallel fsdp_tp --tp 2

A killed rank and a restart, as lesson 07 shows it (the variable: see scripts/train_ddp.py)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 \\
        --max-restarts=1 scripts/train_lm.py --parallel fsdp --quick \\
        --snapshot /tmp/lm_ck --snapshot-every 5 --kill-at-step 12 --out /tmp/lm

Under SLURM: ``TRAIN_SCRIPT=scripts/train_lm.py EXTRA_ARGS="--parallel fsdp" sbatch
scripts/slurm/train_ddp.sbatch`` (the sbatch script passes --device, --snapshot,
--snapshot-every and --out, which this script takes too; the snapshot folder must be on storage
every node sees, since every rank writes its own shards).
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from mgpu_helpers.config import quick_from_env
from mgpu_helpers.dist_env import DistEnv, exit_at_once
from mgpu_helpers.lm import GPTConfig
from mgpu_helpers.lm_train import (
    PARALLELS,
    QUICK,
    LMRun,
    check_backend,
    check_parallel,
    train_lm,
)
from mgpu_helpers.placement import place
from mgpu_helpers.run_control import (
    STOP_SIGNALS,
    job_restarts,
    on_stop_signal,
    torchrun_hint,
    warn_if_store_shared,
)

# The defaults, LMRun's and GPTConfig's: a clear drop of the validation loss in about two
# minutes on two CPU cores. data_limit 0: the whole text.
_RUN, _MODEL = LMRun(), GPTConfig()
FULL = {**{k: getattr(_MODEL, k) for k in ("d_model", "n_layers", "n_heads", "seq_len")},
        **{k: getattr(_RUN, k) or 0 for k in ("steps", "batch_size", "data_limit", "val_limit",
                                               "eval_every", "eval_batches", "lr", "warmup")}}
HELP = {"steps": "optimizer steps ", "batch_size": "global batch of sequences ",
        "data_limit": "training bytes read, 0: all ", "val_limit": "validation bytes read ",
        "eval_every": "validation loss every N steps, 0: never ", "lr": "AdamW's peak rate ",
        "warmup": "warm-up steps ", "eval_batches": "validation batches "}  # fmt: skip
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; argparse runs before any distributed code, so --help works anywhere."""
    p = argparse.ArgumentParser(
        prog="train_lm.py",
        description="Lesson 11's byte-level GPT on one device, DDP, FSDP2 or FSDP2 x TP.",
        epilog="Several ranks: torchrun --standalone --nproc-per-node=2 scripts/train_lm.py "
        "--parallel ddp --out runs/lm",
    )
    add = p.add_argument
    add("--parallel", choices=("auto", *PARALLELS), default="auto",
        help="auto: single for one process, ddp for several")
    add("--tp", type=int, default=2, help="tensor-parallel ranks of fsdp_tp (2)")
    add("--seed", type=int, default=0, help="seed of the weights and the batches (0)")
    for name, default in FULL.items():  # unset: FULL's value, or QUICK's in quick mode
        kind = float if isinstance(default, float) else int
        quick = f", {QUICK[name]} quick" if name in QUICK else ""
        text = f"{HELP.get(name, '')}({default}{quick})"
        add(f"--{name.replace('_', '-')}", type=kind, help=text)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=None,
                      help="a small model for seconds (default: as $MGPU_QUICK says)")
    mode.add_argument("--full", dest="quick", action="store_false", help="the sizes given")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add("--timeout", type=float, default=120, help="seconds a collective may wait (120)")
    add("--snapshot", type=Path, metavar="DIR", help="DCP checkpoint folder (none: no resume)")
    add("--snapshot-every", type=int, default=0, metavar="N",
        help="checkpoint every N steps (0: at the end and on a stop only)")
    add("--out", type=Path, metavar="DIR", help="rank 0 writes DIR/result.json and DIR/model.pt")
    add("--kill-at-step", type=int, metavar="S",
        help="fault injection: on the first attempt, rank --kill-rank dies (SIGKILL) before step S")
    add("--kill-rank", type=int, metavar="R", help="the rank --kill-at-step kills (the last)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "d_model", "n_layers", "n_heads", "seq_len", "tp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("snapshot_every", "eval_every", "kill_at_step", "data_limit", "val_limit"):
        if (getattr(args, name) or 0) < 0:
            p.error(f"--{name.replace('_', '-')} cannot be negative")
    return args


def run_options(args: argparse.Namespace, world_size: int) -> LMRun:
    """The run the command line asks for (quick mode shrinks the model and the budget)."""
    quick = quick_from_env() if args.quick is None else args.quick
    given = {k: getattr(args, k) for k in FULL}
    values = {k: v if v is not None else (QUICK if quick and k in QUICK else FULL)[k]
              for k, v in given.items()}
    sizes = {k: values.pop(k) for k in ("d_model", "n_layers", "n_heads", "seq_len")}
    for k in ("data_limit", "val_limit"):
        values[k] = values[k] or None  # 0: no limit
    parallel = args.parallel
    if parallel == "auto":
        parallel = "single" if world_size == 1 else "ddp"
    return LMRun(
        model=GPTConfig(**sizes), **values, seed=args.seed, parallel=parallel, tp=args.tp,
        snapshot=args.snapshot, snapshot_every=args.snapshot_every, out=args.out,
        kill_at_step=args.kill_at_step,
        kill_rank=world_size - 1 if args.kill_rank is None else args.kill_rank,
    )


@record  # an exception in a rank reaches torchrun's error summary with its traceback
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    under_torchrun = all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                   "MASTER_PORT"))
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else 1
    try:
        run = run_options(args, world_size)
        check_parallel(run, world_size)  # before any rank talks to another
    except ValueError as exc:
        hint = ""
        if not under_torchrun and args.parallel not in ("auto", "single"):
            hint = "\n  " + torchrun_hint(__file__, argv, 2 * args.tp if "fsdp_tp" in argv else 2)
        raise SystemExit(f"train_lm.py: {exc}{hint}") from None
    if args.kill_at_step is not None and not 0 <= run.kill_rank < world_size:
        raise SystemExit(f"train_lm.py: --kill-rank {run.kill_rank} is not a rank of this job; "
                         f"choose 0..{world_size - 1}")
    if isinstance(sys.stdout, io.TextIOWrapper):  # output to a pipe or file: whole lines now
        sys.stdout.reconfigure(line_buffering=True)
    if not under_torchrun:
        placement = place(1, args.device)
        env = DistEnv(0, 0, 1, torch.device(placement.devices[0]), placement.backend)
        print(f"one process on {env.device}, {run.parallel}")
        train_lm(env, run)
        return
    env = DistEnv.from_environ(args.device)  # the one placement decision: device and backend
    try:
        check_backend(run, env)  # FSDP2 on GPUs shared over gloo: refused before any collective
    except ValueError as exc:
        raise SystemExit(f"train_lm.py: {exc}") from None
    for sig in STOP_SIGNALS:  # a stop from torchrun ends the run after a step, with a checkpoint
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
            print(f"{env.world_size} ranks, {run.parallel}, backend {env.backend}, rank 0 on "
                  f"{env.device}, attempt {run.restarts + 1}")
            warn_if_store_shared()
        train_lm(env, run)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_at_once(0)  # a gloo thread may still be busy: no Python shutdown (see its docstring)
