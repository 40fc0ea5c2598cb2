"""Timing device work honestly (lesson 01; every speed number in the course).

GPU kernels run asynchronously: a Python timer around a CUDA call measures only the launch.
:func:`measure` synchronises the device before reading the clock, runs warm-up calls first
(allocator, cuDNN autotuning, caches) and reports the median of several repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Timing", "measure", "synchronize"]


Devices = torch.device | str | Sequence[torch.device | str]


def synchronize(device: Devices) -> None:
    """Wait until all queued work on ``device`` (or on each of several) has finished.

    A no-op on the CPU, where every operation has finished when it returns.
    """
    if isinstance(device, (list, tuple)):
        for d in device:
            synchronize(d)
        return
    dev = torch.device(device)  # type: ignore[arg-type]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class Timing:
    """Seconds per call over the repeats; ``median`` is the number to quote."""

    times: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (max(self.times) - min(self.times)) / self.median if self.median > 0 else 0.0

    def __str__(self) -> str:
        return f"median {self.median * 1e3:.3f} ms over {len(self.times)} repeats"


def measure(
    fn: Callable[[], object],
    device: Devices = "cpu",
    *,
    warmup: int = 2,
    repeats: int = 5,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` synchronised timed calls.

    ``device`` may be a list: work spread over several GPUs is timed until all have finished.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return Timing(tuple(times))
