"""Model state per rank under DDP, ZeRO-1, ZeRO-2 and FSDP2, and step time (lesson 08; target 1.10)

Lesson 08 writes four ways to train one model on N ranks, each as a trainer with the same
protocol, and a `train_worker` that runs them on the same batches. This script runs that code
as the lesson's cells write it (read from notebooks 08a and 08b with
mgpu_helpers.lesson_code.load_lesson_code), side by side in one launch per world size:

  DDP      every rank holds the whole model, its gradients and Adam's state (08a, section 2)
  ZeRO-1   Adam's state sharded by hand: each rank keeps 1/N of it (08a)
  ZeRO-2   and the gradients: reduce-scatter instead of all-reduce (08a)
  FSDP2    fully_shard per block and on the root: parameters sharded too (08b)

Memory: the bytes of parameters + gradients + optimizer state each rank holds after a step
(`trainer.memory()`, counted from the tensors: a DTensor counts its local shard with its
padding, a storage counts once), the largest over the ranks. That count is exact on any
hardware, so the target holds on the CPU as on GPUs. On GPUs the allocator's peak per trainer
(which adds the activations and the all-gathered blocks) is reported next to it.

Target: FSDP2's per-rank model state <= 1/N of DDP's + 10% (ratio FSDP2 / (DDP / N) <= 1.10)
at every world size; the part above 1 is the padding that rounds each parameter's rows up to a
multiple of N. On one rank FSDP2 holds exactly what DDP holds (ratio 1), so run_all reports that
row instead of judging it. The exit code is 0 whether or not the target is met (the last line
says which).

Time: the median seconds per training step of each trainer, over --repeats rounds in which
the trainers take turns (the order rotates), and per round each trainer's time / DDP's. The
first two steps of each run are left out, for every trainer alike: the first holds FSDP2's lazy
set-up, and DDP rebuilds its gradient buckets at the start of the second forward. So --steps
must be at least 3. The ratio is reported
with the range of the rounds, without a target; "rounds agree" says whether every round put the
trainer on the same side of DDP. CPU processes share the cores: there the ratio shows what the
extra collectives cost, not GPU speed.

    PYTHONPATH=. python benchmarks/sharding.py                      # world sizes 1, 2 and 4
    PYTHONPATH=. python benchmarks/sharding.py --device cpu --repeats 7
    PYTHONPATH=. python benchmarks/sharding.py --quick --out benchmarks/results/sharding.json

World sizes: one GPU per rank (NCCL) where there are enough GPUs; a world size with more ranks
than GPUs runs as CPU processes over gloo (the lesson checks FSDP2 over gloo on CPU tensors
only), and the table says where each ran.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
import types
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

# Run from a source checkout without installing: put the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_helpers.devices import describe_hardware, gpu_count, hardware_as_dict  # noqa: E402
from mgpu_helpers.dist_env import DistEnv  # noqa: E402
from mgpu_helpers.launch import launch  # noqa: E402
from mgpu_helpers.lesson_code import load_lesson_code  # noqa: E402
from mgpu_helpers.memory import optimizer_state_bytes, tensor_bytes  # noqa: E402
from mgpu_helpers.placement import Placement, place  # noqa: E402
from mgpu_helpers.timing import Timing, compare  # noqa: E402
from mgpu_helpers.util import write_json  # noqa: E402

TARGET = 1.10  # FSDP2's per-rank model state / (DDP's / N), at every world size
METHODS = ("DDP", "ZeRO-1", "ZeRO-2", "FSDP2")
KINDS = ("parameters", "gradients", "optimizer")
NOISY = 0.5  # a spread (max - min) / median above this is called noisy
# Steps left out of the timing, for every trainer: step 1 holds FSDP2's lazy set-up (and the
# first use of every kernel), and DDP rebuilds its buckets at the start of the second forward.
UNTIMED = 2

# The trainers are lesson 08's (parts 08a and 08b), read from its notebooks and run as its cells
# write them: the lesson is the one place this code lives. The namespace holds what that code
# uses: the lesson's imports and its head's names (the sizes are passed to train_worker).
PART_A = ("Block", "Net", "make_model", "make_batch", "DDPTrainer", "ZeroTrainer", "train_worker")
PART_B = ("make_mesh", "apply_fsdp", "FSDPTrainer", "init_like_full_build")  # lesson 08b's
NAMESPACE = {
        "torch": torch,
        "nn": nn,
        "F": F,
        "dist": dist,
        "DDP": DDP,
        "DistEnv": DistEnv,
        "math": math,
        "time": time,
        "functools": functools,
        "warnings": warnings,
        "DeviceMesh": DeviceMesh,
        "init_device_mesh": init_device_mesh,
        "fully_shard": fully_shard,
        "MixedPrecisionPolicy": MixedPrecisionPolicy,
        "tensor_bytes": tensor_bytes,
        "optimizer_state_bytes": optimizer_state_bytes,
        # the head's names (defaults of make_model and train_worker; the script passes its own)
        "WIDTH": 256,
        "DEPTH": 4,
        "BATCH_SIZE": 16,
        "LR": 1e-3,
        "SEED": 0,
        "IN_FEATURES": 64,
        "CLASSES": 10,
}  # fmt: skip
_FOLDER = Path(__file__).resolve().parent.parent / "notebooks"
lesson = types.SimpleNamespace(
    **vars(load_lesson_code("08a", PART_A, NAMESPACE, folder=_FOLDER)),
    **vars(load_lesson_code("08b", PART_B, NAMESPACE, folder=_FOLDER)),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="ranks per launch"
    )
    parser.add_argument("--width", type=int, default=None, help="width of each block")
    parser.add_argument("--depth", type=int, default=None, help="residual blocks")
    parser.add_argument("--batch", type=int, default=None, help="samples per rank per step")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per run (the first two untimed; >= 3)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per world size")
    parser.add_argument("--quick", action="store_true", help="tiny smoke test: times mean little")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    gpus = gpu_count() if args.device != "cpu" else 0
    if args.device == "cuda" and gpus == 0:
        parser.error("--device cuda: no GPU is visible here; use --device cpu or auto")
    if any(n < 1 for n in args.world_sizes):
        parser.error(f"--world-sizes {args.world_sizes}: every world size must be at least 1")
    args.world_sizes = sorted(set(args.world_sizes))
    # GPUs where there is one per rank; otherwise CPU processes (FSDP2 over gloo: CPU tensors)
    on_gpu = {n: gpus >= n and args.device != "cpu" for n in args.world_sizes}
    if args.quick:
        sizes = {"width": 64, "depth": 2, "batch": 8, "steps": 3, "repeats": 2}
    elif all(on_gpu.values()):  # GPU sizes only where no world size falls back to the CPU
        sizes = {"width": 1024, "depth": 8, "batch": 64, "steps": 6, "repeats": 5}
    else:
        sizes = {"width": 256, "depth": 4, "batch": 16, "steps": 5, "repeats": 5}
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("width", "depth", "batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.steps < UNTIMED + 1:
        parser.error(
            f"--steps {args.steps}: the first {UNTIMED} steps are not timed (set-up, DDP's bucket "
            f"rebuild), so at least {UNTIMED + 1} are needed"
        )
    args.placements = {n: place(n, "cuda" if on_gpu[n] else "cpu") for n in args.world_sizes}
    return args


def worker(env: DistEnv, sizes: dict, code: object) -> dict:
    """On every rank: the lesson's train_worker once per round, the trainers' order rotating."""
    trainers = {
        "DDP": code.DDPTrainer,
        "ZeRO-1": functools.partial(code.ZeroTrainer, stage=1),
        "ZeRO-2": functools.partial(code.ZeroTrainer, stage=2),
        "FSDP2": code.FSDPTrainer,
    }
    memory, peak, seconds = {}, {}, {name: [] for name in trainers}
    for r in range(sizes["repeats"]):
        order = METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]
        runs = code.train_worker(
            env, {name: trainers[name] for name in order}, sizes["steps"],
            width=sizes["width"], depth=sizes["depth"], per_rank=sizes["batch"],
        )  # fmt: skip
        for name, run in runs.items():
            seconds[name].append(statistics.median(run["seconds"][UNTIMED:]))  # see UNTIMED
            memory[name], peak[name] = run["memory"], run["peak_cuda"]  # the same every round
    return {"memory": memory, "peak_cuda": peak, "seconds": seconds,
            "meta_build": meta_build(env, sizes, code)}


def meta_build(env: DistEnv, sizes: dict, code: object) -> dict:
    """Lesson 08b's meta-device build: the bytes a rank holds at its peak while it builds.

    Built on meta, sharded, to_empty, then filled layer by layer (a full layer on the CPU at a
    time): the peak is the rank's shards plus the largest layer, never the whole model.
    """
    with torch.device("meta"):
        model = code.Net(sizes["width"], sizes["depth"])
    code.apply_fsdp(model, code.make_mesh(env))
    model.to_empty(device=env.device)
    shards = tensor_bytes(model.parameters())
    largest = code.init_like_full_build(model, env)
    return {"shards": shards, "largest_layer": largest, "peak": shards + largest}


def run_world_size(placement: Placement, sizes: dict) -> dict:
    """One launch: every rank's model state per trainer, rank 0's step times per round."""
    ranks = launch(worker, placement, sizes, lesson, echo=False, timeout=120)
    worst = {  # the rank that holds the most, per trainer
        name: max((r["memory"][name] for r in ranks), key=lambda m: sum(m.values()))
        for name in METHODS
    }
    return {
        "placement": asdict(placement),
        "memory": {name: {**m, "total": sum(m.values())} for name, m in worst.items()},
        "total_per_rank": {m: [sum(r["memory"][m].values()) for r in ranks] for m in METHODS},
        "peak_cuda": {m: max((r["peak_cuda"][m] or 0) for r in ranks) or None for m in METHODS},
        "seconds_per_step": ranks[0]["seconds"],  # the ranks run in lockstep: rank 0's clock
        "meta_build": max((r["meta_build"] for r in ranks), key=lambda m: m["peak"]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = {k: getattr(args, k) for k in ("width", "depth", "batch", "steps", "repeats")}
    n_params = sum(p.numel() for p in lesson.make_model(args.width, args.depth).parameters())
    print(
        f"sharding: the lesson 08 model, {args.depth} blocks of width {args.width} "
        f"({n_params / 1e6:.2f}M parameters, fp32 Adam: {16 * n_params / 2**20:.1f} MiB of model "
        f"state), batch {args.batch} per rank; torch {torch.__version__}"
    )
    print(
        f"{args.steps} steps per run (the first {UNTIMED} untimed), {args.repeats} rounds per "
        "world size, "
        "the trainers' order rotating; medians reported"
    )
    results = {}
    for n in args.world_sizes:
        print(f"N = {n}: {args.placements[n].describe()}", flush=True)
        results[n] = run_world_size(args.placements[n], sizes)

    print("\nmodel state per rank, MiB (the rank that holds most), and FSDP2 / (DDP / N):")
    print(f"{'N':>3}  {'device':<6} " + "".join(f"{m:>9}" for m in METHODS) + f"{'ratio':>9}")
    ratios = {}
    for n, res in results.items():
        totals = [res["memory"][m]["total"] for m in METHODS]
        ratios[n] = res["memory"]["FSDP2"]["total"] / (res["memory"]["DDP"]["total"] / n)
        device = res["placement"]["device_type"]
        print(
            f"{n:>3}  {device:<6} "
            + "".join(f"{t / 2**20:9.2f}" for t in totals)
            + f"{ratios[n]:9.3f}"
        )
    full_model = 4 * n_params
    print("\nthe meta-device build (lesson 08b): a rank's peak while it builds and initialises")
    for n, res in results.items():
        meta = res["meta_build"]
        print(f"N = {n}: shards {meta['shards'] / 2**20:.2f} + one layer "
              f"{meta['largest_layer'] / 2**20:.2f} = {meta['peak'] / 2**20:.2f} MiB, "
              f"{meta['peak'] / full_model:.2f} x the full model's {full_model / 2**20:.2f} MiB")
    for n, res in results.items():
        if any(res["peak_cuda"].values()):
            peaks = ", ".join(f"{m} {res['peak_cuda'][m] / 2**20:.1f}" for m in METHODS)
            print(f"N = {n}: allocator peak per rank (MiB, with activations): {peaks}")

    print("\nseconds per step, median of the rounds (spread), and time / DDP's (median of rounds):")
    time_ratio, ratio_range, agree, noisy = {}, {}, {}, []
    for n, res in results.items():
        timings = {m: Timing(tuple(res["seconds_per_step"][m])) for m in METHODS}
        row = []
        for m in METHODS:
            rounds = compare(timings[m], timings["DDP"])  # per round: DDP's time / this one's
            per_round = [1 / r for r in rounds.ratios]  # this one's time / DDP's
            time_ratio.setdefault(n, {})[m] = statistics.median(per_round)
            ratio_range.setdefault(n, {})[m] = [min(per_round), max(per_round)]
            agree.setdefault(n, {})[m] = all(r > 1 for r in per_round) or all(
                r < 1 for r in per_round
            )
            if timings[m].spread > NOISY:
                noisy.append(f"N={n} {m}")
            row.append(
                f"{m} {timings[m].median * 1e3:.1f} ms ({timings[m].spread:.0%}) "
                f"{time_ratio[n][m]:.2f}x"
            )
        print(f"N = {n}: " + "; ".join(row))
    if noisy:
        print(
            f"warning: the rounds of {', '.join(noisy)} spread by more than {NOISY:.0%}: the "
            "machine is busy; read the ratios from an idle machine, and more --repeats"
        )

    passed = all(r <= TARGET for r in ratios.values())
    worst_n = max(ratios, key=ratios.get)
    print(
        "\nFSDP2 / (DDP / N): "
        + ", ".join(f"N={n} {r:.3f}" for n, r in ratios.items())
        + f"; target <= {TARGET:.2f} at every N (worst N={worst_n}): {'PASS' if passed else 'FAIL'}"
    )

    if args.out:
        data = {
            "benchmark": "sharding",
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "hardware": hardware_as_dict(describe_hardware()),
            "width": args.width,
            "depth": args.depth,
            "parameters": n_params,
            "batch_per_rank": args.batch,
            "steps": args.steps,
            "repeats": args.repeats,
            "quick": args.quick,
            "methods": list(METHODS),
            "world_sizes": args.world_sizes,
            "runs": {str(n): res for n, res in results.items()},  # JSON keys are strings
            "fsdp_ratio": {str(n): r for n, r in ratios.items()},
            "meta_build_peak_over_full_model": {
                str(n): res["meta_build"]["peak"] / (4 * n_params) for n, res in results.items()
            },
            "time_ratio": {str(n): r for n, r in time_ratio.items()},
            "time_ratio_range": {str(n): r for n, r in ratio_range.items()},
            "rounds_agree": {str(n): r for n, r in agree.items()},
            "noisy": noisy,
            "target": TARGET,
            "passed": passed,
        }
        print(f"results written to {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
