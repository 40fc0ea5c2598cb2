"""Plots the lessons show (lesson 02 onwards). Each function returns a matplotlib Figure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from .model_parallel import Event, bubble_fraction
from .train import History

__all__ = [
    "plot_batch_split",
    "plot_history",
    "plot_ideal_schedule",
    "plot_memory",
    "plot_micro_batch_sweep",
    "plot_throughput",
    "plot_timeline",
]


_COINCIDE = 0.005  # curves closer than this share of the axis' span are drawn as coinciding


def _coincide(a: Sequence[float], b: Sequence[float], tolerance: float) -> bool:
    """Same length and every point within ``tolerance`` (NaN matches NaN: no test set)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if math.isnan(x) or math.isnan(y):
            if not (math.isnan(x) and math.isnan(y)):
                return False
        elif abs(x - y) > tolerance:
            return False
    return True


def plot_history(runs: History | Mapping[str, History], title: str = "") -> Figure:
    """Loss and accuracy per epoch, one colour per run (train solid, test dashed); lesson 02 on.

    Epochs are whole numbers on the axis. When a run's curve coincides with an earlier run's
    (within 0.5% of the axis, as one device and ``nn.DataParallel`` do in lesson 03), the earlier
    one is drawn thick and pale and the later one thin with x/+ markers on top of it; the
    legend and the title say so, so that no run seems to be missing. A single ``History``
    draws curves named "train" and "test"; a mapping names each run by its key. The legend
    sits below both panels, one column per run, where it covers no curve.
    """
    if isinstance(runs, History):
        runs = {"": runs}  # one unnamed run: its curves are just "train" and "test"
    items = list(runs.items())
    # constrained layout leaves room for the figure legend outside the panels
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax_loss, ax_acc = fig.subplots(1, 2)
    losses = [v for _, h in items for v in (*h.train_loss, *h.test_loss) if not math.isnan(v)]
    loss_span = (max(losses) - min(losses)) if losses else 0.0
    tolerance = {"loss": _COINCIDE * (loss_span or 1.0), "acc": _COINCIDE * 1.02}
    curves = [  # (History field, axes, line style, marker)
        ("train_loss", ax_loss, "-", "o"),
        ("test_loss", ax_loss, "--", "s"),
        ("train_acc", ax_acc, "-", "o"),
        ("test_acc", ax_acc, "--", "s"),
    ]
    twin: dict[tuple[int, str], int] = {}  # (run, curve) -> the earlier run it lies on
    for i, (_, h) in enumerate(items):
        for key, *_ in curves:
            tol = tolerance[key.split("_")[1]]
            for j in range(i):
                other = items[j][1]
                if h.epoch == other.epoch and _coincide(getattr(h, key), getattr(other, key), tol):
                    twin[(i, key)] = j
                    break
    under = {(j, key) for (_, key), j in twin.items()}
    for i, (label, h) in enumerate(items):
        color = f"C{i % 10}"
        for key, ax, style, marker in curves:
            kind = key.split("_")[0]  # train or test
            values = getattr(h, key)
            if (i, key) in twin:  # thin, on top of the curve it coincides with
                ax.plot(
                    h.epoch,
                    values,
                    linestyle=style,
                    marker="x" if kind == "train" else "+",
                    markersize=8,
                    linewidth=1.2,
                    color=color,
                    zorder=3,
                    label=f"{_name(label, kind)} (drawn over {items[twin[(i, key)]][0]})",
                )
            elif (i, key) in under:  # thick and pale, so the curve on top stays visible
                ax.plot(
                    h.epoch,
                    values,
                    linestyle=style,
                    marker=marker,
                    markersize=9,
                    linewidth=4.5,
                    alpha=0.4,
                    color=color,
                    label=_name(label, kind),
                )
            else:
                ax.plot(
                    h.epoch,
                    values,
                    linestyle=style,
                    marker=marker,
                    color=color,
                    label=_name(label, kind),
                )
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1.02))
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # no epoch 1.5
        ax.grid(alpha=0.3)
    # Both panels have the same curves, so one legend serves both. Inside a panel it would sit
    # on some curve (test curves cross the train ones); below the panels it covers nothing.
    # One column per run, each reading "train" over "test" (a single run: one row).
    handles, labels = ax_loss.get_legend_handles_labels()
    columns = 2 if len(items) == 1 else min(len(items), 3)
    fig.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize="small")
    if twin:
        shared: dict[tuple[int, int], list[str]] = {}
        for (i, key), j in twin.items():
            shared.setdefault((i, j), []).append(key.replace("_", " ").replace("acc", "accuracy"))
        parts = []
        for (i, j), keys in sorted(shared.items()):
            a, b = items[i][0], items[j][0]
            what = "" if len(keys) == len(curves) else f" in {', '.join(keys)}"
            parts.append(f"{a} coincides with {b}{what}")
        note = "; ".join(parts) + " (thin lines with x/+ markers drawn over thick pale ones)"
        title = f"{title}\n{note}" if title else note
    if twin:
        fig.suptitle(title, fontsize="medium")  # two lines: the note in a smaller size
    elif title:
        fig.suptitle(title)
    return fig


def _name(run: str, kind: str) -> str:
    """A curve's legend entry: ``DDP train``, or just ``train`` for an unnamed single run."""
    return f"{run} {kind}" if run else kind


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
    values = [samples_per_sec[k] for k in labels]
    legend_room = 1.8 if ideal or ranges else 0.0  # inches for the legend beside the axes
    fig = Figure(figsize=(max(4.0, 1.4 * len(labels) + 2) + legend_room, 3.6))
    ax = fig.subplots()
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
    # With whiskers, the numbers go inside the bars, where no whisker can cover them.
    ax.bar_label(
        bars,
        labels=[f"{v:,.0f}" for v in values],
        fontsize="small",
        label_type="center" if ranges else "edge",
        color="white" if ranges else None,
    )
    tops = [*values, *(ideal or {}).values()]
    if ranges:
        xs = [i for i, k in enumerate(labels) if k in ranges]
        for k in ranges:
            low, high = ranges[k]
            if k in samples_per_sec and not low <= samples_per_sec[k] <= high:
                raise ValueError(f"range {low}..{high} of {k!r} does not hold its bar's value")
        ax.errorbar(
            xs,
            [values[i] for i in xs],
            yerr=[
                [values[i] - ranges[labels[i]][0] for i in xs],
                [ranges[labels[i]][1] - values[i] for i in xs],
            ],
            fmt="none",
            ecolor="black",
            capsize=6,
            label="slowest to fastest repeat",
        )
        tops += [ranges[labels[i]][1] for i in xs]
    if ideal:
        xs = [i for i, k in enumerate(labels) if k in ideal]
        ax.scatter(
            xs,
            [ideal[labels[i]] for i in xs],
            marker="_",
            s=900,  # a mark about as wide as a bar
            linewidths=2,
            color="black",
            zorder=3,
        )
    if ideal or ranges:
        handles, names = ax.get_legend_handles_labels()  # the whisker, when there is one
        if ideal:  # the bar-wide mark would overrun its label: the legend shows a short line
            handles.append(Line2D([], [], color="black", linewidth=2))
            names.append("ideal")
        # beside the axes, so that it covers no bar, whisker or mark
        ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    ax.set_ylim(0, 1.12 * max(tops))  # headroom for the value labels above the bars
    ax.set(ylabel="samples / s", title=title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _count(n: int, noun: str) -> str:
    """``3 devices``, ``1 device``, ``2 micro-batches``: a number with its noun."""
    plural = noun + ("es" if noun.endswith("ch") else "s")
    return f"{n} {noun if n == 1 else plural}"


def plot_batch_split(batch_size: int, n_devices: int) -> Figure:
    """One bar per device showing which samples of the batch it gets (lesson 03).

    Uses the same rule as ``nn.DataParallel`` (``torch.chunk``): uneven batches give a smaller
    last shard, and some devices may get nothing at all.
    """
    from .data_parallel import shard_sizes

    sizes = shard_sizes(batch_size, n_devices) + [0] * n_devices
    sizes = sizes[:n_devices]
    fig = Figure(figsize=(8, max(2.2, 0.9 + 0.45 * n_devices)))  # room for one row and labels
    ax = fig.subplots()
    start = 0
    for d, n in enumerate(sizes):
        if n:
            ax.barh(d, n, left=start, color=f"C{d % 10}", edgecolor="black")
            ax.text(
                start + n / 2, d, f"{n}", ha="center", va="center", color="white", fontweight="bold"
            )
        else:
            ax.text(0.5, d, "idle: no samples", va="center", color="gray")
        start += n
    ax.set_yticks(range(n_devices), [f"device {d}" for d in range(n_devices)])
    ax.set_ylim(n_devices - 0.5, -0.5)  # device 0 on top, and room for an idle last row
    ax.set_xlim(0, batch_size)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # samples are whole
    ax.set_xlabel("sample index in the batch")
    used = sum(1 for n in sizes if n)
    ax.set_title(
        f"batch of {batch_size} on {_count(n_devices, 'device')}: shards {sizes[:used]}"
        + (f", {n_devices - used} idle" if used < n_devices else "")
    )
    fig.tight_layout()
    return fig


def plot_timeline(events: Sequence[Event], title: str = "", *, time_unit: str = "ms") -> Figure:
    """A pipeline timeline (lesson 05): one row per stage, one bar per forward or backward.

    Bars are coloured by micro-batch; forwards are plain, backwards hatched. ``events`` come
    from a measured step (``model_parallel.Timeline``: seconds, shown in ``time_unit`` "ms" or
    "s") or from an ideal schedule in time slots (``time_unit="slots"``). Gaps in a row are
    that stage's idle time.
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
    cmap = "tab10" if n_micro <= 10 else "tab20"
    colours = [matplotlib.colormaps[cmap](m % 20) for m in range(n_micro)]
    for e in events:
        left, width = (e.start - t0) * scale, (e.end - e.start) * scale
        ax.barh(
            e.stage,
            width,
            left=left,
            height=0.7,
            color=colours[e.micro],
            edgecolor="black",
            linewidth=0.5,
            hatch="//" if e.kind == "B" else None,
        )
        if span > 0 and width / span > 0.025 * (1 + (n_micro > 9)):  # label bars wide enough
            ax.text(
                left + width / 2,
                e.stage,
                f"{e.kind}{e.micro}",
                ha="center",
                va="center",
                fontsize="small",
                bbox={"facecolor": "white", "alpha": 0.6, "pad": 0.5, "edgecolor": "none"},
            )
    ax.set_yticks(range(n_stages), [f"stage {s}" for s in range(n_stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, span if span > 0 else 1)
    if time_unit == "slots":  # an ideal schedule: whole slots
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("time slots" if time_unit == "slots" else f"time ({time_unit})")
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Patch(facecolor="white", edgecolor="black", label="forward (F)"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="backward (B)"),
    ]
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
        title=f"{n_micro} micro-batch{'es' if n_micro > 1 else ''}\n(colour = micro-batch)",
        title_fontsize="small",
    )
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
    """The ideal GPipe schedule for ``n_stages`` equal stages and ``n_micro`` micro-batches.

    Lesson 05 draws it next to the measured timelines. A forward takes one time slot and a
    backward ``backward_cost`` slots (about twice a forward in practice); the idle share is
    (S - 1) / (M + S - 1) whatever that ratio.
    """
    for name, value in (("n_stages", n_stages), ("n_micro", n_micro)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if not backward_cost > 0:
        raise ValueError(f"backward_cost must be > 0, got {backward_cost!r}")
    bubble = bubble_fraction(n_stages, n_micro)
    title = (
        f"ideal GPipe schedule: S={_count(n_stages, 'stage')}, "
        f"M={_count(n_micro, 'micro-batch')}, "
        f"idle (S-1)/(M+S-1) = {bubble:.0%}"
    )
    events = _ideal_gpipe(n_stages, n_micro, float(backward_cost))
    return plot_timeline(events, title, time_unit="slots")


def plot_memory(
    breakdown: Mapping[str, Mapping[str, float]],
    title: str = "memory per device",
    *,
    unit: str = "MiB",
) -> Figure:
    """Stacked bars of memory per device (lesson 05): one bar per key, one layer per kind.

    ``breakdown`` maps a bar label (e.g. "whole model: cuda:0") to bytes per kind, such as the
    rows of ``memory_by_device`` or ``memory_by_stage``. Kinds keep the order in which they
    first appear.
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
        ax.bar(
            labels,
            values,
            bottom=bottoms,
            color=f"C{i}",
            label=kind,
            edgecolor="black",
            linewidth=0.5,
        )
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for x, total in enumerate(bottoms):
        ax.text(x, total, f"{total:,.1f}", ha="center", va="bottom", fontsize="small")
    ax.set_ylim(0, max(bottoms) * 1.15 if max(bottoms) > 0 else 1)
    ax.set(ylabel=unit, title=title)
    ax.tick_params(axis="x", labelsize="small")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
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
    """Throughput against the number of micro-batches (lesson 05).

    ``ideal`` (dashed) is what the bubble formula predicts for each count; ``baseline`` (a
    grey horizontal line) is the unsplit model on one device.
    """
    if len(n_micro) != len(samples_per_sec) or not n_micro:
        raise ValueError(
            f"need one throughput per micro-batch count, got {len(n_micro)} and "
            f"{len(samples_per_sec)}"
        )
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
