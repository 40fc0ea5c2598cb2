"""Lesson 06's timeline of one step: backward pieces and each bucket's all-reduce (plot_overlap)."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display in the tests

import pytest  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from mgpu_helpers.plots import overlap_seconds, plot_overlap  # noqa: E402

# A backward of 3 layers (0-30 ms) and 2 buckets: one launched at 12 ms, one at the end.
COMPUTE = [("layer 5", 0.000, 0.010), ("layer 3", 0.010, 0.025), ("layer 1", 0.025, 0.030)]
COMM = [("bucket 0", 0.012, 0.040), ("bucket 1", 0.030, 0.045)]


def _bars(fig: Figure) -> list:
    (ax,) = fig.axes
    return [bar for c in ax.containers if isinstance(c, BarContainer) for bar in c]


def test_overlap_seconds_counts_communication_during_compute_once() -> None:
    assert overlap_seconds(COMPUTE, COMM) == pytest.approx(0.018)  # 12..30 ms
    # two buckets in flight together over the same compute count once
    both = [("a", 0.0, 0.02), ("b", 0.005, 0.02)]
    assert overlap_seconds([("x", 0.0, 0.01)], both) == pytest.approx(0.01)
    # communication only after the backward: no overlap (a bucket launched at the end)
    assert overlap_seconds(COMPUTE, [("late", 0.030, 0.05)]) == 0.0


def test_plot_overlap_draws_each_piece_where_it_happened() -> None:
    fig = plot_overlap(COMPUTE, COMM)
    bars = _bars(fig)
    assert len(bars) == len(COMPUTE) + len(COMM)
    (ax,) = fig.axes
    # in ms from the earliest moment; compute on row 0, bucket k on row k + 1
    lefts = [
        (round(b.get_x(), 6), round(b.get_width(), 6), round(b.get_y() + b.get_height() / 2))
        for b in bars
    ]
    assert lefts[:3] == [(0.0, 10.0, 0), (10.0, 15.0, 0), (25.0, 5.0, 0)]
    assert lefts[3:] == [(12.0, 28.0, 1), (30.0, 15.0, 2)]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["backward", "bucket 0", "bucket 1"]
    assert "18.0 ms" in ax.get_title()  # the overlap, measured
    (line,) = ax.get_lines()
    assert line.get_xdata()[0] == pytest.approx(30.0)  # where the backward ends
    fig.savefig(io.BytesIO(), format="png")  # draws without error


def test_plot_overlap_refuses_what_it_cannot_draw() -> None:
    with pytest.raises(ValueError, match="need both"):
        plot_overlap([], COMM)
    with pytest.raises(ValueError, match="ends"):
        plot_overlap(COMPUTE, [("bucket 0", 0.02, 0.01)])
    custom = plot_overlap(COMPUTE, COMM, title="one step")
    assert custom.axes[0].get_title() == "one step"
