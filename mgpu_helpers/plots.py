"""Plots the lessons show (lesson 02 onwards). Each function returns a matplotlib Figure."""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure

from .train import History

__all__ = ["plot_history", "plot_throughput"]


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
