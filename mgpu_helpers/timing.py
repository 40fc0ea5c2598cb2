"""Timing device work honestly (every speed number in the course, from lesson 02 on).

GPU kernels run asynchronously, so :func:`measure` synchronises before reading the clock, warms
up first and reports the median of several repeats: the rules lesson 01 writes out by hand.
To compare two ways of doing the same work on a busy machine, :func:`measure_alternating` times
them in rounds, so a slow spell hits both alike, and :func:`compare` says from the rounds
whether one was really faster. In a distributed run (lessons 06a, 06b) every rank calls it with the
same functions, and it lines the ranks up before each timed call, so that no function is
charged for the time a late rank kept the others waiting.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "Comparison",
    "Timing",
    "compare",
    "measure",
    "measure_alternating",
    "round_orders",
    "synchronize",
]


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
    It times this process only and never waits for other ranks, so one rank may call it alone
    (lesson 06b times a memory copy on rank 0 while the others wait). To time work that several
    ranks do together, use :func:`measure_alternating` (it lines the ranks up before each timed
    call) or :func:`mgpu_helpers.comm.time_collective`.
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


def round_orders(n: int, rounds: int) -> list[tuple[int, ...]]:
    """The order in which :func:`measure_alternating` calls ``n`` functions in each round.

    A balanced Latin square (a Williams design): row ``k`` is the zigzag ``0, 1, n-1, 2, n-2,
    ...`` with ``k`` added to every entry (mod ``n``). For even ``n``, ``n`` rows put every
    function once in every position and right after every other function exactly once; for odd
    ``n`` each row is followed by its reverse, and ``2n`` rows do the same with every pair twice.
    More rounds repeat the rows. A plain rotation (ABC, BCA, CAB) would instead keep B right
    after A in every round, so whatever A leaves behind would always fall on B. The orders depend
    on ``n`` and ``rounds`` only: every rank of a distributed run computes the same ones and so
    calls the same collectives in the same sequence.
    """
    if n < 1 or rounds < 0:
        raise ValueError(f"need n >= 1 functions and rounds >= 0, got n={n} and rounds={rounds}")
    zigzag = [0]
    low, high = 1, n - 1
    while low <= high:
        zigzag.append(low)
        if low != high:
            zigzag.append(high)
        low, high = low + 1, high - 1
    rows = []
    for k in range(n):
        row = tuple((i + k) % n for i in zigzag)
        rows.append(row)
        if n % 2 == 1 and n > 1:
            rows.append(row[::-1])
    return [rows[r % len(rows)] for r in range(rounds)]


def _as_list(device: Devices) -> list[torch.device]:
    items = device if isinstance(device, (list, tuple)) else [device]
    return [torch.device(d) for d in items]  # type: ignore[arg-type]


def _line_up_ranks(device: Devices, group: dist.ProcessGroup | None) -> None:
    """Return on every rank of ``group`` at about the same moment, with every device idle.

    The order matters. First this rank's devices finish what was queued: a rank whose GPU is
    still busy must not count as ready. Then the barrier: no rank leaves it before the last
    one has arrived. Reversed, a rank would pass the barrier and then wait for its own device,
    and start its clock late, which is the skew this removes. NCCL runs the barrier as a
    one-element all-reduce on a GPU, so it gets this rank's own GPU (``device_ids``) instead of
    a guess, and the host waits for that GPU before the clock starts.
    """
    synchronize(device)
    if "nccl" not in str(dist.get_backend(group)):  # gloo: the barrier runs on the host
        dist.barrier(group=group)
        return
    cuda = [d for d in _as_list(device) if d.type == "cuda"]
    index = cuda[0].index if cuda and cuda[0].index is not None else torch.cuda.current_device()
    dist.barrier(group=group, device_ids=[index])
    synchronize(torch.device("cuda", index))


def measure_alternating(
    fns: Mapping[str, Callable[[], object]],
    device: Devices = "cpu",
    *,
    warmup: int = 2,
    repeats: int = 5,
    group: dist.ProcessGroup | None = None,
    sync_ranks: bool = True,
) -> dict[str, Timing]:
    """Time several functions in rounds: one synchronised call of each per round (lesson 03).

    A slow spell of the machine then falls on all of them, not on whichever ran then. The order
    changes from round to round (:func:`round_orders`), so that no function always runs first
    or always right after the same other one. Each :class:`Timing`'s ``times[i]`` come from
    round ``i``, ready for :func:`compare`.

    In a distributed run (lessons 06a, 06b) every rank of ``group`` (default: all ranks) must
    call it with the same functions in the same order. Before each timed call it synchronises this
    rank's devices and waits at a barrier for the other ranks, outside the clock: without that,
    a function timed right after one that left the ranks apart (one rank still working) would
    wait for the late rank at its first collective, and be charged for it. With
    ``sync_ranks=False`` it never waits for other ranks (for functions one rank times alone).
    """
    if not fns:
        raise ValueError("nothing to time: pass a dict of name -> function")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    names = list(fns)
    together = sync_ranks and dist.is_available() and dist.is_initialized()
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for order in round_orders(len(names), repeats):
        for i in order:
            if together:
                _line_up_ranks(device, group)
            start = time.perf_counter()
            fns[names[i]]()
            synchronize(device)
            times[names[i]].append(time.perf_counter() - start)
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
        """A table cell (lessons 06a, 06b): the ratio when it means something, else the range."""
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
            f"no verdict on {name} against {other}: the rounds disagree on which is faster;"
            f" {len(self.ratios)} rounds do not resolve a difference smaller than their spread"
            f" ({self.low:.2f}x to {self.high:.2f}x)"
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
