"""Plots the lessons show (lesson 02 onwards). Each function returns a matplotlib Figure."""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure

from .train import History

__all__ = ["plot_batch_split", "plot_history", "plot_throughput"]


def plot_history(runs: History | Mapping[str, History], title: str = "") -> Figure:
    """Loss and accuracy per epoch, one line per run (train solid, test dashed)."""
    if isinstance(runs, History):
        runs = {"run": runs}
    fig = Figure(figsize=(10, 3.6))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for i, (label, h) in enumerate(runs.items()):
        color = f"C{i}"
        ax_loss.plot(h.epoch, h.train_loss, "-o", color=color, label=f"{label} train")
        ax_loss.plot(h.epoch, h.test_loss, "--s", color=color, label=f"{label} test")
        ax_acc.plot(h.epoch, h.train_acc, "-o", color=color, label=f"{label} train")
        ax_acc.plot(h.epoch, h.test_acc, "--s", color=color, label=f"{label} test")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1.02))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_throughput(
    samples_per_sec: Mapping[str, float],
    ideal: Mapping[str, float] | None = None,
    title: str = "training throughput",
) -> Figure:
    """Bars of samples per second per method, with the ideal (e.g. linear scaling) as markers."""
    labels = list(samples_per_sec)
    values = [samples_per_sec[k] for k in labels]
    fig = Figure(figsize=(max(4.0, 1.4 * len(labels) + 2), 3.6))
    ax = fig.subplots()
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize="small")
    if ideal:
        xs = [i for i, k in enumerate(labels) if k in ideal]
        ax.scatter(
            xs,
            [ideal[labels[i]] for i in xs],
            marker="_",
            s=900,
            color="black",
            zorder=3,
            label="ideal",
        )
        ax.legend()
    ax.set(ylabel="samples / s", title=title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_batch_split(batch_size: int, n_devices: int) -> Figure:
    """One bar per device showing which samples of the batch it gets (lesson 03).

    Uses the same rule as ``nn.DataParallel`` (``torch.chunk``): uneven batches give a smaller
    last shard, and some devices may get nothing at all.
    """
    from .data_parallel import shard_sizes

    sizes = shard_sizes(batch_size, n_devices) + [0] * n_devices
    sizes = sizes[:n_devices]
    fig = Figure(figsize=(8, 0.5 + 0.45 * n_devices))
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
    ax.invert_yaxis()
    ax.set_xlim(0, batch_size)
    ax.set_xlabel("sample index in the batch")
    used = sum(1 for n in sizes if n)
    ax.set_title(
        f"batch of {batch_size} on {n_devices} devices: shards {sizes[:used]}"
        + (f", {n_devices - used} idle" if used < n_devices else "")
    )
    fig.tight_layout()
    return fig
