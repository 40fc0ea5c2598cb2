"""mgpu_helpers.gaps: the gap between two runs per epoch, and its picture (lesson 04b)."""

from __future__ import annotations

import math

import pytest

from mgpu_helpers.gaps import FLOAT32_EPS, epoch_gaps, growth, plot_gaps
from mgpu_helpers.train import EpochResult, History


def _history(losses: list[float], accuracies: list[float]) -> History:
    h = History()
    for epoch, (loss, acc) in enumerate(zip(losses, accuracies, strict=True), 1):
        h.append(epoch, EpochResult(loss, acc, 10, 1.0), EpochResult(loss + 0.1, acc, 10, 1.0))
    return h


def test_epoch_gaps_are_absolute_differences_per_epoch() -> None:
    a = _history([1.0, 0.5, 0.25], [0.5, 0.75, 0.9])
    b = _history([1.0, 0.5 + 1e-7, 0.25 - 1e-3], [0.5, 0.75, 0.8])
    gaps = epoch_gaps(a, b)
    assert list(gaps) == ["train_loss", "test_loss", "test_acc"]
    assert gaps["train_loss"] == pytest.approx([0.0, 1e-7, 1e-3], abs=1e-12)
    assert gaps["test_acc"] == pytest.approx([0.0, 0.0, 0.1])


def test_epoch_gaps_refuse_runs_of_other_epochs_and_unknown_metrics() -> None:
    a, b = _history([1.0, 0.5], [0.5, 0.6]), _history([1.0], [0.5])
    with pytest.raises(ValueError, match="different epochs"):
        epoch_gaps(a, b)
    with pytest.raises(ValueError, match="no 'loss'"):
        epoch_gaps(a, a, ["loss"])


def test_growth_from_the_first_nonzero_gap_to_the_last() -> None:
    assert growth([0.0, 1e-7, 1e-5, 1e-3]) == pytest.approx(1e4)
    assert growth([0.0, 0.0]) == 1.0
    assert growth([1e-6, 0.0]) == 1.0


def test_plot_gaps_draws_a_log_axis_with_float32_epsilon_and_leaves_zeros_out() -> None:
    fig = plot_gaps({"test_loss": [1e-7, 1e-5, 1e-3], "test_acc": [0.0, 0.0, 0.01]}, "t")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["test_loss"].get_xdata()) == [1, 2, 3]
    acc = next(k for k in lines if k.startswith("test_acc"))
    assert "2 epoch(s)" in acc and list(lines[acc].get_xdata()) == [3]
    assert math.isclose(lines["float32 epsilon"].get_ydata()[0], FLOAT32_EPS)
    with pytest.raises(ValueError, match="no gaps"):
        plot_gaps({})
