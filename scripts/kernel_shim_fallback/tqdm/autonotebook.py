"""Fallback tqdm (see std.py): used only where tqdm is not installed."""

from tqdm.std import TqdmWarning, tqdm, trange

__all__ = ["TqdmWarning", "tqdm", "trange"]
