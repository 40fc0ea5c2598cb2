"""Pictures and probes for lesson 06c (mixed precision): floating formats, gradient ranges.

The lesson writes what it teaches (autocast, the scaler, the order of unscale and clip); this
module only draws its figures and asks the CPU what it can do.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from matplotlib.figure import Figure

__all__ = ["cpu_has_bf16_instructions", "plot_formats", "plot_gradient_range"]

_COLOURS = {torch.float32: "tab:blue", torch.bfloat16: "tab:orange", torch.float16: "tab:green"}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_has_bf16_instructions(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether the CPU has bf16 arithmetic, from Linux's CPU flags.

    x86 names it ``avx512_bf16`` or ``amx_bf16``, Arm (aarch64) ``bf16``. Lesson 06c: without
    it, bf16 autocast on the CPU is emulated and often slower than float32. None where the
    flags cannot be read (macOS, Windows).
    """
    try:
        words = set(Path(cpuinfo).read_text().split())
    except OSError:
        return None
    return not words.isdisjoint({"avx512_bf16", "amx_bf16", "bf16"})


def plot_formats(
    values: torch.Tensor, errors: Mapping[torch.dtype, torch.Tensor], window: int = 10
) -> Figure:
    """Relative rounding error against magnitude, one line per format (lesson 06c, section 1).

    ``errors[dtype][i]`` is the relative error of storing ``values[i]`` (ascending) in
    ``dtype``: 1 where the value underflows to zero, infinite where it overflows (drawn at the
    top, dotted). Each line is the largest error among ``window`` neighbouring values, so it
    shows the worst case instead of the noise of single values. Dashed lines mark each format's
    smallest normal number.
    """
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.subplots()
    usable = len(values) // window * window
    x = values[:usable].double().abs().reshape(-1, window)[:, 0].numpy()
    for dtype, err in errors.items():
        colour = _COLOURS.get(dtype, "tab:red")
        e = err[:usable].double().reshape(-1, window).amax(dim=1).clamp(min=1e-12).numpy()
        finite = e < float("inf")
        ax.loglog(x[finite], e[finite], color=colour, label=_name(dtype))
        if not finite.all():
            ax.loglog(
                x[~finite],
                [1.0] * int((~finite).sum()),
                ":",
                color=colour,
                linewidth=3,
                label=f"{_name(dtype)}: overflows to inf",
            )
        ax.axvline(torch.finfo(dtype).tiny, color=colour, linestyle="--", linewidth=0.8)
    ax.set_xlabel("|value| (dashed: each format's smallest normal number)")
    ax.set_ylabel("relative rounding error")
    ax.set_ylim(1e-9, 3)
    ax.set_title("What each format keeps: flat = full precision, rising = subnormal, 1 = lost")
    ax.legend(loc="center right", fontsize="small")
    return fig


def plot_gradient_range(
    magnitudes: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float16
) -> Figure:
    """Histograms of log2 |gradient| against ``dtype``'s range (lesson 06c, section 4).

    ``magnitudes`` maps a label to the absolute values of a set of gradients (zeros are left
    out). Vertical lines: the smallest subnormal (below it: zero), the smallest normal (below
    it: fewer significant bits) and the largest finite value (above it: inf).
    """
    info = torch.finfo(dtype)
    limits = {
        "smallest subnormal": info.tiny * info.eps,
        "smallest normal": info.tiny,
        "largest finite": info.max,
    }
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    ax = fig.subplots()
    for label, mags in magnitudes.items():
        m = mags.detach().double().flatten()
        m = m[m > 0]
        ax.hist(torch.log2(m).numpy(), bins=80, alpha=0.55, label=label)
    for (name, value), style in zip(limits.items(), (":", "--", "-"), strict=True):
        ax.axvline(
            float(torch.log2(torch.tensor(value))),
            color="black",
            linestyle=style,
            label=f"{_name(dtype)} {name}: {value:.3g}",
        )
    ax.set_xlabel("log2 |gradient entry|")
    ax.set_ylabel("entries")
    ax.set_title(f"Where the gradients lie in {_name(dtype)}'s range")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return fig
