"""Measuring and planning model parallelism (lesson 05; the benchmark and lesson 09b reuse it).

Lesson 05a writes the split model and the GPipe step in its cells, 05b the 1F1B step; this
module keeps what is around them: a thread per stage, timelines, idle and busy shares, where to
cut. Lesson 09b's pipeline across processes is watched by :class:`StageProbe` and judged by
:func:`unequal_idle` and :func:`bubble_verdict`. Memory per device and per stage is counted
in :mod:`mgpu_helpers.memory`, which lesson 08a shares.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .timing import Comparison, measure, synchronize

__all__ = [
    "Event",
    "StageProbe",
    "Timeline",
    "as_events",
    "balance",
    "best_pipeline_line",
    "bubble_verdict",
    "bubble_fraction",
    "busy_shares",
    "forward_overlap",
    "idle_fraction",
    "layer_costs",
    "run_stages",
    "two_thread_speedup",
    "two_thread_verdict",
    "unequal_idle",
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
    costs, x = [], sample
    for layer in model:
        inp = x.detach().requires_grad_(x.is_floating_point())

        def run(layer: nn.Module = layer, inp: Tensor = inp) -> None:
            out = layer(inp)
            if out.requires_grad:
                out.sum().backward()

        costs.append(measure(run, sample.device, warmup=1, repeats=repeats).median)
        with torch.no_grad():
            x = layer(x)
    model.zero_grad(set_to_none=True)
    return costs


def balance(costs: Sequence[float], n_stages: int) -> list[int]:
    """Cut points that minimise the most expensive stage (contiguous stages, exact search)."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"n_stages must be between 1 and the {n} layers, got {n_stages}")
    prefix = [0.0, *itertools.accumulate(costs)]  # prefix[i]: cost of the first i layers

    @functools.cache
    def best(k: int, i: int) -> tuple[float, tuple[int, ...]]:
        """The smallest maximum stage cost of the first i layers in k stages, and its cuts."""
        if k == 1:
            return prefix[i], ()
        options = [  # the last stage is layers j..i-1; min keeps the first (smallest j) tie
            (max(best(k - 1, j)[0], prefix[i] - prefix[j]), (*best(k - 1, j)[1], j))
            for j in range(k - 1, i)
        ]
        return min(options, key=lambda option: option[0])

    return list(best(n_stages, n)[1])


@dataclass(frozen=True)
class Event:
    """One piece of work in a pipeline timeline: stage, micro-batch, forward or backward."""

    stage: int
    micro: int
    kind: str  # "F" (forward) or "B" (backward)
    start: float  # seconds since the step started
    end: float
    cpu: float | None = None  # on the CPU: seconds its thread computed (waits for a core excluded)


class Timeline:
    """When each stage's work started and ended in one step (lessons 05a and 05b's pipeline steps).

    CUDA events on GPUs, the wall clock on the CPU. Each GPU counts from an origin event of its
    own, recorded one after the other, so times compared across GPUs (:func:`forward_overlap`)
    are off by a few microseconds: a test of overlap must ask for a margin (0.1 ms, say). On the
    CPU each event also gets the CPU time its thread used (``Event.cpu``): on shared cores a
    piece of work can last long on the wall clock while its thread waits for a core.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(dict.fromkeys(torch.device(d) for d in devices))
        for d in self.devices:
            synchronize(d)
        self._t0 = time.perf_counter()
        self._origins = {d: self.mark(d) for d in self.devices if d.type == "cuda"}
        self._marks: list[tuple[int, int, str, torch.device, object, object]] = []

    def mark(self, device: torch.device) -> object:
        """A time stamp on ``device``: an event on the current stream of a GPU, or seconds.

        On the CPU: (wall seconds since the start, this thread's CPU seconds).
        """
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter() - self._t0, time.thread_time()

    def add(self, stage: int, micro: int, kind: str, device: torch.device, begin: object) -> None:
        """Record that ``stage`` ran ``kind`` ("F" or "B") of ``micro`` from ``begin`` to now."""
        end = self.mark(device)
        self._marks.append((stage, micro, kind, device, begin, end))  # list.append is atomic

    def events(self) -> list[Event]:
        """The recorded work in seconds since the start, sorted by stage and start time."""
        for d in self.devices:
            synchronize(d)  # every CUDA event has happened
        events = [
            Event(stage, micro, kind, self._seconds(dev, a), self._seconds(dev, b), _cpu(a, b))
            for stage, micro, kind, dev, a, b in self._marks
        ]
        return sorted(events, key=lambda e: (e.stage, e.start))

    def _seconds(self, device: torch.device, mark: object) -> float:
        if device.type == "cuda":
            return self._origins[device].elapsed_time(mark) / 1e3  # type: ignore[attr-defined]
        return float(mark[0])  # type: ignore[index]


def _cpu(begin: object, end: object) -> float | None:
    """CPU seconds between two CPU marks of one thread; None between GPU events."""
    if isinstance(begin, tuple) and isinstance(end, tuple):
        return end[1] - begin[1]
    return None


def run_stages(
    run_stage: Callable[[int], None],
    n_stages: int,
    queues: Sequence[queue.Queue],
    *,
    timeout: float = 600.0,
) -> None:
    """Run ``run_stage(s)`` for each stage in a thread of its own and wait for all (lesson 05).

    If a stage raises, every queue in ``queues`` gets a ``None``, so that stages waiting there
    fail to unpack it instead of waiting for ever, and the first error is raised here. A stage
    still running after ``timeout`` seconds is a RuntimeError naming it, not an endless wait.
    """
    errors: list[BaseException] = []

    def run(s: int) -> None:
        try:
            run_stage(s)
        except BaseException as exc:  # raised again below
            errors.append(exc)
            for q in queues:
                q.put(None)

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in range(n_stages)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if stuck := [s for s, t in enumerate(threads) if t.is_alive()]:
        for q in queues:  # wake the waiting stages: they fail, and their threads end
            q.put(None)
        raise RuntimeError(
            f"stage(s) {stuck} still ran after {timeout:g} s: a stage waits for a message that "
            "no other stage sends (each forward must send its activation on, each backward its "
            "gradient back), or the machine is far too busy; check run_stage's sends and receives"
        )


def forward_overlap(events: Sequence[Event], stage: int = 0) -> float:
    """Seconds by which stage ``stage + 1``'s first forward starts before ``stage``'s last ends.

    Lesson 05a: positive when the stages ran forwards at the same time (a pipeline); between
    GPUs only a clear margin counts (see :class:`Timeline`).
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
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (len({e.stage for e in events}) * span) if span > 0 else 0.0


def busy_shares(events: Sequence[Event]) -> list[float]:
    """Each stage's busy time / the step's span, stage by stage (lesson 05b).

    The idle share averages the stages; this tells a loaded stage from an idle one (a bad cut).
    Busy time is the CPU time of the stage's thread where the events have it (``Event.cpu``):
    on cores shared with other work, waiting for a core is not being busy. Otherwise (GPUs, or
    hand-made events) it is each event's length.
    """
    if not events:
        raise ValueError("no events to measure")
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = [0.0] * (max(e.stage for e in events) + 1)
    for e in events:
        busy[e.stage] += e.end - e.start if e.cpu is None else e.cpu
    return [b / span if span > 0 else 1.0 for b in busy]


def two_thread_speedup(repeats: int = 3, size: int = 512) -> float:
    """Time of two batches of matrix products one after the other / both at once (lesson 05a).

    About 2 with two free cores, about 1 when the threads must take turns: whether two stage
    threads on the CPU can work at the same time on this machine now. Uses the calling
    thread's torch thread count (lesson 05a sets one per stage).
    """
    w = torch.randn(size, size)

    def work() -> None:
        for _ in range(10):
            w @ w

    def both() -> None:
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    sequential = measure(lambda: (work(), work()), "cpu", warmup=1, repeats=repeats).median
    return sequential / measure(both, "cpu", warmup=1, repeats=repeats).median


def two_thread_verdict(speedup: float) -> str:
    """:func:`two_thread_speedup`'s ratio and what it means, in two lines (lessons 05a, 05b).

    1.5x or more counts as two free cores (05b then expects the stages to overlap); from 0.9x
    the threads often take turns; below that, running them together costs extra time.
    """
    if not speedup > 0 or speedup == float("inf"):
        raise ValueError(f"speedup={speedup!r}: pass two_thread_speedup's ratio, a positive number")
    if speedup >= 1.5:
        meaning = "about 2x: two free cores, so two stage threads can compute at the same time"
    elif speedup >= 0.9:
        meaning = "under 1.5x: the threads often take turns, as other work keeps the cores busy"
    else:
        meaning = "below 1x: the machine is so busy that running two threads together costs extra"
    ratio = f"two threads at once: {speedup:.2f}x one after the other (2.00x = two free cores)"
    return f"{ratio}\n{meaning}"


def best_pipeline_line(micro: int, speedup: float, ideal: float, verdict: Comparison) -> str:
    """A line naming the micro-batch sweep's best pipeline, or saying none stands out (05b).

    ``speedup`` and ``ideal``: the fastest pipeline's speed and its ideal, both over the unsplit
    model's; ``verdict``: its rounds against the naive split's. At or above its ideal (which the
    hand-overs rule out), or with no verdict against the naive split, it is within the noise.
    """
    measured = f"M={micro}, {speedup:.2f}x the unsplit model (ideal {ideal:.2f}x)"
    if speedup < ideal and verdict.meaningful:
        return f"best pipeline: {measured}"
    why = (
        "at or above its ideal, which the hand-overs rule out"
        if speedup >= ideal
        else "no verdict against the naive split"
    )
    return f"fastest pipeline: {measured};\n{why}: the difference is within the noise, no best M"


class _Saved:
    """What :class:`StageProbe`'s pack hook hands autograd: its lifetime is the saved slot's."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class StageProbe:
    """Times one pipeline stage's forwards and backwards and counts the activations it saves
    (lesson 09b).

    ``stage`` is a ``torch.distributed.pipelining.PipelineStage`` (or anything with its
    ``forward_one_chunk(i, ...)``, ``backward_one_chunk(i, ...)``, ``submod`` and ``device``).
    The two methods are public but undocumented: the probe wraps them on this one object and
    passes every argument through, so a renamed method stops it with an AttributeError.

    - ``events``: ``(kind, micro-batch, start s, end s)`` per call, on ``time.perf_counter``'s
      clock (shared by a machine's processes); on a GPU after a synchronize, so the work ran.
    - while ``counting`` is true, each forward runs under ``saved_tensors_hooks``: the pack hook
      wraps every saved tensor that is not a parameter (or a view of one) in a holder, and
      ``weakref.finalize`` reports when autograd drops it (after the backward used it). So
      ``peak_micro`` is the most micro-batches whose saved activations were alive at once,
      ``peak_bytes`` their most bytes, ``micro_bytes[i]`` micro-batch i's bytes after its
      forward. A tensor saved twice counts once.
    """

    def __init__(self, stage: object) -> None:
        self.device = torch.device(stage.device)
        self.params = {p.untyped_storage().data_ptr() for p in stage.submod.parameters()}
        self.events: list[tuple[str, int, float, float]] = []
        self.counting = False
        self.live: dict[int, int] = {}  # micro-batch -> bytes of its saved activations alive
        self.holders: dict[tuple[int, int, int], int] = {}  # (micro, address, numel) -> alive
        self.peak_micro, self.peak_bytes = 0, 0
        self.micro_bytes: dict[int, int] = {}
        self._micro = 0
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        stage.forward_one_chunk = lambda i, *a, **k: self._timed("F", i, forward, i, *a, **k)
        stage.backward_one_chunk = lambda i, *a, **k: self._timed("B", i, backward, i, *a, **k)

    def _timed(
        self, kind: str, micro: int, fn: Callable, *args: object, **kwargs: object
    ) -> object:
        synchronize(self.device)  # the clock reads when the work has run, not when it was queued
        start = time.perf_counter()
        if kind == "F" and self.counting:
            self._micro = micro
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = fn(*args, **kwargs)
            self.micro_bytes[micro] = self.live.get(micro, 0)
        else:
            out = fn(*args, **kwargs)
        synchronize(self.device)
        self.events.append((kind, micro, start, time.perf_counter()))
        return out

    def _pack(self, t: Tensor) -> object:
        if t.untyped_storage().data_ptr() in self.params:
            return t  # a parameter or a view of one: not an activation
        key, nbytes = (self._micro, t.data_ptr(), t.numel()), t.numel() * t.element_size()
        holder = _Saved(t)
        self.holders[key] = self.holders.get(key, 0) + 1
        if (
            self.holders[key] == 1
        ):  # a tensor saved twice (a view, or by two operations) counts once
            self.live[self._micro] = self.live.get(self._micro, 0) + nbytes
        weakref.finalize(holder, self._release, key, nbytes)
        self.peak_micro = max(self.peak_micro, sum(b > 0 for b in self.live.values()))
        self.peak_bytes = max(self.peak_bytes, sum(self.live.values()))
        return holder

    @staticmethod
    def _unpack(saved: object) -> Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved  # a parameter: itself

    def _release(self, key: tuple[int, int, int], nbytes: int) -> None:
        self.holders[key] -= 1
        if self.holders[key] == 0:  # autograd dropped the last holder: the backward used it
            del self.holders[key]
            self.live[key[0]] -= nbytes


def as_events(timelines: Sequence[Sequence[tuple[str, int, float, float]]]) -> list[Event]:
    """Each rank's ``StageProbe.events`` as one list of :class:`Event`, stage = rank (09b)."""
    return [
        Event(rank, micro, kind, start, end)
        for rank, timeline in enumerate(timelines)
        for kind, micro, start, end in timeline
    ]


def unequal_idle(forward: Sequence[float], backward: Sequence[float], n_micro: int) -> float:
    """Idle share of GPipe's order when stage s takes ``forward[s]`` and ``backward[s]`` per
    micro-batch and messages take no time (lesson 09b; lesson 05b's prediction per micro-batch).

    Each phase takes the sum over the stages for the first micro-batch, then the slowest
    stage's time for each further one. With equal stages it is (S - 1) / (M + S - 1).
    """
    if len(forward) != len(backward) or not forward or n_micro < 1:
        raise ValueError("pass one forward and one backward time per stage, and n_micro >= 1")
    span = (
        sum(forward) + (n_micro - 1) * max(forward) + sum(backward) + (n_micro - 1) * max(backward)
    )
    return 1 - n_micro * (sum(forward) + sum(backward)) / (len(forward) * span)


def bubble_verdict(
    name: str,
    idle: float,
    spread: float,
    model: float,
    unequal: float,
    quick: bool,
    timed_steps: int,
) -> list[str]:
    """What a measured idle share says about the formula's, in words (lesson 09b).

    ``idle``: the median step's idle share; ``spread``: how far it moved over the timed steps;
    ``model``: (S - 1) / (M + S - 1); ``unequal``: :func:`unequal_idle`. A spread larger than
    the gap to the formula gives no verdict: noise dominates.
    """
    gap = idle - model

    def pts(share: float) -> str:  # a difference of two shares, in percentage points
        return f"{100 * share:+.0f} points"

    if spread >= max(abs(gap), 0.05):
        return [
            f"{name:>5}: no verdict: the idle share moved by {100 * spread:.0f} points over "
            f"{timed_steps} timed steps,",
            f"       against {pts(gap)} from the formula: noise dominates",
        ]
    if quick and spread > 0.1:
        return [
            f"{name:>5}: quick mode, no verdict: {pts(gap)} from the formula, but "
            f"{timed_steps} timed steps moving by {100 * spread:.0f} points"
        ]
    if abs(gap) <= 0.1:
        return [
            f"{name:>5}: measured {idle:.0%} against {model:.0%}: within 10 points of the formula"
        ]
    return [
        f"{name:>5}: measured {idle:.0%}, {pts(gap)} against the formula's {model:.0%}; "
        f"unequal stages explain {pts(unequal - model)},",
        f"       messages, the loss and waits for a core the other {pts(idle - unequal)}",
    ]
