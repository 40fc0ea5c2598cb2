"""Watching DDP's buckets and their overlap with the backward pass (lesson 06a).

Lesson 06a builds DDP's speed by hand and then watches real DDP do the same. This module holds
the measuring parts, so that the lesson's cells keep the lines it teaches:

- :class:`Clock` stamps moments of one device's timeline: the host clock on a CPU, CUDA events
  on a GPU (the host runs ahead of the kernels there, so its clock would say when work was
  queued, not when it ran);
- :class:`BucketRecorder` is a DDP communication hook that records every bucket DDP hands it
  (its parameters, its bytes, when it was launched and when its all-reduce was done) and then
  calls an ordinary hook to do the work;
- :func:`stamp_gradients` notes when the backward pass finished each parameter's gradient;
- :func:`assert_same_gradients` compares one method's gradients with a reference on every rank;
- :func:`plot_bucketed_backward` draws the schematic, :func:`plot_step_timeline` the measured
  timeline of one step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .timing import Timing, synchronize

__all__ = [
    "BucketRecord",
    "BucketRecorder",
    "Clock",
    "Interval",
    "assert_same_gradients",
    "overlap_seconds",
    "plot_bucketed_backward",
    "plot_step_timeline",
    "layer_pieces",
    "stamp_gradients",
    "time_phases",
]

Stamp = float | torch.cuda.Event
Interval = tuple[str, float, float]  # (label, start, end) in seconds


class Clock:
    """Moments on one device's timeline, read as seconds since :meth:`start` (lesson 06a).

    On a CPU a stamp is the host's ``time.perf_counter()``. On a GPU it is a CUDA event recorded
    on the current stream: it marks when the GPU reaches that point of its queue. Read stamps
    with :meth:`seconds` only after the device has finished them (``torch.cuda.synchronize``).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.origin: Stamp = self.now()

    def now(self) -> Stamp:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        # this device's stream, not the current device's: a callback may run in another thread
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> None:
        """Make this moment time zero."""
        self.origin = self.now()

    def seconds(self, stamp: Stamp) -> float:
        if isinstance(stamp, float):
            return stamp - self.origin  # type: ignore[operator]
        return self.origin.elapsed_time(stamp) / 1e3  # type: ignore[union-attr]


@dataclass
class BucketRecord:
    """One bucket as DDP handed it to the hook in one step."""

    index: int
    params: list[int]  # indices into model.parameters(), in the bucket's order
    nbytes: int
    launched: Stamp
    done: Stamp | None = None


@dataclass
class BucketRecorder:
    """A DDP communication hook that records each bucket, then runs ``inner`` on it (lesson 06a).

    Register it with ``ddp.register_comm_hook(None, recorder.hook)`` before the first step.
    ``model`` is the module DDP wraps: the recorder names parameters by their index in
    ``model.parameters()``. ``inner`` is the hook that does the work (default: DDP's own
    ``allreduce_hook``, which divides by the world size and all-reduces). Call
    :meth:`new_step` before each step; ``steps[k]`` then lists step ``k``'s buckets in the
    order DDP launched them. Each record's ``done`` is stamped in a callback chained on the
    all-reduce's future: on a GPU that callback's stream waits for the all-reduce, so the
    event it records marks the all-reduce's end on the device, with no thread polling.
    """

    model: nn.Module
    device: torch.device | str
    inner: Callable[..., torch.futures.Future] = default_hooks.allreduce_hook
    steps: list[list[BucketRecord]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._index = {id(p): i for i, p in enumerate(self.model.parameters())}
        self.clock = Clock(self.device)

    def new_step(self) -> None:
        """Start recording a new step; its stamps count from now."""
        self.steps.append([])
        self.clock.start()

    def hook(self, state, bucket):  # noqa: ANN001, ANN201 (DDP compares annotations with its classes)
        """The communication hook: ``ddp.register_comm_hook(None, recorder.hook)``."""
        if not self.steps:
            self.new_step()
        buffer = bucket.buffer()
        record = BucketRecord(
            index=bucket.index(),
            params=[self._index[id(p)] for p in bucket.parameters()],
            nbytes=buffer.numel() * buffer.element_size(),
            launched=self.clock.now(),
        )
        self.steps[-1].append(record)

        def finished(fut: torch.futures.Future) -> torch.Tensor:
            record.done = self.clock.now()
            return fut.value()

        return self.inner(state, bucket).then(finished)

    def layout(self, step: int = -1) -> list[list[int]]:
        """The buckets of step ``step`` (default: the last), by bucket index."""
        return [r.params for r in sorted(self.steps[step], key=lambda r: r.index)]

    def intervals(self, step: int = -1) -> list[Interval]:
        """``(f"bucket {i}", launched, done)`` in seconds for each bucket of step ``step``."""
        out = []
        for r in self.steps[step]:
            if r.done is None:
                raise RuntimeError(f"bucket {r.index} has not finished: wait for the step first")
            out.append(
                (f"bucket {r.index}", self.clock.seconds(r.launched), self.clock.seconds(r.done))
            )
        return out


def stamp_gradients(
    model: nn.Module, clock: Clock, stamps: list[tuple[int, Stamp]]
) -> Callable[[], None]:
    """Append ``(parameter index, clock stamp)`` to ``stamps`` each time the backward pass has
    written a parameter's ``.grad`` (lesson 06a). Returns a function that removes the hooks."""
    hooks = [
        p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.append((i, clock.now())))
        for i, p in enumerate(model.parameters())
    ]

    def remove() -> None:
        for hook in hooks:
            hook.remove()

    return remove


def layer_pieces(
    model: nn.Module, stamps: Sequence[tuple[int, Stamp]], clock: Clock, start: Stamp
) -> list[Interval]:
    """The backward pass as pieces, one per module whose gradients were stamped (lesson 06a).

    A piece runs from the previous stamp (or ``start``) to the last stamp of its module's
    parameters; weight and bias of one layer make one piece, named like ``"Linear 2"`` (the
    second module with parameters of that class, counted from the input)."""
    label, seen = {}, {}
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            kind = type(module).__name__
            seen[kind] = seen.get(kind, 0) + 1
            label[id(module)] = f"{kind} {seen[kind]}"
    owner = {id(p): label[id(m)] for m in model.modules() for p in m.parameters(recurse=False)}
    names = [owner[id(p)] for p in model.parameters()]
    pieces: list[Interval] = []
    begin = clock.seconds(start)
    for i, stamp in stamps:
        t = clock.seconds(stamp)
        if pieces and pieces[-1][0] == names[i]:
            pieces[-1] = (names[i], pieces[-1][1], t)
        else:
            pieces.append((names[i], begin, t))
        begin = t
    return pieces


def assert_same_gradients(
    results: Sequence[Mapping[str, Mapping[str, list]]], method: str, reference: str = "ddp"
) -> float:
    """Assert that ``method``'s gradients equal ``reference``'s on every rank; return the largest
    difference (lesson 06a).

    ``results[rank][name]["grads"]`` is the list of one step's gradients (``None`` where a
    parameter got none). Tolerance: with 2 ranks the two are identical to the bit; with more
    they may differ in the last place, since DDP divides before it sums (exact only by a power
    of two) and an all-reduce may add the ranks' values in another order for a flat bucket. So
    a few float32 units in the last place of the gradient's scale, growing with the ranks.
    """
    eps, n, worst = torch.finfo(torch.float32).eps, len(results), 0.0
    for rank, r in enumerate(results):
        pairs = zip(r[method]["grads"], r[reference]["grads"], strict=True)
        for k, (mine, ref) in enumerate(pairs):
            if mine is None or ref is None:
                if mine is not None or ref is not None:
                    raise AssertionError(
                        f"rank {rank}, parameter {k}: {method} gives "
                        f"{'no' if mine is None else 'a'} gradient, {reference} "
                        f"{'none' if ref is None else 'one'}"
                    )
                continue
            scale = ref.abs().max().item()
            torch.testing.assert_close(
                mine,
                ref,
                rtol=4 * n * eps,
                atol=4 * n * eps * scale,
                msg=lambda m, k=k, rank=rank: (
                    f"rank {rank}, parameter {k}, {method} vs {reference}: {m}"
                ),
            )
            worst = max(worst, (mine - ref).abs().max().item())
    return worst


def _merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_seconds(compute: Sequence[Interval], comm: Sequence[Interval]) -> float:
    """Seconds during which at least one all-reduce was in flight while backward computed."""
    busy = _merged([(s, e) for _, s, e in compute])
    flight = _merged([(s, e) for _, s, e in comm])
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in busy for s2, e2 in flight)


def plot_bucketed_backward(n_layers: int = 4, layers_per_bucket: int = 2) -> Figure:
    """The schematic of a bucketed backward pass (lesson 06a): the backward pass computes layers
    from the last to the first; each bucket's all-reduce starts when its last gradient is ready
    and runs while earlier layers compute; only the last bucket's all-reduce is left after the
    backward pass. Drawn from the rule, not measured."""
    if n_layers < 2 or not 1 <= layers_per_bucket < n_layers:
        raise ValueError(
            f"n_layers={n_layers}, layers_per_bucket={layers_per_bucket}: draw at least 2 layers "
            "and fewer layers per bucket than layers, so that there are 2 buckets or more"
        )
    fig = Figure(figsize=(9, 2.6))
    ax = fig.subplots()
    comm_cost = layers_per_bucket * 0.8  # an all-reduce a little shorter than its layers' backward
    buckets = [
        list(range(s, min(s + layers_per_bucket, n_layers)))
        for s in range(0, n_layers, layers_per_bucket)
    ]
    ax.barh(2, 1.0, 0.6, 0, color="C0", alpha=0.5, edgecolor="black")
    ax.text(0.5, 2, "forward", ha="center", va="center", size="small")
    for k in range(n_layers):  # backward: layer n first
        ax.barh(2, 1.0, 0.6, 1 + k, color=f"C{1 + k % 8}", alpha=0.8, edgecolor="black")
        ax.text(1.5 + k, 2, f"grad L{n_layers - k}", ha="center", va="center", size="small")
    free = 0.0
    for b, layers in enumerate(buckets):
        ready = 1 + layers[-1] + 1  # the end of its last layer's backward
        start = max(ready, free)  # buckets go out in order, one after the other
        ax.barh(1, comm_cost, 0.6, start, color="lightgrey", hatch="//", edgecolor="black")
        ax.text(
            start + comm_cost / 2,
            1,
            f"all-reduce b{b}",
            ha="center",
            va="center",
            size="small",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0},
        )
        ax.add_patch(
            FancyArrowPatch((ready, 1.7), (start + 0.05, 1.3), arrowstyle="->", mutation_scale=10)
        )
        free = start + comm_cost
    end = max(free, 1 + n_layers)
    ax.barh(0, 0.5, 0.6, end, color="C9", alpha=0.6, edgecolor="black")
    ax.text(end + 0.25, 0, "step", ha="center", va="center", size="small")
    ax.axvline(1 + n_layers, color="black", linestyle=":")
    ax.text(1 + n_layers, 2.55, "backward ends", ha="center", size="small")
    ax.set_yticks([0, 1, 2], ["optimizer", "communication", "compute"])
    ax.invert_yaxis()
    ax.set_xlim(-0.1, end + 0.7)
    ax.set_ylim(2.8, -0.5)
    ax.set_xticks([])
    ax.set_xlabel("time →  (a bucket = a few layers' gradients in one flat buffer)")
    ax.set_title(
        "DDP's step: each bucket's all-reduce starts inside the backward pass; the last cannot"
    )
    fig.tight_layout()
    return fig


def plot_step_timeline(
    phases: Sequence[Interval],
    comm: Sequence[Interval],
    title: str = "",
    *,
    bound: float | None = None,
) -> Figure:
    """One measured step on one rank (lesson 06a): compute pieces on the top row, each bucket's
    all-reduce on a row of its own, from launch to done. Times in seconds, drawn in ms from the
    earliest. ``bound``: the step's lower bound with perfect overlap (forward + max(backward,
    all-reduce) + optimizer, from separate measurements), drawn as a dashed line."""
    if not phases or not comm:
        raise ValueError("need both the compute pieces and the buckets' all-reduces to draw")
    for label, start, end in (*phases, *comm):
        if end < start:
            raise ValueError(f"{label!r} ends ({end}) before it starts ({start})")
    t0 = min(s for _, s, _ in (*phases, *comm))
    span = (max(e for _, _, e in (*phases, *comm)) - t0) * 1e3
    if bound is not None:
        span = max(span, bound * 1e3)
    fig = Figure(figsize=(10, 1.6 + 0.45 * (1 + len(comm))))
    ax = fig.subplots()
    for k, (label, start, end) in enumerate(phases):
        left, width = (start - t0) * 1e3, (end - start) * 1e3
        ax.barh(0, width, 0.7, left, color=f"C{k % 10}", alpha=0.8, edgecolor="black",
                linewidth=0.5, label=label)  # fmt: skip
    pad = span * 0.01  # the duration labels start clear of any line at the bar's end
    for row, (_label, start, end) in enumerate(comm, 1):
        left, width = (start - t0) * 1e3, (end - start) * 1e3
        ax.barh(
            row, width, 0.7, left, color="lightgrey", hatch="//", edgecolor="black", linewidth=0.5
        )
        text = f"{width:.1f} ms" if width >= 0.05 else "< 0.1 ms"
        ax.text(left + width + pad, row, text, va="center", size="small",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})  # fmt: skip
    ax.set_yticks(range(1 + len(comm)), ["compute", *(label for label, _, _ in comm)])
    if bound is not None:
        ax.axvline(bound * 1e3, color="C3", linestyle="--", label="bound with perfect overlap")
    # beside the axes: every compute piece named, however narrow, and nothing drawn over a bar
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.invert_yaxis()
    ax.set_xlim(0, span * 1.15 or 1)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def time_phases(
    phases: Mapping[str, Callable[[], object]], device: torch.device | str, *, repeats: int = 5
) -> dict[str, Timing]:
    """Time the phases of one step separately (lesson 06a): each repeat calls every phase in
    order, stamping a :class:`Clock` between them; one untimed repeat warms up first. Returns
    one :class:`~mgpu_helpers.timing.Timing` per phase. The phases run back to back, as in a
    real step, so no phase is timed from a cold start."""
    if repeats < 1 or not phases:
        raise ValueError(f"need phases and repeats >= 1, got {len(phases)} phase(s) and {repeats}")
    clock, stamps = Clock(device), []
    for _ in range(repeats + 1):
        row = [clock.now()]
        for fn in phases.values():
            fn()
            row.append(clock.now())
        stamps.append(row)
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in phases}
    for row in stamps[1:]:
        for name, start, end in zip(phases, row, row[1:], strict=False):
            times[name].append(clock.seconds(end) - clock.seconds(start))
    return {name: Timing(tuple(t)) for name, t in times.items()}
