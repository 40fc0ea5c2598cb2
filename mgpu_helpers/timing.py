"""Timing device work honestly (every speed number in the course, from lesson 02 on).

GPU kernels run asynchronously, so :func:`measure` synchronises before reading the clock, warms
up first and reports the median of several repeats: the rules lesson 01 writes out by hand.
To compare two ways of doing the same work on a busy machine, :func:`measure_alternating` times
them in rounds, so a slow spell hits both alike, and :func:`compare` says from the rounds
whether one was really faster.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Comparison", "Timing", "compare", "measure", "measure_alternating", "synchronize"]


Devices = torch.device | str | Sequence[torch.device | str]


def synchronize(device: Devices) -> None:
    """Wait until the work queued on ``device`` (or each of several) has finished; CPU: no-op."""
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


def measure_alternating(
    fns: Mapping[str, Callable[[], object]],
    device: Devices = "cpu",
    *,
    warmup: int = 2,
    repeats: int = 5,
) -> dict[str, Timing]:
    """Time several functions in rounds: one synchronised call of each per round (lesson 03).

    A slow spell of the machine then falls on all of them, not on whichever ran then; the order
    rotates so that none always runs first. Each :class:`Timing`'s ``times[i]`` come from round
    ``i``, ready for :func:`compare`.
    """
    if not fns:
        raise ValueError("nothing to time: pass a dict of name -> function")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    names = list(fns)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: Timing(tuple(times[name])) for name in names}


@dataclass(frozen=True)
class Comparison:
    """How many times faster one function ran than another, round by round (lesson 03).

    ``ratios[i]`` is the other's time divided by this one's in round ``i`` (above 1: faster).
    """

    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        """The speed ratio to quote, when :attr:`meaningful` says there is one."""
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)

    @property
    def p_value(self) -> float:
        """Two-sided sign test: how likely rounds split this unevenly if both were as fast.

        Each round is then a coin toss: 5 rounds out of 5 going the same way has probability 2/32.
        """
        faster = sum(r > 1 for r in self.ratios)
        slower = sum(r < 1 for r in self.ratios)
        n = faster + slower
        if n == 0:
            return 1.0
        tail = sum(math.comb(n, i) for i in range(min(faster, slower) + 1)) / 2**n
        return min(1.0, 2 * tail)

    @property
    def meaningful(self) -> bool:
        """True when the rounds agree on which one is faster (sign test, p < 0.1: 5+ rounds)."""
        return self.p_value < 0.1

    def brief(self) -> str:
        """A table cell (lesson 06): the ratio when it means something, else the rounds' range."""
        if self.meaningful:
            return f"{self.median:.2f}x"
        return f"no verdict ({self.low:.2f}x to {self.high:.2f}x)"

    def describe(self, name: str, other: str) -> str:
        """One sentence: the ratio when it means something, else why it does not."""
        rounds = f"{len(self.ratios)} rounds ranged from {self.low:.2f}x to {self.high:.2f}x"
        if self.meaningful:
            return (
                f"{name} ran {self.median:.2f}x as fast as {other} (the median of the per-round "
                f"ratios; {rounds})"
            )
        if len(self.ratios) < 5:
            return (
                f"no verdict: {len(self.ratios)} rounds are too few to tell a difference from"
                f" noise (need 5 or more); {rounds}"
            )
        return (
            f"no measurable difference between {name} and {other}: the {rounds}, so the"
            " spread between rounds is larger than any difference; a ratio would mean nothing"
        )


def compare(timing: Timing, other: Timing) -> Comparison:
    """Round-by-round speed of ``timing`` against ``other``: one measure_alternating (lesson 03)."""
    if len(timing.times) != len(other.times):
        raise ValueError(
            f"{len(timing.times)} and {len(other.times)} repeats: compare timings from one "
            "measure_alternating call, which gives every function the same rounds"
        )
    pairs = zip(timing.times, other.times, strict=True)
    return Comparison(tuple(b / a if a > 0 else math.inf for a, b in pairs))
