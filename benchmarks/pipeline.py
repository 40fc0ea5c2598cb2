"""Does pipelining pay? An unsplit model, the naive split and GPipe micro-batches (lesson 05).

One MLP, one batch, a full training step (forward, loss, backward, SGD step) three ways:

  unsplit    the whole model on the first device
  naive      the model cut into S balanced stages, stage i on device i, the batch in one piece
             (a SplitModel: one stage works while the others wait)
  pipe M=k   the same stages under gpipe_step (lesson 05's, copied below): the batch in k
             micro-batches, one thread per stage, all forwards then all backwards (GPipe)

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
import os
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
from mgpu_helpers.placement import place  # noqa: E402
from mgpu_helpers.timing import synchronize  # noqa: E402
from mgpu_helpers.util import write_json  # noqa: E402


# The split model and the GPipe step, as lesson 05 writes them in its cells (sections 1.3 and
# 3.1): a benchmark is a script that stands on its own. tests/test_pipeline_benchmark.py checks
# that this copy and the lesson's stay the same code.
# --- from lesson 05 ---
class SplitModel(nn.Module):
    """Consecutive stages of a model, stage i on ``devices[i]``."""

    def __init__(self, stages: list[nn.Module], devices: list[torch.device]) -> None:
        super().__init__()
        self.devices = list(devices)
        self.stages = nn.ModuleList(s.to(d) for s, d in zip(stages, self.devices, strict=True))

    def forward(self, x: Tensor) -> Tensor:
        for stage, device in zip(self.stages, self.devices, strict=True):
            x = stage(x.to(device))  # the activation crosses to this stage's device here
        return x


def cut(model: nn.Sequential, cuts: list[int]) -> list[nn.Module]:
    """``model`` cut before the layer indices in ``cuts``: [4] gives model[:4], model[4:]."""
    points = [0, *cuts, len(model)]
    return [model[a:b] for a, b in zip(points, points[1:], strict=False)]


Streams = dict[tuple[torch.device, torch.device], tuple[torch.cuda.Stream, torch.cuda.Stream]]


def copy_streams(devices: list[torch.device]) -> Streams:
    """A (send, receive) pair of side streams for each direction between neighbouring GPUs."""
    streams = {}
    for a, b in zip(devices, devices[1:], strict=False):
        if a != b and a.type == b.type == "cuda":
            for src, dst in ((a, b), (b, a)):  # activations forward, gradients back
                streams[src, dst] = (torch.cuda.Stream(src), torch.cuda.Stream(dst))
    return streams


def send(t: Tensor, dst: torch.device, streams: Streams) -> tuple[Tensor, object]:
    """Start moving ``t``, just computed by this thread, to ``dst``; return it and its arrival."""
    if (t.device, dst) not in streams:  # the CPU, or one device: nothing to overlap
        return t.to(dst), None
    send_stream, receive_stream = streams[t.device, dst]
    send_stream.wait_stream(torch.cuda.current_stream(t.device))  # after t is computed
    with torch.cuda.stream(receive_stream), torch.cuda.stream(send_stream):
        moved = t.to(dst, non_blocking=True)  # queued on the side stream of t's device
    t.record_stream(send_stream)  # the allocator keeps t until the copy has read it
    arrived = torch.cuda.Event()
    arrived.record(receive_stream)
    return moved, arrived


def receive(t: Tensor, arrived: object) -> Tensor:
    """Make this thread's stream on ``t``'s device wait until ``t`` has arrived."""
    if arrived is not None:
        compute = torch.cuda.current_stream(t.device)
        compute.wait_event(arrived)
        t.record_stream(compute)  # t was allocated on the receive stream and is used here
    return t


def gpipe_step(
    model: SplitModel,
    optimizer: torch.optim.Optimizer,
    inputs: Tensor,
    targets: Tensor,
    n_micro: int,
) -> tuple[Tensor, list[Event]]:
    """One training step with the GPipe schedule over ``n_micro`` micro-batches.

    Returns the batch's mean loss and the timeline: what each stage ran, and when.
    """
    stages, devices = list(model.stages), model.devices
    last = len(stages) - 1
    xs = inputs.to(devices[0]).chunk(n_micro)  # the micro-batches, on the first device
    ys = targets.to(devices[-1]).chunk(n_micro)  # their targets, where the loss is computed
    streams = copy_streams(devices)
    forward_in = [queue.Queue() for _ in stages]  # (micro, activation, arrival) into stage s
    backward_in = [queue.Queue() for _ in stages]  # (micro, gradient, arrival) into stage s
    for m, x in enumerate(xs):
        forward_in[0].put((m, x, None))
    losses = [None] * len(xs)  # each micro-batch's share of the batch's mean loss
    timeline = Timeline(devices)
    model.train()
    optimizer.zero_grad(set_to_none=True)

    def run_stage(s: int) -> None:
        device, stage, kept = devices[s], stages[s], {}
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread queues its work on its own GPU
        for _ in xs:  # all forwards, in micro-batch order
            m, x, arrived = forward_in[s].get()
            x = receive(x, arrived).detach().requires_grad_(s > 0)
            begin = timeline.mark(device)  # the input is here: the forward starts
            out = stage(x)
            if s == last:  # weighted by its share of the batch: the gradients add up right
                out = F.cross_entropy(out, ys[m]) * len(ys[m]) / len(targets)
                losses[m] = out.detach()
            timeline.add(s, m, "F", device, begin)
            kept[m] = (x, out)  # what this micro-batch's backward needs
            if s < last:  # send the activation on at once
                forward_in[s + 1].put((m, *send(out.detach(), devices[s + 1], streams)))
        for m in reversed(range(len(xs))):  # then all backwards, last micro-batch first
            x, out = kept.pop(m)
            grad = None  # the last stage starts from its loss
            if s < last:  # the others from the gradient the next stage sends back
                _, grad, arrived = backward_in[s].get()
                grad = receive(grad, arrived)
            begin = timeline.mark(device)
            out.backward(grad)
            timeline.add(s, m, "B", device, begin)
            if s > 0:  # send the input's gradient back at once
                backward_in[s - 1].put((m, *send(x.grad, devices[s - 1], streams)))

    run_stages(run_stage, len(stages), forward_in + backward_in)  # one thread per stage
    optimizer.step()
    return torch.stack(losses).sum(), timeline.events()


# --- end of lesson 05's code ---


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
        cores = os.cpu_count() or 1
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
    gpipe_step(piped, torch.optim.SGD(piped.parameters(), lr=0.01), x, y, n_micro)
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
    split = SplitModel(cut(copy.deepcopy(model), cuts), devices)
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
            _, events = gpipe_step(split, opt_split, x, y, m)
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
