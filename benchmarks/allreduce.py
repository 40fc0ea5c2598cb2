"""How fast is an all-reduce here? Bandwidth over message sizes, beside a memory-copy reference.

Lesson 06b (section 1) measures this in the notebook; this script runs the same code at larger
sizes and writes the result with the hardware. One launch of --world-size ranks times a float32
all-reduce (sum) of every power-of-two size from 1 KiB to --max-mb MiB, and rank 0 alone times
copies of a tensor larger than the caches (256 MiB or the largest message), with its own
threads: a reference line, not the machine's peak memory bandwidth (several processes copying
at once may exceed it). For each size it reports

  algbw   = size / time                      (how fast the message was reduced)
  busbw   = algbw * 2(n-1)/n                 (nccl-tests' bus bandwidth: what each rank of a
                                              ring sends per second; n = 2 gives busbw = algbw)

next to the reference: the bytes one rank copies per second (a copy reads and writes each byte,
so the memory moves twice that). It then fits the ring all-reduce cost model
t(S) = 2(n-1)*alpha + 2(n-1)/n * S/beta by least squares on relative errors, and prints each
size's model time. Times are the slowest rank's per call, medians over --repeats repeats, each
repeat started together (barrier) and ended by a device synchronisation
(mgpu_helpers.comm.time_collective).

The worker, the bandwidths and the model are lesson 06b's own, read from its notebook
(mgpu_helpers.lesson_code.load_lesson_code), and the fit is the one it calls
(mgpu_helpers.comm.fit_ring_model), so the benchmark measures what the lesson teaches.

Conditions: one machine. gloo (CPU ranks, or ranks sharing a GPU) goes through host memory and
loopback sockets; NCCL (one GPU per rank) over NVLink or PCIe, where the GPU's own memory copy
is far above the link, which is what limits. Inside one node NCCL runs rings, or NVLS on
NVSwitch systems (trees matter across nodes): busbw keeps the ring's factor as a convention.
A busy machine makes small messages noisy: the spread column says how much.

    PYTHONPATH=. python benchmarks/allreduce.py                       # best device here
    PYTHONPATH=. python benchmarks/allreduce.py --device cpu --world-size 2 --max-mb 256
    PYTHONPATH=. python benchmarks/allreduce.py --quick --out benchmarks/results/allreduce.json
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

# Run from a source checkout without installing: put the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_helpers.comm import fit_ring_model, size_label  # noqa: E402
from mgpu_helpers.devices import describe_hardware, gpu_count, hardware_as_dict  # noqa: E402
from mgpu_helpers.launch import launch  # noqa: E402
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code  # noqa: E402
from mgpu_helpers.placement import place, usable_cpus  # noqa: E402
from mgpu_helpers.util import write_json  # noqa: E402

# Lesson 06b's worker, bandwidths and cost model (section 1), run as its cells write them.
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("comm_worker", "algbw", "busbw", "ring_allreduce_seconds")
lesson = load_lesson_code("06b", NAMES, lesson_imports("06b", NOTEBOOKS), folder=NOTEBOOKS)

FORMULA = "t(S) = 2(n-1)*alpha + 2(n-1)/n * S/beta (ring all-reduce)"
FIT = "least squares on relative errors (residual / measured time), alpha >= 0"
COUNTED = "bytes copied per second (a copy reads and writes each byte: memory moves 2x this)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks (default: one per GPU, at least 2; ranks share GPUs over gloo when too few)",
    )
    parser.add_argument(
        "--max-mb",
        type=float,
        default=None,
        help="largest message in MiB (default 64, 1024 with NCCL; --quick: 16)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 7)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 3 repeats, messages up to 16 MiB; numbers mean little",
    )
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.max_mb is not None and not args.max_mb >= 2 / 1024:
        parser.error(
            f"--max-mb {args.max_mb}: the sweep starts at 1 KiB (1/1024 MiB) and the model's fit "
            "needs two sizes or more: pass 2/1024 or more (64 shows the bandwidth)"
        )
    return args


def choose_placement(args: argparse.Namespace) -> tuple[object, list[str]]:
    """The ranks' placement, and notes; ValueError saying what to change."""
    gpus = gpu_count()
    world_size = args.world_size if args.world_size is not None else max(2, gpus)
    if world_size < 2:
        raise ValueError(f"--world-size {world_size}: an all-reduce needs 2 or more ranks")
    notes = []
    device_type = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    if device_type == "cpu" and world_size > usable_cpus():
        raise ValueError(
            f"--world-size {world_size} is more than the {usable_cpus()} CPU cores this process "
            "may use: ranks would take turns on a core and the times would measure the "
            f"scheduler; use --world-size {max(2, usable_cpus())} or fewer"
        )
    share = device_type == "cuda" and 1 <= gpus < world_size
    if share:
        notes.append(f"{gpus} GPU(s) for {world_size} ranks: they share GPUs over gloo")
    return place(world_size, args.device, share_gpus=share), notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        placement, notes = choose_placement(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = placement.world_size
    if args.max_mb is None:
        args.max_mb = 16 if args.quick else (1024 if placement.backend == "nccl" else 64)
    sizes = [2**k for k in range(10, int(args.max_mb * 2**20).bit_length())]
    min_seconds = 0.01 if args.quick else 0.05
    hardware = describe_hardware()
    print(f"all-reduce benchmark: {placement.describe()}")
    for note in (*placement.notes, *notes):
        print(f"note: {note}")
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPU "
        f"cores, {len(hardware.gpus)} GPU(s){': ' + hardware.gpus[0].name if hardware.gpus else ''}"
        f"; load average {os.getloadavg()[0]:.1f} (a busy machine makes small messages noisy)"
    )
    print(
        f"float32 sum, {size_label(sizes[0])} to {size_label(sizes[-1])}, {args.repeats} "
        f"repeats of at least {min_seconds * 1e3:.0f} ms each, slowest rank, median"
        + (" (quick mode: smaller messages and fewer repeats)" if args.quick else "")
    )
    start = time.perf_counter()
    result = launch(lesson.comm_worker, placement, sizes, {}, args.repeats, min_seconds)[0]
    wall = time.perf_counter() - start
    sweep, (reference, copy) = result["sweep"], result["copy"]
    copy_bytes = max(*sizes, 2**28)  # what the lesson's worker copies
    medians = [sweep[s].median for s in sizes]
    try:
        alpha, beta = fit_ring_model(sizes, medians, n)
        fit_error = None
    except RuntimeError as exc:  # noise hid the growth with size: report it, keep the rest
        alpha, beta, fit_error = math.nan, math.nan, str(exc)

    rows = []
    for s, t in zip(sizes, medians, strict=True):
        bus = lesson.busbw(s, t, n)
        model = lesson.ring_allreduce_seconds(s, n, alpha, beta)
        rows.append(
            {
                "bytes": s,
                "seconds": list(sweep[s].times),
                "median_seconds": t,
                "spread": sweep[s].spread,
                "algbw_bytes_per_s": lesson.algbw(s, t),
                "busbw_bytes_per_s": bus,
                "busbw_over_reference": bus / reference,
                "model_seconds": None if fit_error else model,
                "model_error": None if fit_error else model / t - 1,
            }
        )
    print(
        f"\n{'size':>9} {'time':>12} {'spread':>7} {'algbw GB/s':>11} {'busbw GB/s':>11} "
        f"{'copy GB/s':>11} {'of copy':>9} {'model':>12} {'error':>7}"
    )
    for r in rows:
        line = (
            f"{size_label(r['bytes']):>9} {r['median_seconds'] * 1e6:9.1f} us {r['spread']:7.0%} "
            f"{r['algbw_bytes_per_s'] / 1e9:11.3f} {r['busbw_bytes_per_s'] / 1e9:11.3f} "
            f"{reference / 1e9:11.1f} {r['busbw_over_reference']:9.1%}"
        )
        if fit_error is None:
            line += f" {r['model_seconds'] * 1e6:9.1f} us {r['model_error']:+7.0%}"
        print(line)
    noisy = [size_label(r["bytes"]) for r in rows if r["spread"] > 0.5]
    best = max(rows, key=lambda r: r["busbw_bytes_per_s"])
    median_error = None if fit_error else statistics.median(abs(r["model_error"]) for r in rows)
    print(
        f"\nreference: rank 0 alone copying {size_label(copy_bytes)} on {result['copy_device']}, "
        f"{reference / 1e9:.1f} GB/s copied ({2 * reference / 1e9:.1f} GB/s read + written);\n"
        "  one process's threads, not the machine's peak"
    )
    print(
        f"best busbw {best['busbw_bytes_per_s'] / 1e9:.3f} GB/s at {size_label(best['bytes'])}: "
        f"the copy rate multiplied by {best['busbw_over_reference']:.3f}"
    )
    if fit_error is None:
        print(
            f"model {FORMULA}, fitted: alpha = {alpha * 1e6:.1f} us, beta = {beta / 1e9:.3f} GB/s"
        )
        print(
            f"  beta is the copy rate multiplied by {beta / reference:.3f}; model error over the "
            "sizes: median "
            f"{median_error:.0%}"
        )
    else:
        print(f"model {FORMULA}: no fit. {fit_error}")
    if noisy:
        print(f"noisy (repeats differ by more than half the median): {', '.join(noisy)}")
    print(f"measured in {wall:.1f} s, launch included")

    if args.out:
        out = {
            "benchmark": "allreduce",
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "hardware": hardware_as_dict(hardware),
            "load_average": os.getloadavg()[0],
            "placement": asdict(placement),  # where the ranks ran and how they talked
            "dtype": "float32",
            "op": "sum",
            "repeats": args.repeats,
            "min_seconds": min_seconds,
            "quick": args.quick,
            "busbw_factor": 2 * (n - 1) / n,
            "sizes": rows,
            # the reference line (the key keeps its old name: run_all.py reads it)
            "ceiling": {
                "what": f"rank 0 alone copying {size_label(copy_bytes)} on {result['copy_device']}",
                "counted": COUNTED,
                "seconds": list(copy.times),
                "bytes_per_s": reference,
            },
            "model": {
                "formula": FORMULA,
                "fit": FIT,
                "alpha_seconds": None if fit_error else alpha,
                "beta_bytes_per_s": None if fit_error else beta,
                "median_abs_error": median_error,
                "error": fit_error,
            },
            "noisy_sizes": noisy,
            "wall_seconds": wall,
        }
        print(f"results written to {write_json(args.out, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
