"""Measuring and planning model parallelism (lesson 05; the benchmark and lesson 09 reuse it).

Lesson 05 writes the split model and the GPipe step in its own cells; this module keeps the
tools around them that several users need:

- running the stages: :func:`run_stages` starts one thread per stage and brings a stage's
  error back to the caller;
- a pipeline's timeline: :class:`Timeline` marks when each stage's work starts and ends (CUDA
  events on GPUs, the wall clock on the CPU) and gives :class:`Event` records, which
  :func:`idle_fraction`, :func:`forward_overlap` and ``plots.plot_timeline`` read;
  :func:`bubble_fraction` is the ideal idle share;
- where to cut: :func:`layer_costs` (parameters or measured time per layer) and
  :func:`balance` (the cut points that make the most expensive stage as cheap as possible);
- memory: :func:`memory_by_device` and :func:`memory_by_stage` count parameters, gradients,
  optimizer state and the activations autograd saves (:func:`saved_activation_bytes`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .timing import measure, synchronize

__all__ = [
    "Event",
    "Timeline",
    "balance",
    "bubble_fraction",
    "forward_overlap",
    "idle_fraction",
    "layer_costs",
    "memory_by_device",
    "memory_by_stage",
    "run_stages",
    "saved_activation_bytes",
]


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


_KINDS = ("parameters", "gradients", "optimizer", "activations")


def _state_bytes(module: nn.Module, optimizer_slots: int) -> dict[str, dict[str, int]]:
    """Parameters, gradients and optimizer state of ``module``, in bytes, per device."""
    report: dict[str, dict[str, int]] = {}
    for p in module.parameters():
        size = p.numel() * p.element_size()
        row = report.setdefault(str(p.device), dict.fromkeys(_KINDS, 0))
        row["parameters"] += size
        row["gradients"] += size
        row["optimizer"] += optimizer_slots * size
    return report


def memory_by_device(
    model: nn.Module, optimizer_slots: int = 1, sample: Tensor | None = None
) -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients, optimizer state and activations on each device (lesson 05).

    Model state comes from tensor sizes: gradients are as large as the parameters and
    ``optimizer_slots`` is the number of state tensors per parameter (1 for SGD with momentum,
    2 for Adam). Activations are what autograd really keeps for backward during one training
    forward of ``sample`` (:func:`saved_activation_bytes`): parameters, buffers and the sample
    itself (already on the device before the step) are not counted, nor the model's output
    and the loss (a few batch x classes tensors). It runs on any device, CPU included. For a
    model cut into stages, :func:`memory_by_stage` gives one row per stage.
    """
    report = _state_bytes(model, optimizer_slots)
    if sample is not None:
        for device, size in saved_activation_bytes(model, sample).items():
            report.setdefault(device, dict.fromkeys(_KINDS, 0))["activations"] += size
    return report


def memory_by_stage(
    stages: Sequence[nn.Module],
    devices: Sequence[torch.device | str],
    optimizer_slots: int = 1,
    sample: Tensor | None = None,
) -> list[dict[str, int]]:
    """One :func:`memory_by_device` row per stage of a split model (lesson 05, section 2.1).

    The stages run in turn, stage i's input moved to ``devices[i]``, and each is counted as if
    it had a device of its own, so stages that share a device (virtual devices) are told apart:
    a stage that starts with a layer saving its input (a Linear) counts its own copy of the
    activation that crossed the cut.
    """
    if len(stages) != len(devices) or not stages:
        raise ValueError(f"need one device per stage, got {len(stages)} and {len(devices)}")
    if sample is None:
        saved = [{} for _ in stages]
    else:
        saved = _saved_by_stage(stages, [torch.device(d) for d in devices], sample)
    rows = []
    for stage, activations in zip(stages, saved, strict=True):
        state = _state_bytes(stage, optimizer_slots).values()
        row = {key: sum(r[key] for r in state) for key in _KINDS}
        row["activations"] = sum(activations.values())
        rows.append(row)
    return rows


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


@dataclass(frozen=True)
class Event:
    """One piece of work in a pipeline timeline: stage, micro-batch, forward or backward."""

    stage: int
    micro: int
    kind: str  # "F" (forward) or "B" (backward)
    start: float  # seconds since the step started
    end: float


class Timeline:
    """When each stage's work started and ended in one step: CUDA events on GPUs, the wall
    clock on the CPU (lesson 05's ``gpipe_step`` and ``benchmarks/pipeline.py`` record it).

    ``mark(device)`` takes a time stamp from the calling thread's current stream on a GPU;
    ``add(stage, micro, kind, device, begin)`` records a piece of work from ``begin`` until
    now; :meth:`events` turns the marks into seconds, once the devices are synchronised. Each
    GPU's times count from an origin event recorded on that GPU. The origins are recorded one
    after the other (after synchronising every device), so two GPUs' clocks are offset by the
    few microseconds between those records: comparisons across GPUs (:func:`forward_overlap`,
    a timeline's span) are good to about that much, and a test of overlap between two GPUs
    must ask for a margin (0.1 ms, say), not just a positive number.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(dict.fromkeys(torch.device(d) for d in devices))
        for d in self.devices:
            synchronize(d)
        self._t0 = time.perf_counter()
        self._origins = {d: self.mark(d) for d in self.devices if d.type == "cuda"}
        self._marks: list[tuple[int, int, str, torch.device, object, object]] = []

    def mark(self, device: torch.device) -> object:
        """A time stamp on ``device``: an event on the current stream of a GPU, or seconds."""
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter() - self._t0

    def add(self, stage: int, micro: int, kind: str, device: torch.device, begin: object) -> None:
        """Record that ``stage`` ran ``kind`` ("F" or "B") of ``micro`` from ``begin`` to now."""
        end = self.mark(device)
        self._marks.append((stage, micro, kind, device, begin, end))  # list.append is atomic

    def events(self) -> list[Event]:
        """The recorded work in seconds since the start, sorted by stage and start time."""
        for d in self.devices:
            synchronize(d)  # every CUDA event has happened
        events = [
            Event(stage, micro, kind, self._seconds(dev, a), self._seconds(dev, b))
            for stage, micro, kind, dev, a, b in self._marks
        ]
        return sorted(events, key=lambda e: (e.stage, e.start))

    def _seconds(self, device: torch.device, mark: object) -> float:
        if device.type == "cuda":
            return self._origins[device].elapsed_time(mark) / 1e3  # type: ignore[attr-defined]
        return float(mark)  # type: ignore[arg-type]


def run_stages(
    run_stage: Callable[[int], None], n_stages: int, queues: Sequence[queue.Queue]
) -> None:
    """Run ``run_stage(s)`` for each stage in a thread of its own and wait for all (lesson 05).

    The threads are what lets stages work at the same time; what they do is the caller's. If
    a stage raises, every queue in ``queues`` gets a ``None``: the stages waiting there for
    their next input fail to unpack it and stop instead of waiting for ever, and the first
    error is raised again here, in the caller's thread.
    """
    errors: list[BaseException] = []

    def run_or_stop(s: int) -> None:
        try:
            run_stage(s)
        except BaseException as exc:  # raised again below
            errors.append(exc)
            for q in queues:
                q.put(None)

    threads = [
        threading.Thread(target=run_or_stop, args=(s,), daemon=True) for s in range(n_stages)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def forward_overlap(events: Sequence[Event], stage: int = 0) -> float:
    """Seconds by which stage ``stage + 1``'s first forward starts before ``stage``'s last ends.

    Lesson 05: positive when the two stages ran forwards of different micro-batches at the same
    time (a pipeline), zero or negative when the next stage started only once this one had
    finished every forward (the naive split, or a pipeline that serialised). Between two GPUs
    the value carries the offset of their clocks (a few microseconds, see :class:`Timeline`),
    so only a clear margin says that the stages overlapped.
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
