"""How long does a launch take, against bare fork (the ideal) and bare spawn? (target <= 2x fork)

Lesson 04 (both parts) starts its ranks with `mgpu_helpers.launch.launch`, which adds to PyTorch's
`torch.multiprocessing.start_processes` what a notebook needs: the worker sent by value, a
rendezvous store on a free port, output streamed back, results returned, failure attribution and
cleanup. This script measures what that costs against two bare runs of the same work:

  launcher  launch(worker, placement): ranks forked from the launcher's fork server (torch
            preloaded), which joins the process group for the worker
  fork      the ideal: torch.multiprocessing.start_processes(start_method="fork") of an
            importable function that joins the group itself (tcp:// on a free port). Fast, since
            the ranks inherit the imported torch, but unsafe once the caller has used CUDA
  spawn     the same with start_method="spawn" (mp.spawn): safe, but every rank imports torch

on two workloads: one all-reduce, and 20 DDP training steps of a small CNN. Each number is the
time from the call until it returned (every rank done and exited). The first call of each
variant in this process is shown apart (the launcher's starts its fork server then); the
repeats take turns (launcher, fork, spawn, then rotated) and the table shows their medians. The
target is the launcher's median at most 2x the fork ideal's, on each workload. Timings on a busy
machine are noisy: run it on an idle one, and compare ratios from one run, not across runs.

    PYTHONPATH=. python benchmarks/launch_overhead.py                 # best device here
    PYTHONPATH=. python benchmarks/launch_overhead.py --device cpu --repeats 7
    PYTHONPATH=. python benchmarks/launch_overhead.py --out benchmarks/results/launch_h200.json

With fewer GPUs than ranks (one GPU, two ranks) the ranks share the GPUs over gloo, as in the
lesson. The exit code is 0 whether or not the target is met; the last line says which.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# Run from a source checkout without installing: put the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# mgpu_helpers is imported inside functions only: the spawned children of the bare variant run
# this file again as their main module and must not pay for importing the package.

TARGET = 2.0  # repeated launches: the launcher may take at most twice the bare fork ideal
VARIANTS = ("launcher", "fork", "spawn")
WORKLOADS = ("allreduce", "ddp20")
DDP_STEPS = 20


def _model() -> nn.Sequential:
    """A small CNN for 1x8x8 inputs (the course's digits), defined here for every variant."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def work(name: str, device: torch.device) -> None:
    """One workload on this rank (the process group is up)."""
    if name == "allreduce":
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
    else:
        torch.manual_seed(0)
        model = _model().to(device)
        ddp = DDP(model, device_ids=[device.index]) if device.type == "cuda" else DDP(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x = torch.randn(32, 1, 8, 8, device=device)
        y = torch.randint(0, 10, (32,), device=device)
        for _ in range(DDP_STEPS):
            optimizer.zero_grad()
            F.cross_entropy(ddp(x), y).backward()  # the gradient all-reduce happens here
            optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def launched_worker(env, name: str) -> None:
    """What the launcher runs on each rank (it has already joined the process group)."""
    work(name, env.device)


def bare_worker(rank: int, port: int, spec: dict, name: str) -> None:
    """What bare start_processes runs on each rank: join the group itself, work, leave."""
    torch.set_num_threads(int(spec["threads"]))  # the launcher's share of the cores, for fairness
    device = torch.device(spec["devices"][rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        spec["backend"],
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=len(spec["devices"]),
    )
    try:
        work(name, device)
    finally:
        dist.destroy_process_group()
        if spec["method"] == "spawn":
            # A spawned rank ends through interpreter shutdown, where DDP's gloo group (kept in
            # a reference cycle) can abort the process: free it while Python is fully alive. A
            # forked rank ends with os._exit and needs no such care.
            gc.collect()


def free_port() -> int:
    """A TCP port that was free a moment ago (bare scripts do this, or hard-code 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(variant: str, name: str, placement, work_dir: Path) -> float:
    """Seconds from the call until it returned."""
    start = time.perf_counter()
    if variant == "launcher":
        from mgpu_helpers.launch import launch

        logs = Path(tempfile.mkdtemp(dir=work_dir))
        launch(launched_worker, placement, name, echo=False, log_dir=logs)
    else:
        spec = {
            "devices": placement.devices,
            "backend": placement.backend,
            "threads": placement.threads_per_rank,
            "method": variant,
        }
        mp.start_processes(
            bare_worker,
            args=(free_port(), spec, name),
            nprocs=placement.world_size,
            start_method=variant,
        )
    return time.perf_counter() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--world-size", type=int, default=2, help="ranks per launch (default 2)")
    parser.add_argument(
        "--share-gpus",
        action="store_true",
        help="allow more ranks than GPUs (chosen anyway when GPUs are too few)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each variant")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: one timed run each after the first; numbers mean little",
    )
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.world_size < 1:
        parser.error("--repeats and --world-size must be at least 1")
    if args.quick:
        args.repeats = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mgpu_helpers.devices import gpu_count
    from mgpu_helpers.placement import place

    gpus = gpu_count()
    share = args.share_gpus or (args.device != "cpu" and 1 <= gpus < args.world_size)
    try:
        placement = place(args.world_size, args.device, share_gpus=share)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"launch overhead: {placement.describe()}")
    print(f"workloads: one all-reduce; {DDP_STEPS} DDP steps of a small CNN")
    if share and not args.share_gpus:
        print(f"note: {gpus} GPU(s) for {args.world_size} ranks, so the ranks share them")
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} CPU cores, {gpus} GPU(s), {args.repeats} repeat(s); load average "
        f"{os.getloadavg()[0]:.1f} (a busy machine makes every number noisy)"
    )

    first: dict[str, dict[str, float]] = {w: {} for w in WORKLOADS}
    times: dict[str, dict[str, list[float]]] = {w: {v: [] for v in VARIANTS} for w in WORKLOADS}
    with tempfile.TemporaryDirectory(prefix="mgpu-launch-bench-") as tmp:
        work_dir = Path(tmp)
        for variant in VARIANTS:  # the first call of each: the launcher starts its fork server
            for name in WORKLOADS:
                first[name][variant] = run(variant, name, placement, work_dir)
                print(f"  first {variant:<8} {name:<9}: {first[name][variant]:6.3f} s", flush=True)
        for r in range(args.repeats):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # none always goes first
            for name in WORKLOADS:
                for variant in order:
                    times[name][variant].append(run(variant, name, placement, work_dir))
            print(
                f"  run {r + 1}: "
                + ", ".join(
                    f"{name} {v} {times[name][v][-1]:.3f} s" for name in WORKLOADS for v in order
                ),
                flush=True,
            )

    med = {w: {v: statistics.median(t) for v, t in runs.items()} for w, runs in times.items()}
    ratios = {
        w: {f"{v}/fork": med[w][v] / med[w]["fork"] for v in ("launcher", "spawn")}
        for w in WORKLOADS
    }
    print(f"\n{'workload':<10} {'variant':<9} {'first s':>8} {'median s':>9} {'min':>7} {'max':>7}")
    for name in WORKLOADS:
        for v in VARIANTS:
            t = times[name][v]
            print(
                f"{name:<10} {v:<9} {first[name][v]:8.3f} {med[name][v]:9.3f} "
                f"{min(t):7.3f} {max(t):7.3f}"
            )
    print()
    for name in WORKLOADS:
        print(
            f"{name:<10} ratio launcher/fork = {ratios[name]['launcher/fork']:5.2f}   "
            f"spawn/fork = {ratios[name]['spawn/fork']:5.2f}   (medians of repeated calls)"
        )
    met = all(ratios[w]["launcher/fork"] <= TARGET for w in WORKLOADS)
    print(f"target <= {TARGET} for repeated launches: {'met' if met else 'NOT met'}")

    if args.out:
        result = {
            "benchmark": "launch_overhead",
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "device_type": placement.device_type,
            "backend": placement.backend,
            "share_gpus": placement.share_gpus,
            "threads_per_rank": placement.threads_per_rank,
            "world_size": args.world_size,
            "gpus": gpus,
            "device_name": torch.cuda.get_device_name(0) if gpus else None,
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg()[0],
            "torch": torch.__version__,
            "python": platform.python_version(),
            "repeats": args.repeats,
            "quick": args.quick,
            "ddp_steps": DDP_STEPS,
            "first_seconds": first,
            "seconds": times,
            "median_seconds": med,
            "ratios": ratios,
            "target": TARGET,
            "target_met": met,
        }
        from mgpu_helpers.util import write_json

        write_json(args.out, result)
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
