"""Plots return matplotlib Figures with the expected axes, lines and bars."""

from __future__ import annotations

import io
import math

import matplotlib

matplotlib.use("Agg")  # no display in the tests

import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.container import BarContainer, ErrorbarContainer  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from mgpu_helpers.plots import plot_history, plot_lm_losses, plot_throughput  # noqa: E402
from mgpu_helpers.train import History  # noqa: E402


def _history(n: int = 3, offset: float = 0.0) -> History:
    return History(
        epoch=list(range(1, n + 1)),
        train_loss=[2.0 - i * 0.5 + offset for i in range(n)],
        train_acc=[0.3 + 0.2 * i - offset / 2 for i in range(n)],
        test_loss=[2.1 - i * 0.4 + offset for i in range(n)],
        test_acc=[0.25 + 0.2 * i - offset / 2 for i in range(n)],
        samples_per_sec=[1000.0] * n,
    )


def _legend_texts(fig: Figure) -> list[str]:
    """The entries of plot_history's one legend, which belongs to the figure, not a panel."""
    (legend,) = fig.legends
    assert all(ax.get_legend() is None for ax in fig.axes)
    return [t.get_text() for t in legend.get_texts()]


def _overlaps(a: Bbox, b: Bbox) -> bool:
    """Whether two boxes share area (touching edges do not count)."""
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


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
    labels = _legend_texts(fig)
    assert labels[:2] == ["1 device train", "1 device test"]
    assert "DDP test" in labels
    colours = [line.get_color() for line in ax_loss.lines]
    assert colours[0] == colours[1] and colours[0] != colours[2]
    assert fig.get_suptitle() == ""


def test_plot_history_single_run_names_its_curves_train_and_test():
    assert _legend_texts(plot_history(_history())) == ["train", "test"]  # no "run train"


@pytest.mark.parametrize("n_runs", [1, 2, 3])
def test_plot_history_legend_covers_no_panel(n_runs):
    runs = {f"run {i}": _history(offset=0.3 * i) for i in range(n_runs)}
    runs["same as run 0"] = _history()  # the longest labels: "(drawn over run 0)"
    fig = plot_history(runs, title="a title")
    FigureCanvasAgg(fig).draw()  # lay out, so that legend and panels have their final places
    (legend,) = fig.legends
    box = legend.get_window_extent()
    figure_box = fig.bbox
    assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1 and box.y0 >= figure_box.y0
    for ax in fig.axes:
        assert not _overlaps(box, ax.get_window_extent()), f"the legend covers {ax.get_title()}"


def test_plot_history_epoch_ticks_are_whole_numbers():
    for n in (1, 2, 3, 5):
        fig = plot_history(_history(n))
        FigureCanvasAgg(fig).draw()  # ticks are placed when the figure is drawn
        for ax in fig.axes:
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), (n, ticks)


def test_plot_history_draws_coinciding_runs_distinguishably_and_says_so():
    runs = {"one device": _history(), "nn.DataParallel": _history()}  # the same numbers
    fig = plot_history(runs, title="lesson 03")
    for ax in fig.axes:
        under, on_top = ax.lines[:2], ax.lines[2:]
        for low, high in zip(under, on_top, strict=True):
            assert list(low.get_ydata()) == list(high.get_ydata())
            assert high.get_linewidth() < low.get_linewidth()  # thin over thick
            assert high.get_zorder() > low.get_zorder()
            assert low.get_alpha() is not None and low.get_alpha() < 1
            assert high.get_marker() in ("x", "+") and low.get_marker() in ("o", "s")
    labels = _legend_texts(fig)  # one legend for both panels
    assert "nn.DataParallel train (drawn over one device)" in labels
    assert "nn.DataParallel test (drawn over one device)" in labels
    title = fig.get_suptitle()
    assert title.startswith("lesson 03\n")
    assert "nn.DataParallel coincides with one device (" in title  # every curve: no list
    assert _png(fig).startswith(b"\x89PNG")


def test_plot_history_names_the_curves_that_coincide_when_only_some_do():
    a, b = _history(), _history()
    b.train_loss = [v + 0.3 for v in b.train_loss]  # clearly apart; the rest identical
    fig = plot_history({"A": a, "B": b})
    title = fig.get_suptitle()
    assert "B coincides with A in test loss, train accuracy, test accuracy" in title
    ax_loss = fig.axes[0]
    train_a, test_a, train_b, test_b = ax_loss.lines
    assert train_a.get_linewidth() == train_b.get_linewidth()  # apart: ordinary lines
    assert test_b.get_linewidth() < test_a.get_linewidth()


def test_plot_history_runs_apart_by_more_than_half_a_percent_are_not_merged():
    a, b = _history(), _history()
    b.test_acc = [v + 0.02 for v in b.test_acc]  # 2% of the accuracy axis
    b.train_acc = [v + 0.02 for v in b.train_acc]
    b.train_loss = [v + 0.05 for v in b.train_loss]  # loss span is 1.5: 3% of it
    b.test_loss = [v + 0.05 for v in b.test_loss]
    fig = plot_history({"A": a, "B": b})
    assert fig.get_suptitle() == ""
    widths = {line.get_linewidth() for ax in fig.axes for line in ax.lines}
    assert len(widths) == 1


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


def test_plot_throughput_legend_sits_beside_the_bars_and_its_mark_clears_its_label():
    speeds = {"1 rank": 791.0, "2 ranks": 752.0}
    fig = plot_throughput(
        speeds,
        {"1 rank": 791.0, "2 ranks": 1582.0},
        ranges={"1 rank": (695.0, 829.0), "2 ranks": (705.0, 843.0)},
    )
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    legend = ax.get_legend()
    box = legend.get_window_extent()
    assert not _overlaps(box, ax.get_window_extent()), "the legend covers the bars"
    assert box.x1 <= fig.bbox.x1, "the legend is cut off at the figure's edge"
    texts = {t.get_text(): t for t in legend.get_texts()}
    (ideal_mark,) = [h for h in legend.legend_handles if isinstance(h, Line2D)]
    mark, label = ideal_mark.get_window_extent(), texts["ideal"].get_window_extent()
    assert mark.x1 < label.x0, f"the ideal mark (to {mark.x1:.0f}) runs into its label"


@pytest.mark.parametrize("n", [1, 6])
def test_plot_throughput_width_grows_with_methods(n):
    fig = plot_throughput({f"m{i}": float(i + 1) for i in range(n)})
    assert len(_bars(fig)) == n
    assert fig.get_figwidth() == max(4.0, 1.4 * n + 2)


def test_plot_throughput_whiskers_show_the_range_of_the_repeats():
    speeds = {"one device": 1000.0, "DataParallel": 950.0}
    ranges = {"one device": (700.0, 1300.0), "DataParallel": (600.0, 1400.0)}
    fig = plot_throughput(speeds, {"one device": 1000.0, "DataParallel": 1000.0}, ranges=ranges)
    ax = fig.axes[0]
    (whiskers,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    (segments,) = whiskers.lines[2]
    spans = [tuple(seg[:, 1]) for seg in segments.get_segments()]
    assert spans == [(700.0, 1300.0), (600.0, 1400.0)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "slowest to fastest repeat" in legend and "ideal" in legend
    assert ax.get_ylim()[1] >= 1400.0
    assert _png(fig).startswith(b"\x89PNG")


def test_plot_throughput_rejects_a_range_that_misses_its_bar():
    with pytest.raises(ValueError, match="does not hold"):
        plot_throughput({"a": 10.0}, ranges={"a": (11.0, 12.0)})


def test_batch_split_on_one_device_has_room_and_whole_ticks() -> None:
    from mgpu_helpers.plots import plot_batch_split

    for batch, devices in [(2, 1), (1, 1), (4, 3)]:
        fig = plot_batch_split(batch, devices)
        fig.canvas.draw()  # lay out, so the axes have their final size
        ax = fig.axes[0]
        assert ax.get_position().height > 0.2, f"no room for the bars of {batch} on {devices}"
        ticks = [t for t in ax.get_xticks() if 0 <= t <= batch]
        assert all(float(t).is_integer() for t in ticks), f"fractional sample ticks {ticks}"
    assert "on 1 device:" in plot_batch_split(2, 1).axes[0].get_title()


def test_ideal_schedule_counts_whole_slots_and_says_stage_in_the_singular() -> None:
    from mgpu_helpers.plots import plot_ideal_schedule

    fig = plot_ideal_schedule(1, 1)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert "S=1 stage," in ax.get_title() and "M=1 micro-batch," in ax.get_title()


def test_plot_lm_losses_draws_train_and_validation_per_run_and_the_uniform_line():
    outcome = {"history": {"step": [1, 2, 3], "train_loss": [5.5, 4.0, 3.0]},
               "evals": {"step": [0, 3], "val_loss": [5.6, 3.2]}}
    fig = plot_lm_losses({"ddp": outcome, "fsdp": outcome})
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels[:4] == ["ddp train", "ddp validation", "fsdp train", "fsdp validation"]
    assert list(ax.get_lines()[1].get_ydata()) == [5.6, 3.2]
    assert ax.get_lines()[-1].get_ydata()[0] == pytest.approx(math.log(256))
    with pytest.raises(ValueError, match="at least one run"):
        plot_lm_losses({})
