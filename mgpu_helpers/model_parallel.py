"""Model parallelism: a model split across devices, and pipelined micro-batches (lesson 05).

:class:`SplitModel` runs consecutive stages on consecutive devices and moves the activations
between them in ``forward``; autograd carries the gradients back across devices on its own.
:func:`pipeline_step` runs a GPipe schedule: the batch is cut into micro-batches, every stage
runs in its own thread, forwards for all micro-batches, then backwards in reverse, so stage 1
can work on micro-batch 0 while stage 0 works on micro-batch 1. Each stage sends its output
(and, going back, its input's gradient) on to the next device right after computing it; between
two GPUs the copy runs on side streams and the receiving stage's stream waits on an event. It
records a timeline of what ran when (CUDA events on GPUs, the wall clock on the CPU).
:func:`balance` chooses where to cut an ``nn.Sequential`` so the stages cost about the same, by
parameter count or measured time.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .timing import measure, synchronize

__all__ = [
    "Event",
    "SplitModel",
    "balance",
    "bubble_fraction",
    "forward_overlap",
    "idle_fraction",
    "layer_costs",
    "memory_by_device",
    "pipeline_step",
    "split_sequential",
]


class SplitModel(nn.Module):
    """Stages of a model, each on its own device; ``forward`` moves activations between them."""

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device | str]) -> None:
        super().__init__()
        if len(stages) != len(devices) or not stages:
            raise ValueError(f"need one device per stage, got {len(stages)} and {len(devices)}")
        self.devices = [_with_index(torch.device(d)) for d in devices]
        self.stages = nn.ModuleList(s.to(d) for s, d in zip(stages, self.devices, strict=True))

    def forward(self, x: Tensor) -> Tensor:
        for stage, device in zip(self.stages, self.devices, strict=True):
            x = stage(x.to(device))  # the activation crosses to the next device here
        return x


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` as the GPU it means here (the current one): ``pipeline_step``'s stage threads
    start on GPU 0 whatever this thread set, and ``torch.cuda.set_device`` needs an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def split_sequential(
    model: nn.Sequential, cuts: Sequence[int], devices: Sequence[torch.device | str]
) -> SplitModel:
    """Cut ``model`` before the layer indices in ``cuts`` and put stage i on ``devices[i]``.

    ``cuts=[4]`` on a 10-layer model gives stages ``model[:4]`` and ``model[4:]``.
    """
    n = len(model)
    points = [0, *cuts, n]
    if any(b <= a for a, b in zip(points, points[1:], strict=False)):
        raise ValueError(
            f"cuts must be increasing layer indices strictly between 0 and {n}, got {list(cuts)}"
        )
    stages = [model[a:b] for a, b in zip(points, points[1:], strict=False)]
    return SplitModel(stages, devices)


def layer_costs(
    model: nn.Sequential, by: str = "params", sample: Tensor | None = None, repeats: int = 3
) -> list[float]:
    """The cost of each layer: its parameter count, or its measured forward+backward seconds."""
    if by == "params":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in model]
    if by != "time":
        raise ValueError(f"by={by!r} is unknown; choose 'params' or 'time'")
    if sample is None:
        raise ValueError("by='time' needs a sample input batch to time the layers on")
    costs = []
    x = sample
    device = sample.device
    for layer in model:
        inp = x.detach().requires_grad_(x.is_floating_point())

        def run(layer: nn.Module = layer, inp: Tensor = inp) -> None:
            out = layer(inp)
            if out.requires_grad:
                out.sum().backward()

        costs.append(measure(run, device, warmup=1, repeats=repeats).median)
        with torch.no_grad():
            x = layer(x)
    model.zero_grad(set_to_none=True)
    return costs


def balance(costs: Sequence[float], n_stages: int) -> list[int]:
    """Cut points that minimise the most expensive stage (contiguous stages, exact search)."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"n_stages must be between 1 and the {n} layers, got {n_stages}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest possible maximum stage cost for the first i layers in k stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    points, i = [], n
    for k in range(n_stages, 1, -1):
        i = cut[k][i]
        points.append(i)
    return sorted(points)


def memory_by_device(
    model: nn.Module, optimizer_slots: int = 1, sample: Tensor | None = None
) -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients, optimizer state and activations on each device.

    Computed from tensor sizes, so it works on the CPU too: gradients are as large as the
    parameters, ``optimizer_slots`` is the number of state tensors per parameter (1 for SGD
    with momentum, 2 for Adam), and activations are the outputs of every leaf module for
    ``sample`` (what backward keeps), counted on the device they were made on. A
    :class:`SplitModel` gets one row per stage ("stage 0 (cuda:0)"), so stages that share a
    device (virtual devices) are still told apart.
    """
    if isinstance(model, SplitModel):
        return _memory_by_stage(model, optimizer_slots, sample)
    report: dict[str, dict[str, int]] = {}

    def row(device: torch.device) -> dict[str, int]:
        return report.setdefault(
            str(device), {"parameters": 0, "gradients": 0, "optimizer": 0, "activations": 0}
        )

    for p in model.parameters():
        size = p.numel() * p.element_size()
        r = row(p.device)
        r["parameters"] += size
        r["gradients"] += size
        r["optimizer"] += optimizer_slots * size
    if sample is not None:
        hooks = []

        def count(_module: nn.Module, _inputs: object, output: object) -> None:
            if isinstance(output, Tensor):
                row(output.device)["activations"] += output.numel() * output.element_size()

        for module in model.modules():
            if not list(module.children()):
                hooks.append(module.register_forward_hook(count))
        try:
            with torch.no_grad():
                model(sample)
        finally:
            for h in hooks:
                h.remove()
    return report


def _memory_by_stage(
    model: SplitModel, optimizer_slots: int, sample: Tensor | None
) -> dict[str, dict[str, int]]:
    report = {}
    x = sample
    for i, (stage, device) in enumerate(zip(model.stages, model.devices, strict=True)):
        x = None if x is None else x.to(device)
        rows = memory_by_device(stage, optimizer_slots, x).values()
        report[f"stage {i} ({device})"] = {
            key: sum(row[key] for row in rows)
            for key in ("parameters", "gradients", "optimizer", "activations")
        }
        if x is not None:
            with torch.no_grad():
                x = stage(x)
    return report


@dataclass(frozen=True)
class Event:
    """One piece of work in a pipeline timeline: stage, micro-batch, forward or backward."""

    stage: int
    micro: int
    kind: str  # "F" (forward) or "B" (backward)
    start: float  # seconds since the step started
    end: float


class _Clock:
    """Timestamps per device: CUDA events on GPUs, the wall clock on the CPU."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        for d in devices:
            synchronize(d)
        self.t0 = time.perf_counter()
        self.origins = {}
        for d in devices:
            if d.type == "cuda" and d not in self.origins:
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(d))
                self.origins[d] = event

    def mark(self, device: torch.device) -> object:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter() - self.t0

    def seconds(self, device: torch.device, mark: object) -> float:
        if device.type == "cuda":
            return self.origins[device].elapsed_time(mark) / 1e3  # type: ignore[arg-type]
        return float(mark)  # type: ignore[arg-type]


_Streams = dict[tuple[torch.device, torch.device], tuple[torch.cuda.Stream, torch.cuda.Stream]]


def _copy_streams(devices: Sequence[torch.device]) -> _Streams:
    """A (send, receive) pair of side streams for each direction between neighbouring GPUs."""
    streams: _Streams = {}
    for a, b in zip(devices, devices[1:], strict=False):
        if a != b and a.type == b.type == "cuda":
            for src, dst in ((a, b), (b, a)):  # activations forward, gradients back
                if (src, dst) not in streams:
                    streams[src, dst] = (torch.cuda.Stream(src), torch.cuda.Stream(dst))
    return streams


def _send(t: Tensor, dst: torch.device, streams: _Streams) -> tuple[Tensor, object]:
    """Start moving ``t``, just computed by this thread, to ``dst``; return it and its arrival.

    Lesson 05, section 4.1. A device-to-device ``.to()`` runs on the *source* device's current
    stream and makes the destination's current stream wait for it. Issued by the receiving
    stage, it would queue behind every forward the sending stage had already queued, so the
    sender issues it, right after its own work. Between two GPUs the copy runs on a side stream
    of each device (``send``, ``receive``), so it holds up neither stage's computation; the
    returned event marks the arrival, which :func:`_receive` makes the consumer wait for. On
    the CPU, or within one device, the tensor is moved (or kept) as it is, with no event.
    """
    if (t.device, dst) not in streams:
        return t.to(dst), None
    send, receive = streams[t.device, dst]
    send.wait_stream(torch.cuda.current_stream(t.device))  # after t is computed, not later work
    # Current streams during the copy: send on the source, receive on the destination.
    with torch.cuda.stream(receive), torch.cuda.stream(send):
        moved = t.to(dst, non_blocking=True)
    t.record_stream(send)  # the allocator keeps t's memory until the copy has read it
    arrived = torch.cuda.Event()
    arrived.record(receive)
    return moved, arrived


def _receive(t: Tensor, arrived: object) -> Tensor:
    """Make this thread's stream on ``t``'s device wait until ``t`` has arrived (see _send)."""
    if arrived is not None:
        compute = torch.cuda.current_stream(t.device)
        compute.wait_event(arrived)  # type: ignore[arg-type]
        t.record_stream(compute)  # t was allocated on the receive stream and is used here
    return t


def pipeline_step(
    model: SplitModel,
    optimizer: torch.optim.Optimizer,
    inputs: Tensor,
    targets: Tensor,
    n_micro: int,
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
) -> tuple[Tensor, list[Event]]:
    """One training step with the GPipe schedule over ``n_micro`` micro-batches (lesson 05).

    Each stage runs in its own thread: all forwards in order, then all backwards in reverse.
    A stage sends each output to the next stage's device as soon as it has computed it, and
    each input's gradient back the same way; a timeline event starts once its input is there.
    Micro-batch losses are weighted by their share of the batch, so the accumulated gradients
    equal the whole batch's. ``n_micro=1`` is the naive split, with no overlap. Returns the
    batch's mean loss and the timeline.
    """
    if not isinstance(n_micro, int) or n_micro < 1:
        raise ValueError(f"n_micro must be a whole number >= 1, got {n_micro!r}")
    if n_micro > inputs.shape[0]:
        raise ValueError(f"n_micro={n_micro} is more than the {inputs.shape[0]} samples")
    stages, devices = list(model.stages), model.devices
    n_stages = len(stages)
    # Inputs to the first device and targets to the last one before the step starts: a copy
    # issued later by the last stage's thread would queue behind the first stage's work.
    xs = inputs.to(devices[0]).chunk(n_micro)
    ys = targets.to(devices[-1]).chunk(n_micro)
    n_micro = len(xs)  # chunk may make fewer pieces
    total = inputs.shape[0]
    streams = _copy_streams(devices)
    forward_q = [queue.Queue() for _ in range(n_stages)]  # (micro, activation, arrival) into s
    backward_q = [queue.Queue() for _ in range(n_stages)]  # (micro, gradient, arrival) into s
    for m, x in enumerate(xs):
        forward_q[0].put((m, x, None))
    clock = _Clock(devices)
    marks: list[tuple[int, int, str, object, object]] = []
    losses: list[Tensor] = [torch.zeros(())] * n_micro
    errors: list[BaseException] = []
    model.train()
    optimizer.zero_grad(set_to_none=True)

    def run_stage(s: int) -> None:
        dev, stage = devices[s], stages[s]
        saved: dict[int, tuple[Tensor, Tensor]] = {}
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # this thread issues its work to its own GPU
        try:
            for _ in range(n_micro):
                m, x, arrived = forward_q[s].get()
                if m < 0:
                    return  # another stage failed
                inp = _receive(x, arrived).detach().requires_grad_(s > 0)
                begin = clock.mark(dev)  # the input is here: the forward can start
                out = stage(inp)
                if s == n_stages - 1:
                    weight = xs[m].shape[0] / total
                    out = loss_fn(out, ys[m]) * weight
                    losses[m] = out.detach()
                saved[m] = (inp, out)
                marks.append((s, m, "F", begin, clock.mark(dev)))
                if s < n_stages - 1:  # send the activation on at once
                    forward_q[s + 1].put((m, *_send(out.detach(), devices[s + 1], streams)))
            for _ in range(n_micro):
                if s == n_stages - 1:
                    m = max(saved)  # the last stage starts with the last micro-batch
                    grad = None
                else:
                    m, grad, arrived = backward_q[s].get()
                    if m < 0:
                        return
                    grad = _receive(grad, arrived)
                inp, out = saved.pop(m)
                begin = clock.mark(dev)
                out.backward(grad)
                marks.append((s, m, "B", begin, clock.mark(dev)))
                if s > 0:  # send the input's gradient back at once
                    backward_q[s - 1].put((m, *_send(inp.grad, devices[s - 1], streams)))
        except BaseException as exc:  # surfaced in the caller's thread
            errors.append(exc)
            for q in (*forward_q, *backward_q):
                q.put((-1, None, None))

    threads = [threading.Thread(target=run_stage, args=(s,), daemon=True) for s in range(n_stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for d in devices:
        synchronize(d)
    optimizer.step()
    events = [
        Event(s, m, k, clock.seconds(devices[s], a), clock.seconds(devices[s], b))
        for s, m, k, a, b in marks
    ]
    loss = torch.stack([loss.to(inputs.device) for loss in losses]).sum()
    return loss, sorted(events, key=lambda e: (e.stage, e.start))


def forward_overlap(events: Sequence[Event], stage: int = 0) -> float:
    """Seconds by which stage ``stage + 1``'s first forward starts before ``stage``'s last ends.

    Lesson 05: positive when the two stages ran forwards of different micro-batches at the same
    time (a pipeline), zero or negative when the next stage started only once this one had
    finished every forward (the naive split, or a pipeline that serialised).
    """
    mine = [e for e in events if e.stage == stage and e.kind == "F"]
    nexts = [e for e in events if e.stage == stage + 1 and e.kind == "F"]
    if not mine or not nexts:
        raise ValueError(f"need forward events of stages {stage} and {stage + 1}")
    return max(e.end for e in mine) - min(e.start for e in nexts)


def bubble_fraction(n_stages: int, n_micro: int) -> float:
    """Idle share of an ideal GPipe schedule with equal stages: (S - 1) / (M + S - 1)."""
    if n_stages < 1 or n_micro < 1:
        raise ValueError(f"need n_stages >= 1 and n_micro >= 1, got {n_stages}, {n_micro}")
    return (n_stages - 1) / (n_micro + n_stages - 1)


def idle_fraction(events: Sequence[Event]) -> float:
    """Measured idle share: 1 - busy time / (stages x time from first start to last end)."""
    if not events:
        raise ValueError("no events to measure")
    stages = {e.stage for e in events}
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (len(stages) * span) if span > 0 else 0.0
