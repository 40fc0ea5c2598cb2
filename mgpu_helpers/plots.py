"""Plots the lessons show (lesson 02 onwards). Each function returns a matplotlib Figure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from .data_parallel import shard_sizes
from .model_parallel import Event, bubble_fraction
from .train import History

__all__ = [
    "plot_activation_peaks",
    "plot_batch_split",
    "plot_history",
    "plot_ideal_schedule",
    "plot_lm_losses",
    "plot_memory",
    "plot_micro_batch_sweep",
    "plot_throughput",
    "plot_timeline",
]


_COINCIDE = 0.005  # curves closer than this share of the axis' span are drawn as coinciding
_EDGE = {"edgecolor": "black", "linewidth": 0.5}  # bars of timelines and memory
_CENTRE = {"ha": "center", "va": "center"}  # text in the middle of a bar
_BESIDE = {"loc": "upper left", "bbox_to_anchor": (1.0, 1.0), "fontsize": "small"}  # a legend


def _coincide(a: History, b: History, key: str, tolerance: float) -> bool:
    """Same epochs and every point of field ``key`` within ``tolerance`` (NaN matches NaN)."""
    return a.epoch == b.epoch and all(
        abs(x - y) <= tolerance or (math.isnan(x) and math.isnan(y))
        for x, y in zip(getattr(a, key), getattr(b, key), strict=True)
    )


def _count(n: int, noun: str) -> str:
    """``3 devices``, ``1 device``, ``2 micro-batches``: a number with its noun."""
    plural = noun + ("es" if noun.endswith("ch") else "s")
    return f"{n} {noun if n == 1 else plural}"


def plot_history(runs: History | Mapping[str, History], title: str = "") -> Figure:
    """Loss and accuracy per epoch, one colour per run (train solid, test dashed); lesson 02 on.

    A single ``History`` draws curves named "train" and "test"; a mapping names each run by its
    key. A curve within 0.5% of the axis of an earlier run's (one device and ``nn.DataParallel``
    in lesson 03) is drawn thin with x/+ markers over the earlier one, drawn thick and pale, and
    the legend and the title say so, so that no run seems to be missing.
    """
    if isinstance(runs, History):
        runs = {"": runs}
    items = list(runs.items())
    fig = Figure(figsize=(10, 4.2), layout="constrained")  # leaves room for the legend below
    ax_loss, ax_acc = fig.subplots(1, 2)
    losses = [v for _, h in items for v in (*h.train_loss, *h.test_loss) if not math.isnan(v)]
    loss_span = (max(losses) - min(losses)) if losses else 0.0
    tolerance = {ax_loss: _COINCIDE * (loss_span or 1.0), ax_acc: _COINCIDE * 1.02}
    curves = [  # (History field, axes, line style, marker)
        ("train_loss", ax_loss, "-", "o"),
        ("test_loss", ax_loss, "--", "s"),
        ("train_acc", ax_acc, "-", "o"),
        ("test_acc", ax_acc, "--", "s"),
    ]
    twin: dict[tuple[int, str], int] = {}  # (run, curve) -> the earlier run it lies on
    for i, (_, h) in enumerate(items):
        for key, ax, *_ in curves:
            for j, (_, earlier) in enumerate(items[:i]):
                if _coincide(h, earlier, key, tolerance[ax]):
                    twin[(i, key)] = j
                    break
    under = {(j, key) for (_, key), j in twin.items()}
    for i, (run, h) in enumerate(items):
        for key, ax, style, marker in curves:
            kind = key.split("_")[0]  # train or test
            label = f"{run} {kind}" if run else kind
            look: dict = {"marker": marker}
            if (i, key) in twin:  # thin, on top of the curve it coincides with
                look = dict(marker="x" if kind == "train" else "+", markersize=8, linewidth=1.2)
                look["zorder"] = 3
                label += f" (drawn over {items[twin[(i, key)]][0]})"
            elif (i, key) in under:  # thick and pale, so the curve on top stays visible
                look |= {"markersize": 9, "linewidth": 4.5, "alpha": 0.4}
            ax.plot(h.epoch, getattr(h, key), style, color=f"C{i % 10}", label=label, **look)
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1.02))
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # no epoch 1.5
        ax.grid(alpha=0.3)
    # One legend serves both panels. Inside a panel it would sit on some curve (test curves
    # cross the train ones); below them it covers nothing. One column per run: train over test.
    columns = 2 if len(items) == 1 else min(len(items), 3)
    handles, labels = ax_loss.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize="small")
    if twin:
        shared: dict[tuple[int, int], list[str]] = {}
        for (i, key), j in twin.items():
            shared.setdefault((i, j), []).append(key.replace("_", " ").replace("acc", "accuracy"))
        note = "; ".join(
            f"{items[i][0]} coincides with {items[j][0]}"
            + ("" if len(keys) == len(curves) else f" in {', '.join(keys)}")
            for (i, j), keys in sorted(shared.items())
        )
        note += " (thin lines with x/+ markers drawn over thick pale ones)"
        fig.suptitle(f"{title}\n{note}" if title else note, fontsize="medium")
    elif title:
        fig.suptitle(title)
    return fig


def plot_throughput(
    samples_per_sec: Mapping[str, float],
    ideal: Mapping[str, float] | None = None,
    title: str = "training throughput",
    *,
    ranges: Mapping[str, tuple[float, float]] | None = None,
) -> Figure:
    """Bars of samples per second per method, with the ideal (e.g. linear scaling) as markers.

    ``ranges`` adds a whisker from the slowest to the fastest repeat of a method (lesson 03),
    so a gap between two bars can be read against the noise of the measurement.
    """
    labels = list(samples_per_sec)
    values = list(samples_per_sec.values())
    legend_room = 1.8 if ideal or ranges else 0.0  # inches for the legend beside the axes
    fig = Figure(figsize=(max(4.0, 1.4 * len(labels) + 2) + legend_room, 3.6))
    ax = fig.subplots()
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
    # With whiskers, the numbers go inside the bars, where no whisker can cover them.
    where = {"label_type": "center", "color": "white"} if ranges else {}
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize="small", **where)
    tops = [*values, *(ideal or {}).values()]
    if ranges:
        xs = [i for i, k in enumerate(labels) if k in ranges]
        low, high = [ranges[labels[i]][0] for i in xs], [ranges[labels[i]][1] for i in xs]
        for i, lo, hi in zip(xs, low, high, strict=True):
            if not lo <= values[i] <= hi:
                raise ValueError(f"range {lo}..{hi} of {labels[i]!r} does not hold its bar's value")
        y = [values[i] for i in xs]
        below = [v - lo for v, lo in zip(y, low, strict=True)]
        above = [hi - v for v, hi in zip(y, high, strict=True)]
        ax.errorbar(
            xs,
            y,
            [below, above],
            fmt="none",
            ecolor="black",
            capsize=6,
            label="slowest to fastest repeat",
        )
        tops += high
    handles, names = ax.get_legend_handles_labels()  # the whisker, when there is one
    if ideal:
        xs = [i for i, k in enumerate(labels) if k in ideal]
        y = [ideal[labels[i]] for i in xs]
        # s=900: a mark about as wide as a bar
        ax.scatter(xs, y, s=900, marker="_", linewidths=2, color="black", zorder=3)
        # the bar-wide mark would overrun its label: the legend shows a short line
        handles.append(Line2D([], [], color="black", linewidth=2))
        names.append("ideal")
    if handles:  # beside the axes, so that it covers no bar, whisker or mark
        ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    ax.set_ylim(0, 1.12 * max(tops))  # headroom for the value labels above the bars
    ax.set(ylabel="samples / s", title=title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_batch_split(batch_size: int, n_devices: int) -> Figure:
    """One bar per device showing which samples of the batch it gets (lesson 03).

    Uses the same rule as ``nn.DataParallel`` (``torch.chunk``): uneven batches give a smaller
    last shard, and some devices may get nothing at all.
    """
    shards = shard_sizes(batch_size, n_devices)
    fig = Figure(figsize=(8, max(2.2, 0.9 + 0.45 * n_devices)))  # room for one row and labels
    ax = fig.subplots()
    start = 0
    for d in range(n_devices):
        if d < len(shards):
            n = shards[d]
            ax.barh(d, n, left=start, color=f"C{d % 10}", edgecolor="black")
            ax.text(start + n / 2, d, f"{n}", **_CENTRE, color="white", fontweight="bold")
            start += n
        else:
            ax.text(0.5, d, "idle: no samples", va="center", color="gray")
    ax.set_yticks(range(n_devices), [f"device {d}" for d in range(n_devices)])
    ax.set_ylim(n_devices - 0.5, -0.5)  # device 0 on top, and room for an idle last row
    ax.set_xlim(0, batch_size)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # samples are whole
    ax.set_xlabel("sample index in the batch")
    idle = f", {n_devices - len(shards)} idle" if len(shards) < n_devices else ""
    ax.set_title(f"batch of {batch_size} on {_count(n_devices, 'device')}: shards {shards}{idle}")
    fig.tight_layout()
    return fig


def plot_timeline(events: Sequence[Event], title: str = "", *, time_unit: str = "ms") -> Figure:
    """A pipeline timeline (lessons 05a, 05b): one row per stage, one bar per forward or backward.

    Bars are coloured by micro-batch; backwards are hatched; gaps are a stage's idle time.
    ``events`` come from a measured step (seconds, shown in ``time_unit`` "ms" or "s") or from
    an ideal schedule in time slots (``time_unit="slots"``).
    """
    if not events:
        raise ValueError("no events to draw; pass the timeline that a pipelined step returned")
    scale = {"ms": 1e3, "s": 1.0, "slots": 1.0}.get(time_unit)
    if scale is None:
        raise ValueError(f"time_unit={time_unit!r} is unknown; choose 'ms', 's' or 'slots'")
    n_stages = max(e.stage for e in events) + 1
    n_micro = max(e.micro for e in events) + 1
    t0 = min(e.start for e in events)
    span = (max(e.end for e in events) - t0) * scale
    fig = Figure(figsize=(10, 0.9 + 0.55 * n_stages))
    ax = fig.subplots()
    colours = matplotlib.colormaps["tab10" if n_micro <= 10 else "tab20"]
    for e in events:
        left, width = (e.start - t0) * scale, (e.end - e.start) * scale
        hatch = "//" if e.kind == "B" else None
        ax.barh(e.stage, width, 0.7, left, color=colours(e.micro % 20), hatch=hatch, **_EDGE)
        if span > 0 and width / span > 0.025 * (1 + (n_micro > 9)):  # label bars wide enough
            box = {"facecolor": "white", "alpha": 0.6, "pad": 0.5, "edgecolor": "none"}
            ax.text(
                left + width / 2, e.stage, f"{e.kind}{e.micro}", **_CENTRE, size="small", bbox=box
            )
    ax.set_yticks(range(n_stages), [f"stage {s}" for s in range(n_stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, span or 1)
    if time_unit == "slots":  # an ideal schedule: whole slots
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("time slots" if time_unit == "slots" else f"time ({time_unit})")
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Patch(facecolor="white", edgecolor="black", label="forward (F)"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="backward (B)"),
    ]
    legend_title = f"{_count(n_micro, 'micro-batch')}\n(colour = micro-batch)"
    ax.legend(handles=handles, title=legend_title, title_fontsize="small", **_BESIDE)
    ax.set_title(title or f"{_count(n_stages, 'stage')}, {_count(n_micro, 'micro-batch')}")
    fig.tight_layout()
    return fig


def _ideal_gpipe(n_stages: int, n_micro: int, backward_cost: float) -> list[Event]:
    """The GPipe schedule with equal stages: forward 1 slot, backward ``backward_cost`` slots."""
    events = []
    forward_end = n_micro + n_stages - 1  # the last forward ends here
    for s in range(n_stages):
        for m in range(n_micro):
            events.append(Event(s, m, "F", s + m, s + m + 1))
            # backward runs in reverse: the last stage starts with the last micro-batch
            start = forward_end + backward_cost * ((n_stages - 1 - s) + (n_micro - 1 - m))
            events.append(Event(s, m, "B", start, start + backward_cost))
    return events


def plot_ideal_schedule(n_stages: int, n_micro: int, *, backward_cost: float = 2.0) -> Figure:
    """The ideal GPipe schedule of ``n_stages`` equal stages and ``n_micro`` micro-batches.

    Lesson 05a draws it next to the measured timelines. A forward takes one time slot, a backward
    ``backward_cost`` (about two); the idle share is (S - 1) / (M + S - 1) whatever that cost.
    """
    for name, value in (("n_stages", n_stages), ("n_micro", n_micro)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if not backward_cost > 0:
        raise ValueError(f"backward_cost must be > 0, got {backward_cost!r}")
    s, m = _count(n_stages, "stage"), _count(n_micro, "micro-batch")
    idle = bubble_fraction(n_stages, n_micro)
    title = f"ideal GPipe schedule: S={s}, M={m}, idle (S-1)/(M+S-1) = {idle:.0%}"
    return plot_timeline(_ideal_gpipe(n_stages, n_micro, backward_cost), title, time_unit="slots")


def plot_memory(
    breakdown: Mapping[str, Mapping[str, float]],
    title: str = "memory per device",
    *,
    unit: str = "MiB",
) -> Figure:
    """Stacked bars of memory per device (lesson 05a): one bar per key, one layer per kind.

    ``breakdown`` maps a bar label (e.g. "whole model: cuda:0") to bytes per kind, such as the
    rows of ``memory_by_device``. Kinds keep the order in which they first appear.
    """
    divisor = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}.get(unit)
    if divisor is None:
        raise ValueError(f"unit={unit!r} is unknown; choose B, KiB, MiB or GiB")
    if not breakdown:
        raise ValueError("nothing to draw: breakdown is empty")
    labels = list(breakdown)
    kinds = list(dict.fromkeys(k for row in breakdown.values() for k in row))
    fig = Figure(figsize=(max(5.0, 1.5 * len(labels) + 3), 4.0))
    ax = fig.subplots()
    bottoms = [0.0] * len(labels)
    for i, kind in enumerate(kinds):
        values = [breakdown[label].get(kind, 0) / divisor for label in labels]
        ax.bar(labels, values, bottom=bottoms, color=f"C{i}", label=kind, **_EDGE)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for x, total in enumerate(bottoms):
        ax.text(x, total, f"{total:,.1f}", ha="center", va="bottom", fontsize="small")
    ax.set_ylim(0, max(bottoms) * 1.15 or 1)
    ax.set(ylabel=unit, title=title)
    ax.tick_params(axis="x", labelsize="small")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(**_BESIDE)
    fig.tight_layout()
    return fig


def plot_micro_batch_sweep(
    n_micro: Sequence[int],
    samples_per_sec: Sequence[float],
    *,
    ideal: Sequence[float] | None = None,
    baseline: float | None = None,
    title: str = "pipeline throughput",
) -> Figure:
    """Throughput against the number of micro-batches (lesson 05b).

    ``ideal`` (dashed) is what the bubble formula predicts for each count; ``baseline`` (a
    grey horizontal line) is the unsplit model on one device.
    """
    counts, speeds = len(n_micro), len(samples_per_sec)
    if counts != speeds or not counts:
        raise ValueError(f"need one throughput per micro-batch count, got {counts} and {speeds}")
    if ideal is not None and len(ideal) != len(n_micro):
        raise ValueError(f"need one ideal value per micro-batch count, got {len(ideal)}")
    fig = Figure(figsize=(7, 3.8))
    ax = fig.subplots()
    ax.plot(n_micro, samples_per_sec, "-o", color="C0", label="pipelined (measured)")
    if ideal is not None:
        ax.plot(n_micro, ideal, "--", color="black", label="ideal (bubble formula)")
    if baseline is not None:
        ax.axhline(baseline, color="grey", linestyle=":", label="unsplit, one device")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(n_micro), [str(m) for m in n_micro])
    ax.set_ylim(bottom=0)
    ax.set(xlabel="micro-batches M", ylabel="samples / s", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


# lesson 06b, section 1
from .comm import size_label  # noqa: E402  (added at the end: this section's imports)

__all__ += ["plot_bandwidth", "plot_cost_model"]


def _bytes_axis(ax, sizes: Sequence[int]) -> None:
    """A log2 axis of message sizes labelled 1 KiB, 4 KiB, ... 64 MiB (at most ~9 labels)."""
    ax.set_xscale("log", base=2)
    step = max(1, math.ceil(len(sizes) / 9))
    ticks = list(sizes)[::step]
    ax.set_xticks(ticks, [size_label(s) for s in ticks], fontsize="small", rotation=30)
    ax.minorticks_off()
    ax.set_xlabel("message size")


def plot_bandwidth(
    sizes: Sequence[int],
    bandwidths: Mapping[str, Sequence[float]],
    *,
    ceiling: float | None = None,
    ceiling_label: str = "memory copy (reference)",
    title: str = "all-reduce bandwidth",
) -> Figure:
    """Bandwidths (bytes/s, drawn in GB/s) against message size (lesson 06b).

    ``bandwidths``: one curve per name (e.g. busbw and algbw), one value per size. A curve
    equal to an earlier one (busbw and algbw for 2 ranks) is drawn once, labelled "busbw = algbw".
    ``ceiling``: a dashed horizontal line in bytes/s; lesson 06b draws one rank's memory copy
    rate there, a reference line rather than a limit the curves could not cross.
    """
    if not sizes:
        raise ValueError("need at least one message size")
    curves: dict[str, list[float]] = {}
    for name, values in bandwidths.items():
        if len(values) != len(sizes):
            raise ValueError(f"{name!r}: {len(values)} values for {len(sizes)} sizes; need one")
        same = [k for k, v in curves.items() if all(map(math.isclose, v, values))]
        if same:
            curves[f"{same[0]} = {name}"] = curves.pop(same[0])
        else:
            curves[name] = list(values)
    fig = Figure(figsize=(7, 3.8))
    ax = fig.subplots()
    for i, (name, values) in enumerate(curves.items()):
        ax.plot(sizes, [v / 1e9 for v in values], "-o", markersize=3, color=f"C{i}", label=name)
    if ceiling is not None:
        ax.axhline(ceiling / 1e9, color="black", linestyle="--", label=ceiling_label)
    ax.set_yscale("log")
    _bytes_axis(ax, sizes)
    ax.set(ylabel="GB/s (10⁹ bytes per second)", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(**_BESIDE)
    fig.tight_layout()
    return fig


def plot_cost_model(
    sizes: Sequence[int],
    seconds: Sequence[float],
    model_seconds: Sequence[float],
    *,
    spread: Sequence[tuple[float, float]] | None = None,
    model_label: str = "model",
    title: str = "all-reduce time",
) -> Figure:
    """Measured times (points) and a model's (line) against message size, log-log (lesson 06b).

    ``spread``: each size's (fastest, slowest) repeat, drawn as a whisker around its point.
    """
    if not len(sizes) == len(seconds) == len(model_seconds) or not sizes:
        raise ValueError(
            f"need one time and one model time per size: {len(sizes)} sizes, {len(seconds)} "
            f"times, {len(model_seconds)} model times"
        )
    fig = Figure(figsize=(7, 3.8))
    ax = fig.subplots()
    ms = [t * 1e3 for t in seconds]
    if spread is not None:
        if len(spread) != len(sizes):
            raise ValueError(f"need one (fastest, slowest) pair per size, got {len(spread)}")
        below = [m - lo * 1e3 for m, (lo, _) in zip(ms, spread, strict=True)]
        above = [hi * 1e3 - m for m, (_, hi) in zip(ms, spread, strict=True)]
        ax.errorbar(sizes, ms, [below, above], fmt="none", ecolor="grey", capsize=3)
    ax.plot(sizes, ms, "o", color="C0", label="measured (median)")
    ax.plot(sizes, [t * 1e3 for t in model_seconds], "-", color="black", label=model_label)
    ax.set_yscale("log")
    _bytes_axis(ax, sizes)
    ax.set(ylabel="ms per all-reduce", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", fontsize="small")  # small messages sit low: the corner is free
    fig.tight_layout()
    return fig


# lesson 06b: a ring all-reduce drawn, and the scaling curves
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402  (this section's imports)

from .comm import ring_allreduce_steps  # noqa: E402
from .timing import Comparison  # noqa: E402

__all__ += ["plot_ring_allreduce", "plot_scaling"]


def plot_ring_allreduce(n: int) -> Figure:
    """What each of n ranks holds after each step of a ring all-reduce (lesson 06b).

    One row per step (the start, n-1 reduce-scatter steps, n-1 all-gather steps), one group of
    n chunks per rank. A chunk's label lists the ranks summed into it ("all" once complete; a
    count beyond 4 ranks), its shade darkens as the sum fills, and a red edge marks the chunk
    the rank just received from its left neighbour.
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 8:
        raise ValueError(f"n={n!r}: draw a ring of 2 to 8 ranks (more would not be readable)")
    steps = ring_allreduce_steps(n)
    cmap = matplotlib.colormaps["Blues"]
    fig = Figure(figsize=(max(6.5, 1.6 + 0.55 * n * (n + 1)), 1.3 + 0.5 * len(steps)))
    ax = fig.subplots()
    for row, step in enumerate(steps):
        y = -row
        name = "start" if step.phase == "start" else f"{step.phase} {step.step}"
        ax.text(-0.6, y, name, ha="right", va="center", size="small")
        for r in range(n):
            for c in range(n):
                summed = step.holds[r][c]
                full = len(summed) == n
                new = step.received[r] == c
                x = r * (n + 1) + c
                ax.add_patch(
                    Rectangle(
                        (x, y - 0.4),
                        0.92,
                        0.8,
                        facecolor=cmap(0.12 + 0.68 * len(summed) / n),
                        edgecolor="C3" if new else "grey",
                        linewidth=2.2 if new else 0.5,
                    )
                )
                text = (
                    "all"
                    if full
                    else ("+".join(map(str, sorted(summed))) if n <= 4 else f"{len(summed)}")
                )
                ax.text(
                    x + 0.46,
                    y,
                    text,
                    **_CENTRE,
                    size=6 if n > 3 else 7,
                    color="white" if full else "black",
                )
    for r in range(n):
        ax.text(r * (n + 1) + n / 2, 0.75, f"rank {r}", ha="center", va="bottom", size="small")
    # the ring: rank r sends to rank r + 1, and the last rank to rank 0 (the arc above)
    ring = {"arrowstyle": "-|>", "color": "C3", "linewidth": 1.2, "mutation_scale": 10}
    for r in range(n - 1):
        start, end = (r * (n + 1) + n - 0.05, 1.0), ((r + 1) * (n + 1) - 0.03, 1.0)
        ax.add_patch(FancyArrowPatch(start, end, **ring))
    wrap = ((n - 1) * (n + 1) + n / 2 + 0.9, 1.35), (n / 2 - 0.9, 1.35)
    ax.add_patch(FancyArrowPatch(*wrap, connectionstyle=f"arc3,rad={min(0.12, 0.5 / n)}", **ring))
    ax.set_xlim(-4.2, n * (n + 1))
    ax.set_ylim(-len(steps) + 0.4, 1.6 + 0.25 * n)
    ax.set_axis_off()
    ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor="C3", linewidth=2, label="received this step"),
            Patch(facecolor=cmap(0.8), label="all: summed over every rank"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncols=2,
        fontsize="small",
        frameon=False,
    )
    ax.set_title(
        f"ring all-reduce over {n} ranks: the message cut into {n} chunks; each step, every rank "
        f"sends one chunk to its right\n(reduce-scatter adds it, all-gather copies it): "
        f"{2 * (n - 1)} chunks of S/{n} sent per rank",
        size="small",
    )
    fig.tight_layout()
    return fig


def plot_scaling(
    ns: Sequence[int],
    speedups: Mapping[str, Sequence[Comparison]],
    predicted: Mapping[str, Sequence[tuple[float, float]]],
    title: str = "",
) -> Figure:
    """Speed-up and efficiency over world sizes, against linear scaling (lesson 06b).

    ``speedups[kind][i]``: the speed-up of ``ns[i]`` ranks over one, round by round (whiskers:
    the slowest to the fastest round). ``predicted[kind][i]``: the (no overlap, perfect
    overlap) efficiencies a model predicts, drawn as a band. A hollow marker: the rounds did not
    agree on which was faster (``Comparison.meaningful``), so its median is no verdict.
    """
    for kind, values in (*speedups.items(), *predicted.items()):
        if len(values) != len(ns):
            raise ValueError(f"{kind!r}: {len(values)} values for {len(ns)} world sizes; need one")
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax_s, ax_e = fig.subplots(1, 2)
    ax_s.plot(ns, ns, "k--", label="linear (ideal)")
    ax_e.axhline(1.0, color="black", linestyle="--", label="linear (ideal)")
    for i, (kind, comparisons) in enumerate(speedups.items()):
        mid = [c.median for c in comparisons]
        whiskers = [
            [m - c.low for m, c in zip(mid, comparisons, strict=True)],
            [c.high - m for m, c in zip(mid, comparisons, strict=True)],
        ]
        look = {"marker": "o", "capsize": 4, "color": f"C{i}", "label": f"{kind}, measured"}
        ax_s.errorbar(ns, mid, yerr=whiskers, **look)
        ax_e.errorbar(
            ns,
            [m / n for m, n in zip(mid, ns, strict=True)],
            yerr=[[w / n for w, n in zip(side, ns, strict=True)] for side in whiskers],
            **look,
        )
        hollow = [j for j, c in enumerate(comparisons) if ns[j] != 1 and not c.meaningful]
        for ax, scale in ((ax_s, [1] * len(ns)), (ax_e, ns)):
            ax.plot([ns[j] for j in hollow], [mid[j] / scale[j] for j in hollow], "o",
                    markerfacecolor="white", markeredgecolor=f"C{i}", zorder=3)
        if kind in predicted:
            low, high = zip(*predicted[kind], strict=True)
            ax_e.fill_between(ns, low, high, color=f"C{i}", alpha=0.15, label=f"{kind}, predicted")
    ax_s.set(xlabel="ranks", ylabel="speed-up over 1 rank", title="speed-up")
    ax_e.set(xlabel="ranks", ylabel="efficiency (speed-up / ranks)", title="efficiency")
    ax_e.set_ylim(0, max(1.1, ax_e.get_ylim()[1]))
    for ax in (ax_s, ax_e):
        ax.set_xticks(list(ns))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def plot_activation_peaks(peaks: Mapping[str, Sequence[int]], n_micro: int) -> Figure:
    """Bars: the most micro-batches whose activations each stage held at once, per schedule,
    beside GPipe's model (M) and 1F1B's (min(M, S - s)) (lesson 09b)."""
    if not peaks or n_micro < 1:
        raise ValueError("pass each schedule's peaks per stage and n_micro >= 1")
    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    stages = range(len(next(iter(peaks.values()))))
    width = 0.8 / len(peaks)
    for k, (name, counts) in enumerate(peaks.items()):
        xs = [s + (k - (len(peaks) - 1) / 2) * width for s in stages]
        ax.bar(xs, counts, width, label=f"{name}, measured", color=f"C{k}", **_EDGE)
    left, right = [s - 0.45 for s in stages], [s + 0.45 for s in stages]
    ax.hlines(
        [n_micro] * len(stages), left, right, colors="C0", linestyles="--", label="GPipe model: M"
    )
    model_1f1b = [min(n_micro, len(stages) - s) for s in stages]
    ax.hlines(
        model_1f1b, left, right, colors="C1", linestyles=":", label="1F1B model: min(M, S - s)"
    )
    ax.set_xticks(list(stages), [f"stage {s}" for s in stages])
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, n_micro * 1.4)  # room for the legend above the bars
    ax.set_ylabel("micro-batches alive at once")
    ax.set_title(f"saved activations per stage, S={len(stages)}, M={n_micro}")
    ax.legend(fontsize="small", loc="upper center", ncols=2)
    fig.tight_layout()
    return fig


def plot_lm_losses(runs: Mapping[str, Mapping], vocab_size: int = 256) -> Figure:
    """Lesson 11: training loss per step (thin) and validation loss (markers) of each run.

    ``runs`` maps a name to what ``lm_train.train_lm`` returned (its ``history`` and ``evals``).
    A dotted line marks log(vocab_size), the loss of a model that guesses uniformly.
    """
    if not runs:
        raise ValueError("plot_lm_losses needs at least one run")
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    for i, (name, outcome) in enumerate(runs.items()):
        history, evals = outcome["history"], outcome["evals"]
        ax.plot(history["step"], history["train_loss"], color=f"C{i % 10}", linewidth=0.8,
                alpha=0.6, label=f"{name} train")  # fmt: skip
        ax.plot(evals["step"], evals["val_loss"], "o-", color=f"C{i % 10}",
                label=f"{name} validation")  # fmt: skip
    ax.axhline(math.log(vocab_size), color="grey", linestyle=":",
               label=f"uniform guess, log {vocab_size} = {math.log(vocab_size):.2f}")  # fmt: skip
    ax.set(xlabel="optimizer step", ylabel="loss (nats per byte)", title="next-byte loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(**_BESIDE)
    return fig
