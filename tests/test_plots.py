"""Plots return matplotlib Figures with the expected axes, lines and bars."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display in the tests

import pytest  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from mgpu_helpers.plots import plot_history, plot_throughput  # noqa: E402
from mgpu_helpers.train import History  # noqa: E402


def _history(n: int = 3, offset: float = 0.0) -> History:
    return History(
        epoch=list(range(1, n + 1)),
        train_loss=[2.0 - i * 0.5 + offset for i in range(n)],
        train_acc=[0.3 + 0.2 * i for i in range(n)],
        test_loss=[2.1 - i * 0.4 for i in range(n)],
        test_acc=[0.25 + 0.2 * i for i in range(n)],
        samples_per_sec=[1000.0] * n,
    )


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def test_plot_history_one_run():
    h = _history()
    fig = plot_history(h, title="baseline")
    assert isinstance(fig, Figure)
    ax_loss, ax_acc = fig.axes
    assert ax_loss.get_title() == "loss" and ax_acc.get_title() == "accuracy"
    assert len(ax_loss.lines) == 2 and len(ax_acc.lines) == 2  # train and test
    assert list(ax_loss.lines[0].get_ydata()) == h.train_loss
    assert list(ax_loss.lines[1].get_ydata()) == h.test_loss
    assert list(ax_acc.lines[0].get_xdata()) == h.epoch
    assert list(ax_acc.lines[1].get_ydata()) == h.test_acc
    assert ax_loss.lines[1].get_linestyle() == "--"  # test dashed
    assert fig.get_suptitle() == "baseline"
    assert _png(fig).startswith(b"\x89PNG")


def test_plot_history_several_runs_have_one_colour_each():
    runs = {"1 device": _history(), "2 devices": _history(offset=0.1), "DDP": _history(4)}
    fig = plot_history(runs)
    ax_loss, ax_acc = fig.axes
    assert len(ax_loss.lines) == 2 * len(runs) and len(ax_acc.lines) == 2 * len(runs)
    labels = [t.get_text() for t in ax_loss.get_legend().get_texts()]
    assert labels[:2] == ["1 device train", "1 device test"]
    assert "DDP test" in labels
    colours = [line.get_color() for line in ax_loss.lines]
    assert colours[0] == colours[1] and colours[0] != colours[2]
    assert fig.get_suptitle() == ""


def test_plot_history_with_nan_test_values_still_draws():
    h = _history()
    h.test_loss = h.test_acc = [float("nan")] * 3  # fit without a test loader
    assert _png(plot_history(h)).startswith(b"\x89PNG")


def _bars(fig: Figure) -> list:
    (ax,) = fig.axes
    containers = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(containers) == 1
    return list(containers[0])


def test_plot_throughput_bars():
    speeds = {"1 GPU": 1000.0, "DataParallel": 1500.0, "DDP": 1900.0}
    fig = plot_throughput(speeds, title="digits")
    bars = _bars(fig)
    assert [b.get_height() for b in bars] == list(speeds.values())
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(speeds)
    assert ax.get_title() == "digits" and ax.get_legend() is None
    assert "1,900" in [t.get_text() for t in ax.texts]  # value labels on the bars
    assert _png(fig).startswith(b"\x89PNG")


def test_plot_throughput_ideal_markers_only_where_given():
    speeds = {"1 GPU": 1000.0, "2 GPUs": 1800.0, "4 GPUs": 3000.0}
    ideal = {"2 GPUs": 2000.0, "4 GPUs": 4000.0, "not a method": 1.0}
    fig = plot_throughput(speeds, ideal)
    ax = fig.axes[0]
    assert len(_bars(fig)) == 3
    (markers,) = ax.collections
    assert markers.get_offsets().tolist() == [[1.0, 2000.0], [2.0, 4000.0]]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ideal"]


@pytest.mark.parametrize("n", [1, 6])
def test_plot_throughput_width_grows_with_methods(n):
    fig = plot_throughput({f"m{i}": float(i + 1) for i in range(n)})
    assert len(_bars(fig)) == n
    assert fig.get_figwidth() == max(4.0, 1.4 * n + 2)
