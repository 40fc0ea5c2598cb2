"""How far two training runs drift apart, epoch by epoch (lesson 04b).

Lesson 04b trains the same model with DDP and on one device. The two runs agree to rounding
after a few steps, and the gap between them then grows as training amplifies it. This module
measures that gap per epoch (:func:`epoch_gaps`) and draws it on a log scale (:func:`plot_gaps`),
next to float32's machine epsilon.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from matplotlib.figure import Figure

from .train import History

__all__ = ["FLOAT32_EPS", "epoch_gaps", "growth", "plot_gaps"]

FLOAT32_EPS = torch.finfo(torch.float32).eps  # the spacing of float32 numbers just above 1.0
METRICS = ("train_loss", "test_loss", "test_acc")


def epoch_gaps(a: History, b: History, metrics: Sequence[str] = METRICS) -> dict[str, list[float]]:
    """|a - b| per epoch for each metric of two runs' histories (the same epochs in both)."""
    if a.epoch != b.epoch:
        raise ValueError(f"the runs cover different epochs: {a.epoch} and {b.epoch}")
    gaps = {}
    for metric in metrics:
        if not hasattr(a, metric):
            raise ValueError(f"a History has no {metric!r}; choose from {', '.join(METRICS)}")
        pairs = zip(getattr(a, metric), getattr(b, metric), strict=True)
        gaps[metric] = [abs(x - y) for x, y in pairs]
    return gaps


def growth(gaps: Sequence[float]) -> float:
    """How many times larger the last epoch's gap is than the first non-zero one (1.0: none)."""
    nonzero = [g for g in gaps if g > 0]
    if not nonzero or gaps[-1] == 0:
        return 1.0
    return gaps[-1] / nonzero[0]


def plot_gaps(gaps: Mapping[str, Sequence[float]], title: str = "") -> Figure:
    """Each metric's gap per epoch on a log scale, with float32's epsilon as a dashed line.

    A gap of exactly 0 cannot sit on a log axis: it is left out of its line, and the legend
    counts the epochs where the runs agreed to the bit.
    """
    if not gaps or not any(gaps.values()):
        raise ValueError("no gaps to plot: pass {metric: [gap per epoch, ...]}")
    fig = Figure(figsize=(7.5, 3.6), layout="constrained")
    ax = fig.subplots()
    for metric, values in gaps.items():
        epochs = [e for e, g in enumerate(values, 1) if g > 0]
        zeros = len(values) - len(epochs)
        label = metric + (f" (equal to the bit in {zeros} epoch(s))" if zeros else "")
        ax.plot(epochs, [g for g in values if g > 0], marker="o", label=label)
    ax.axhline(FLOAT32_EPS, color="black", linestyle="--", linewidth=1, label="float32 epsilon")
    ax.set_yscale("log")
    ax.set(xlabel="epoch", ylabel="|DDP - one device|", title=title)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    return fig
