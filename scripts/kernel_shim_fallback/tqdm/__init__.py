"""Fallback tqdm (see std.py): used only where tqdm is not installed."""

from .std import TqdmWarning, tqdm, trange

__all__ = ["TqdmWarning", "tqdm", "trange"]
__version__ = "0+lesson-script-fallback"
