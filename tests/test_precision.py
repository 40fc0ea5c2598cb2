"""mgpu_helpers.precision (lesson 06c): the CPU's bf16 flags and the lesson's two figures."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display in the tests

import torch  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from mgpu_helpers.precision import (  # noqa: E402
    cpu_has_bf16_instructions,
    plot_formats,
    plot_gradient_range,
)


def test_bf16_flags_are_read_from_cpuinfo(tmp_path) -> None:
    with_amx = tmp_path / "amx"
    with_amx.write_text("flags\t: fpu sse avx512f amx_bf16 amx_tile\n")
    plain = tmp_path / "plain"
    plain.write_text("flags\t: fpu sse avx2\n")
    assert cpu_has_bf16_instructions(with_amx) is True
    assert cpu_has_bf16_instructions(plain) is False
    assert cpu_has_bf16_instructions(tmp_path / "missing") is None


def test_bf16_flag_of_arm_cpus_counts_as_a_whole_word(tmp_path) -> None:
    arm = tmp_path / "arm"
    arm.write_text("Features\t: fp asimd evtstrm aes sve i8mm bf16 sveb16b16\n")
    older = tmp_path / "older"  # bf16 only inside another flag's name
    older.write_text("Features\t: fp asimd evtstrm aes sve svebf16\n")
    assert cpu_has_bf16_instructions(arm) is True
    assert cpu_has_bf16_instructions(older) is False


def test_plot_formats_draws_a_line_per_format_and_marks_overflow() -> None:
    values = torch.logspace(-45, 38, 200, dtype=torch.float64)
    errors = {
        dtype: ((values.to(dtype).double() - values) / values).abs()
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    }
    fig = plot_formats(values, errors)
    FigureCanvasAgg(fig).draw()
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["float32", "bfloat16", "float16", "float16: overflows to inf"]
    assert len(fig.axes[0].lines) == 4 + 3  # the curves, fp16's overflow, one dashed line each


def test_plot_gradient_range_draws_histograms_and_the_formats_limits() -> None:
    g = torch.randn(1000).abs() * 1e-6
    g[:10] = 0  # zeros are left out, not drawn at -inf
    fig = plot_gradient_range({"float32": g, "x 2^16": g * 2**16})
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    assert len(ax.containers) == 2  # one histogram per set
    assert sum(p.get_height() for p in ax.containers[0]) == 990
    limits = [line.get_xdata()[0] for line in ax.lines]
    assert limits == [-24.0, -14.0, float(torch.log2(torch.tensor(65504.0)))]
