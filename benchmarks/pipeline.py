"""Does pipelining pay? An unsplit model, the naive split and GPipe micro-batches (lesson 05).

One MLP, one batch, a full training step (forward, loss, backward, SGD step) three ways:

  unsplit    the whole model on the first device
  naive      the model cut into S balanced stages, stage i on device i, the batch in one piece
             (a SplitModel: one stage works while the others wait)
  pipe M=k   the same stages under gpipe_step: the batch in k micro-batches, one thread per
             stage, all forwards then all backwards (GPipe)

SplitModel, cut and gpipe_step are lesson 05a's own, read from its notebook and run as written
(mgpu_helpers.lesson_code.load_lesson_code): the benchmark times the lesson's code.

The ideal comes from the bubble formula. With S equal stages on S separate devices and free
transfers, a GPipe step keeps each device busy for M of every M + S - 1 time slots, where the
naive split keeps it busy for 1 of every S. So pipelined / naive = S*M / (M + S - 1). The naive
split does the unsplit model's work one stage at a time, so the same number is the ideal over
the unsplit model. When the devices repeat (cuda:0,cuda:0: one GPU stands in for two), there is
one device to share and the ideal is 1.0. On the CPU every stage thread gets one core
(torch.set_num_threads(1)), so the CPU counts as S devices when it has S cores.

Variants take turns within each repeat (the order alternates), each timing covers --steps
steps with every device synchronised at both ends, and the table shows the median over the
repeats. Before timing, the script checks that a pipelined step changes the weights exactly as
the naive step does. The overlap column reads each pipelined step's timeline: how long before
stage 0's last forward ended stage 1 began its first (positive: the two stages worked at the
same time; on two GPUs a value <= 0 for M >= 2 means the schedule serialised). Each GPU's
clock counts from its own origin event, and the origins are recorded one after the other, so
between two GPUs the value is good to a few microseconds: read only a clear margin as overlap.

    PYTHONPATH=. python benchmarks/pipeline.py   # devices: place(2, share_gpus=True)
    PYTHONPATH=. python benchmarks/pipeline.py --devices cuda:0,cuda:1 --micro 1 2 4 8 16
    PYTHONPATH=. python benchmarks/pipeline.py --quick --out benchmarks/results/pipeline.json
"""

from __future__ import annotations

import argparse
import copy
import functools
import platform
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Run from a source checkout without installing: put the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_helpers.lesson_code import load_lesson_code  # noqa: E402
from mgpu_helpers.model_parallel import (  # noqa: E402
    Event,
    Timeline,
    balance,
    bubble_fraction,
    forward_overlap,
    idle_fraction,
    layer_costs,
    run_stages,
)
from mgpu_helpers.models import count_parameters, mlp  # noqa: E402
from mgpu_helpers.placement import place, usable_cpus  # noqa: E402
from mgpu_helpers.timing import synchronize  # noqa: E402
from mgpu_helpers.util import write_json  # noqa: E402

# The split model and the GPipe step are lesson 05a's (sections 1.3 and 3.1), read from its
# notebook and run as its cells write them: the lesson is the one place this code lives. The
# namespace holds the names that code uses (the lesson's imports).
NAMES = ("SplitModel", "cut", "Streams", "copy_streams", "send", "receive", "gpipe_step")
lesson = load_lesson_code(
    "05a",
    NAMES,
    {
        "Event": Event,
        "F": F,
        "Tensor": Tensor,
        "functools": functools,
        "Timeline": Timeline,
        "nn": nn,
        "queue": queue,
        "run_stages": run_stages,
        "torch": torch,
    },
    folder=Path(__file__).resolve().parent.parent / "notebooks",
)


FORMULA = "ideal pipelined/naive = S*M/(M+S-1) (S equal stages on S separate devices)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices",
        default=None,
        help="comma-separated, one per stage (default: cuda:0,cuda:1 with 2 GPUs, "
        "cuda:0,cuda:0 with 1, cpu,cpu with none)",
    )
    parser.add_argument("--batch", type=int, default=None, help="samples per step")
    parser.add_argument("--micro", type=int, nargs="+", default=None, help="micro-batch counts")
    parser.add_argument("--hidden", type=int, default=None, help="width of the MLP")
    parser.add_argument("--depth", type=int, default=None, help="hidden layers of the MLP")
    parser.add_argument("--steps", type=int, default=None, help="training steps per timing")
    parser.add_argument("--repeats", type=int, default=None, help="timings per variant")
    parser.add_argument("--quick", action="store_true", help="tiny smoke test: numbers mean little")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.devices is None:
        args.devices = ",".join(place(2, share_gpus=True).devices)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if len(devices) < 2:
        parser.error(f"--devices needs two or more devices (one per stage), got {args.devices!r}")
    try:
        args.devices = [torch.device(d) for d in devices]
    except RuntimeError as exc:
        parser.error(f"--devices: {exc}")
    # "cuda" means the current GPU: each stage thread needs the index to set its device
    args.devices = [
        torch.device("cuda", torch.cuda.current_device())
        if d.type == "cuda" and d.index is None
        else d
        for d in args.devices
    ]
    on_gpu = any(d.type == "cuda" for d in args.devices)
    # Sizes: GPUs need big layers to be kept busy; the CPU needs small ones to finish.
    if args.quick:
        sizes = {
            "batch": 64,
            "micro": [1, 2, 4],
            "hidden": 128,
            "depth": 4,
            "steps": 2,
            "repeats": 2,
        }
    elif on_gpu:
        sizes = {
            "batch": 1024,
            "micro": [1, 2, 4, 8, 16],
            "hidden": 4096,
            "depth": 8,
            "steps": 5,
            "repeats": 7,
        }
    else:
        sizes = {
            "batch": 512,
            "micro": [1, 2, 4, 8, 16],
            "hidden": 1024,
            "depth": 4,
            "steps": 2,
            "repeats": 5,
        }
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("batch", "hidden", "depth", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if any(m < 1 or m > args.batch for m in args.micro):
        parser.error(f"--micro values must be between 1 and --batch ({args.batch})")
    return args


def separate_hardware(devices: list[torch.device]) -> tuple[bool, str]:
    """Whether each stage gets hardware of its own, and why (the ideal depends on it)."""
    if all(d.type == "cpu" for d in devices):
        cores = usable_cpus()  # the cores this process may run on
        ok = cores >= len(devices)
        return ok, f"CPU stages, one core each: {cores} cores for {len(devices)} stages"
    if len(set(devices)) == len(devices):
        return True, "every stage on its own device"
    return False, "devices repeat: the stages share one device, so the ideal is 1.0"


def two_thread_speedup(repeats: int = 3) -> float:
    """How much faster two CPU threads finish two jobs than one thread (2.0: two free cores)."""
    w = torch.randn(512, 512)

    def work() -> None:
        for _ in range(10):
            w @ w

    def run(n_threads: int) -> float:
        threads = [threading.Thread(target=work) for _ in range(n_threads)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if n_threads == 1:
            work()  # the second job, after the first
        return time.perf_counter() - start

    run(2)  # warm-up
    one = statistics.median(run(1) for _ in range(repeats))
    two = statistics.median(run(2) for _ in range(repeats))
    return one / two


def sync_all(devices: list[torch.device]) -> None:
    for d in dict.fromkeys(devices):
        synchronize(d)


def plain_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    """One ordinary training step: a whole batch through the model, which may be split."""
    optimizer.zero_grad(set_to_none=True)
    out = model(x)
    F.cross_entropy(out, y.to(out.device)).backward()
    optimizer.step()


def check_pipeline_matches_naive(split: nn.Module, x, y, n_micro: int, devices) -> float:
    """Largest weight difference after one naive and one pipelined step from the same start."""
    naive, piped = copy.deepcopy(split), copy.deepcopy(split)
    plain_step(naive, torch.optim.SGD(naive.parameters(), lr=0.01), x, y)
    lesson.gpipe_step(piped, torch.optim.SGD(piped.parameters(), lr=0.01), x, y, n_micro)
    sync_all(devices)
    diff = 0.0
    for p, q in zip(naive.parameters(), piped.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
        diff = max(diff, (p - q).abs().max().item())
    return diff


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices: list[torch.device] = args.devices
    n_stages = len(devices)
    if all(d.type == "cpu" for d in devices):
        torch.set_num_threads(1)  # one core per stage thread: the CPU as S one-core devices
    separate, why = separate_hardware(devices)

    torch.manual_seed(0)
    model = mlp(args.hidden, num_classes=10, hidden=args.hidden, depth=args.depth)
    cuts = balance(layer_costs(model), n_stages)
    unsplit = copy.deepcopy(model).to(devices[0])
    split = lesson.SplitModel(lesson.cut(copy.deepcopy(model), cuts), devices)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.hidden, generator=g).to(devices[0])
    y = torch.randint(0, 10, (args.batch,), generator=g).to(devices[0])
    opt_unsplit = torch.optim.SGD(unsplit.parameters(), lr=1e-3, momentum=0.9)
    opt_split = torch.optim.SGD(split.parameters(), lr=1e-3, momentum=0.9)

    names = [str(d) for d in devices]
    print(
        f"pipeline benchmark: MLP {args.hidden} wide, {args.depth} hidden layers "
        f"({count_parameters(model) / 1e6:.1f}M parameters), batch {args.batch}, "
        f"S={n_stages} stages on {', '.join(names)} (cuts {cuts})"
    )
    gpu_names = {str(d): torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"}
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, "
        f"{torch.get_num_threads()} CPU threads per stage"
        + (f", GPUs: {gpu_names}" if gpu_names else "")
    )
    print(f"{args.steps} steps per timing, {args.repeats} repeats, median reported; {why}")
    overlap = None
    if all(d.type == "cpu" for d in devices):
        overlap = two_thread_speedup()
        print(
            f"two CPU threads at once: {overlap:.2f}x one after the other (2.00 = two free "
            "cores; near 1.00 the stages cannot overlap, whatever the ideal says)"
        )

    diff = check_pipeline_matches_naive(split, x, y, max(args.micro), devices)
    print(
        f"check: a pipelined step (M={max(args.micro)}) equals the naive step "
        f"(largest weight difference {diff:.1e})"
    )

    idle: dict[int, list[float]] = {m: [] for m in args.micro}
    overlap_s: dict[int, list[float]] = {m: [] for m in args.micro}

    def pipe(m: int) -> Callable[[], None]:
        def step() -> None:
            _, events = lesson.gpipe_step(split, opt_split, x, y, m)
            idle[m].append(idle_fraction(events))
            overlap_s[m].append(forward_overlap(events))

        return step

    variants: dict[str, Callable[[], None]] = {
        "unsplit": lambda: plain_step(unsplit, opt_unsplit, x, y),
        "naive": lambda: plain_step(split, opt_split, x, y),
    }
    for m in args.micro:
        variants[f"pipe M={m}"] = pipe(m)

    for step in variants.values():  # warm-up: allocator, kernels, caches, threads
        for _ in range(2):
            step()
    sync_all(devices)
    for values in (*idle.values(), *overlap_s.values()):
        values.clear()

    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(args.repeats):
        for name in order if r % 2 == 0 else order[::-1]:  # no variant always goes first
            sync_all(devices)
            start = time.perf_counter()
            for _ in range(args.steps):
                variants[name]()
            sync_all(devices)
            times[name].append((time.perf_counter() - start) / args.steps)

    median = {name: statistics.median(t) for name, t in times.items()}
    speed = {name: args.batch / s for name, s in median.items()}
    ratio = {name: speed[name] / speed["unsplit"] for name in variants}
    ideal = {"unsplit": 1.0, "naive": 1.0}
    for m in args.micro:
        ideal[f"pipe M={m}"] = n_stages * m / (m + n_stages - 1) if separate else 1.0

    print(f"\n{FORMULA}.")
    if separate:
        print("The naive split does the unsplit model's work one stage at a time, so this is")
        print("also the ideal over the unsplit model.")
    else:
        print("Here the stages share one device, so nothing can overlap: the ideal is 1.0.")
    header = f"{'variant':<10} {'ms/step':>9} {'samples/s':>11} {'vs unsplit':>11} {'ideal':>6}"
    print(f"\n{header} {'idle':>6} {'bubble':>7} {'overlap':>9}")
    for name in variants:
        line = (
            f"{name:<10} {median[name] * 1e3:9.2f} {speed[name]:11,.0f} "
            f"{ratio[name]:11.2f} {ideal[name]:6.2f}"
        )
        if name.startswith("pipe"):
            m = int(name.split("=")[1])
            line += f" {statistics.median(idle[m]):6.0%} {bubble_fraction(n_stages, m):7.0%}"
            line += f" {statistics.median(overlap_s[m]) * 1e3:6.2f} ms"
        print(line)
    print("\nidle: measured share of time the stages waited (median); bubble: (S-1)/(M+S-1).")
    print(
        "overlap: how long before stage 0's last forward ended stage 1 started its first "
        "(median;\n> 0: the stages worked at the same time, <= 0: they took turns)."
    )

    if args.out:
        result = {
            "benchmark": "pipeline",
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "devices": names,
            "device_names": gpu_names,
            "separate_hardware": separate,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_threads": torch.get_num_threads(),
            "hidden": args.hidden,
            "depth": args.depth,
            "parameters": count_parameters(model),
            "batch": args.batch,
            "cuts": cuts,
            "micro": args.micro,
            "steps": args.steps,
            "repeats": args.repeats,
            "quick": args.quick,
            "formula": FORMULA,
            "seconds_per_step": times,
            "median_seconds_per_step": median,
            "samples_per_sec": speed,
            "ratio_to_unsplit": ratio,
            "ideal_ratio_to_unsplit": ideal,
            "idle_fraction": {f"pipe M={m}": statistics.median(v) for m, v in idle.items()},
            "bubble_fraction": {f"pipe M={m}": bubble_fraction(n_stages, m) for m in args.micro},
            "forward_overlap_seconds": {
                f"pipe M={m}": statistics.median(v) for m, v in overlap_s.items()
            },
            "pipeline_check_max_difference": diff,
            "cpu_two_thread_speedup": overlap,
        }
        print(f"results written to {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
