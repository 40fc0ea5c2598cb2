"""Lesson 05's plots: timelines, the ideal schedule, memory per device and the micro-batch sweep."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display in the tests

import pytest  # noqa: E402
import torch  # noqa: E402
from lesson05_code import lesson, split_sequential  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from mgpu_helpers.model_parallel import Event, bubble_fraction, idle_fraction  # noqa: E402
from mgpu_helpers.models import mlp  # noqa: E402
from mgpu_helpers.plots import (  # noqa: E402
    _ideal_gpipe,
    plot_ideal_schedule,
    plot_memory,
    plot_micro_batch_sweep,
    plot_timeline,
)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _bars(fig: Figure) -> list:
    (ax,) = fig.axes
    return [bar for c in ax.containers if isinstance(c, BarContainer) for bar in c]


NAIVE = [  # two stages, one micro-batch: each stage idle half the time
    Event(0, 0, "F", 0.000, 0.001),
    Event(1, 0, "F", 0.001, 0.002),
    Event(1, 0, "B", 0.002, 0.004),
    Event(0, 0, "B", 0.004, 0.006),
]


def test_plot_timeline_draws_one_bar_per_event_in_milliseconds() -> None:
    fig = plot_timeline(NAIVE, "naive split")
    bars = _bars(fig)
    assert len(bars) == 4
    assert [round(b.get_x(), 6) for b in bars] == [0.0, 1.0, 2.0, 4.0]  # ms, from the first start
    assert [round(b.get_width(), 6) for b in bars] == [1.0, 1.0, 2.0, 2.0]
    assert [b.get_hatch() for b in bars] == [None, None, "//", "//"]  # backwards hatched
    ax = fig.axes[0]
    assert ax.get_title() == "naive split"
    assert ax.get_xlabel() == "time (ms)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    assert _png(fig).startswith(b"\x89PNG")


def test_plot_timeline_colours_by_micro_batch() -> None:
    events = [Event(0, m, "F", m, m + 1) for m in range(3)] + [Event(0, 0, "B", 3, 4)]
    bars = _bars(plot_timeline(events, time_unit="slots"))
    colours = [b.get_facecolor() for b in bars]
    assert colours[0] != colours[1] != colours[2]
    assert colours[3] == colours[0]  # forward and backward of micro-batch 0 share a colour


def test_plot_timeline_of_a_real_pipeline_step() -> None:
    torch.manual_seed(0)
    split = split_sequential(mlp(64, hidden=32, depth=2), [3], ["cpu", "cpu"])
    opt = torch.optim.SGD(split.parameters(), lr=0.1)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    _, events = lesson.gpipe_step(split, opt, x, y, 4)  # lesson 05a's step
    fig = plot_timeline(events)
    assert len(_bars(fig)) == 16  # 2 stages x 4 micro-batches x (F, B)
    assert "4 micro-batches" in fig.axes[0].get_title()


def test_plot_timeline_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no events"):
        plot_timeline([])
    with pytest.raises(ValueError, match="time_unit"):
        plot_timeline(NAIVE, time_unit="minutes")


@pytest.mark.parametrize(("n_stages", "n_micro"), [(1, 1), (2, 1), (2, 4), (3, 5), (4, 8)])
@pytest.mark.parametrize("backward_cost", [1.0, 2.0])
def test_the_ideal_schedule_idles_as_the_bubble_formula_says(
    n_stages: int, n_micro: int, backward_cost: float
) -> None:
    events = _ideal_gpipe(n_stages, n_micro, backward_cost)
    assert len(events) == 2 * n_stages * n_micro
    assert idle_fraction(events) == pytest.approx(bubble_fraction(n_stages, n_micro))
    when = {(e.stage, e.micro, e.kind): e for e in events}
    for s in range(n_stages):
        row = sorted((e for e in events if e.stage == s), key=lambda e: e.start)
        assert all(a.end <= b.start for a, b in zip(row, row[1:], strict=False))  # no overlap
        for m in range(n_micro):
            if s > 0:
                assert when[(s, m, "F")].start >= when[(s - 1, m, "F")].end
                assert when[(s - 1, m, "B")].start >= when[(s, m, "B")].end
            assert when[(s, m, "B")].start >= when[(n_stages - 1, n_micro - 1, "F")].end


def test_plot_ideal_schedule() -> None:
    fig = plot_ideal_schedule(3, 4)
    assert len(_bars(fig)) == 24
    ax = fig.axes[0]
    assert "33%" in ax.get_title()  # (3 - 1) / (4 + 3 - 1)
    assert ax.get_xlabel() == "time slots"
    assert ax.get_xlim() == (0.0, 18.0)  # forwards 6 slots, backwards 2 x 6 slots
    with pytest.raises(ValueError, match="n_micro"):
        plot_ideal_schedule(2, 0)
    with pytest.raises(ValueError, match="backward_cost"):
        plot_ideal_schedule(2, 2, backward_cost=0)


def test_plot_memory_stacks_kinds_per_device() -> None:
    mib = 2**20
    breakdown = {
        "whole: cpu": {"parameters": 4 * mib, "gradients": 4 * mib, "activations": 1 * mib},
        "stage 0: cpu": {"parameters": 2 * mib, "gradients": 2 * mib, "activations": mib // 2},
        "stage 1: cpu": {"parameters": 2 * mib, "gradients": 2 * mib},
    }
    fig = plot_memory(breakdown, title="per device")
    bars = _bars(fig)
    assert len(bars) == 3 * 3  # three kinds, one layer each, three bars
    heights = [round(b.get_height(), 3) for b in bars]
    assert heights[:3] == [4.0, 2.0, 2.0]  # parameters, in MiB
    assert heights[6:] == [1.0, 0.5, 0.0]  # activations on top; stage 1 has none
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "parameters",
        "gradients",
        "activations",
    ]
    assert "9.0" in [t.get_text() for t in ax.texts]  # the whole model's total
    assert ax.get_title() == "per device" and ax.get_ylabel() == "MiB"
    assert _png(fig).startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="unit"):
        plot_memory(breakdown, unit="MB")
    with pytest.raises(ValueError, match="empty"):
        plot_memory({})


def test_plot_micro_batch_sweep() -> None:
    fig = plot_micro_batch_sweep(
        [1, 2, 4, 8], [100.0, 150.0, 170.0, 160.0], ideal=[100, 133, 160, 178], baseline=110.0
    )
    ax = fig.axes[0]
    measured, ideal, baseline = ax.lines
    assert list(measured.get_ydata()) == [100.0, 150.0, 170.0, 160.0]
    assert list(ideal.get_xdata()) == [1, 2, 4, 8]
    assert list(baseline.get_ydata()) == [110.0, 110.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8"]
    assert _png(fig).startswith(b"\x89PNG")
    only_measured = plot_micro_batch_sweep([1, 2], [1.0, 2.0]).axes[0]
    assert len(only_measured.lines) == 1
    with pytest.raises(ValueError, match="one throughput"):
        plot_micro_batch_sweep([1, 2], [1.0])
    with pytest.raises(ValueError, match="ideal"):
        plot_micro_batch_sweep([1, 2], [1.0, 2.0], ideal=[1.0])
