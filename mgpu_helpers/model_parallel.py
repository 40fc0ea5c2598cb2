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
    "saved_activation_bytes",
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
    """Bytes of parameters, gradients, optimizer state and activations on each device (lesson 05).

    Model state comes from tensor sizes: gradients are as large as the parameters and
    ``optimizer_slots`` is the number of state tensors per parameter (1 for SGD with momentum,
    2 for Adam). Activations are what autograd really keeps for backward during one training
    forward of ``sample`` (:func:`saved_activation_bytes`): parameters, buffers and the sample
    itself (already on the device before the step) are not counted, nor the model's output
    and the loss (a few batch x classes tensors). It runs on any device, CPU included. A
    :class:`SplitModel` gets one row per stage ("stage 0 (cuda:0)"), counted as if each stage
    had a device of its own, so stages that share a device (virtual devices) are told apart.
    """
    if isinstance(model, SplitModel):
        return _memory_by_stage(model, optimizer_slots, sample)
    report: dict[str, dict[str, int]] = {}

    def row(device: str) -> dict[str, int]:
        return report.setdefault(
            device, {"parameters": 0, "gradients": 0, "optimizer": 0, "activations": 0}
        )

    for p in model.parameters():
        size = p.numel() * p.element_size()
        r = row(str(p.device))
        r["parameters"] += size
        r["gradients"] += size
        r["optimizer"] += optimizer_slots * size
    if sample is not None:
        for device, size in saved_activation_bytes(model, sample).items():
            row(device)["activations"] += size
    return report


def saved_activation_bytes(model: nn.Module, sample: Tensor) -> dict[str, int]:
    """Bytes of the tensors autograd saves for backward in a forward of ``sample``, per device.

    Lesson 05, section 2. Recorded with ``torch.autograd.graph.saved_tensors_hooks`` during one
    forward with gradients on; each storage is counted once (a ReLU's output that the next
    Linear saves too, a Flatten that is a view of its input), and the storages of parameters,
    buffers and ``sample`` are left out. The model's buffers (BatchNorm's running statistics)
    are restored afterwards, so the call leaves the model as it was.
    """
    return _saved_by_stage([model], [None], sample)[0]


def _storage(t: Tensor) -> tuple[str, int, int]:
    """(device, address, bytes) of the memory ``t`` keeps alive: its whole storage."""
    try:
        storage = t.untyped_storage()
        return str(t.device), storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return str(t.device), id(t), t.numel() * t.element_size()


def _saved_by_stage(
    stages: Sequence[nn.Module], devices: Sequence[torch.device | None], sample: Tensor
) -> list[dict[str, int]]:
    """For each stage run in turn (its input moved to ``devices[i]`` unless None), the bytes
    per device that its forward makes autograd save: deduplicated within a stage, never
    counting a parameter, a buffer or the sample."""
    state = [t for stage in stages for t in (*stage.parameters(), *stage.buffers())]
    x = sample if devices[0] is None else sample.to(devices[0])
    excluded = {_storage(t)[:2] for t in (*state, x)}
    buffers = [(b, b.detach().clone()) for stage in stages for b in stage.buffers()]
    per_stage: list[dict[str, int]] = []
    seen: set[tuple[str, int]] = set()

    def pack(t: Tensor) -> Tensor:
        device, address, size = _storage(t)
        if (device, address) not in excluded and (device, address) not in seen and size:
            seen.add((device, address))
            per_stage[-1][device] = per_stage[-1].get(device, 0) + size
        return t

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for stage, device in zip(stages, devices, strict=True):
                per_stage.append({})
                seen.clear()  # a stage's input counts again: on its own device it is a copy
                x = stage(x if device is None else x.to(device))
    finally:
        with torch.no_grad():
            for b, saved in buffers:  # BatchNorm's running statistics, as they were
                b.copy_(saved)
    return per_stage


def _memory_by_stage(
    model: SplitModel, optimizer_slots: int, sample: Tensor | None
) -> dict[str, dict[str, int]]:
    kinds = ("parameters", "gradients", "optimizer", "activations")
    report = {}
    saved = (
        _saved_by_stage(list(model.stages), model.devices, sample)
        if sample is not None
        else [{} for _ in model.stages]
    )
    for i, (stage, device) in enumerate(zip(model.stages, model.devices, strict=True)):
        rows = memory_by_device(stage, optimizer_slots).values()
        row = {key: sum(r[key] for r in rows) for key in kinds}
        row["activations"] = sum(saved[i].values())
        report[f"stage {i} ({device})"] = row
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
    """Timestamps per device: CUDA events on GPUs, the wall clock on the CPU.

    Each GPU's times count from an origin event recorded on that GPU. The origins are recorded
    one after the other (after synchronising every device), so two GPUs' clocks are offset by
    the few microseconds between those records: comparisons across GPUs (``forward_overlap``,
    a timeline's span) are good to about that much, and a test of overlap between two GPUs
    must ask for a margin (0.1 ms, say), not just a positive number.
    """

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
    finished every forward (the naive split, or a pipeline that serialised). Between two GPUs
    the value carries the offset of their clocks (a few microseconds, see ``_Clock``), so only
    a clear margin says that the stages overlapped.
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
