"""Timing a collective inside a rank, over message sizes (lesson 06b; 08 and 09 reuse it).

Lesson 06b measures how long an all-reduce takes for messages from 1 KiB to tens of MiB;
lessons 08 and 09 time all-gather and reduce-scatter the same way. :func:`time_collective` is
the loop they share, called by every rank of a group at once. What it adds to
:func:`~mgpu_helpers.timing.measure`:

- the ranks start each timed repeat together (a barrier), so no rank's clock runs while it
  waits for a late partner to arrive;
- a tiny message takes microseconds, below what one clock reading resolves on a busy machine,
  so each repeat runs the collective as many times as it takes to last ``min_seconds``;
- a collective ends when the slowest rank has its result, so each repeat's time is the
  slowest rank's (every rank returns the same numbers).

:func:`elements` turns a size in bytes into a number of elements, refusing sizes that are not a
whole number of them. Lesson 06b also uses :func:`ring_allreduce_steps` (what each rank holds
after each step of a ring all-reduce, for its drawing), :func:`copy_bandwidth` (its reference
line: how fast one process copies memory) and :func:`fit_ring_model` (the least-squares fit of
the ring cost model to a sweep).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .timing import Timing, measure, synchronize

__all__ = [
    "RingStep",
    "copy_bandwidth",
    "elements",
    "fit_ring_model",
    "ring_allreduce_steps",
    "size_label",
    "time_collective",
]


def elements(nbytes: int, dtype: torch.dtype = torch.float32) -> int:
    """How many ``dtype`` elements fill ``nbytes`` bytes; ValueError if not a whole number > 0."""
    size = torch.empty((), dtype=dtype).element_size()
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"a message size must be a whole number of bytes > 0, got {nbytes!r}")
    if nbytes % size:
        raise ValueError(
            f"{nbytes} bytes is not a whole number of {dtype} elements ({size} bytes each): "
            f"use a multiple of {size}, such as {nbytes - nbytes % size or size}"
        )
    return nbytes // size


def size_label(nbytes: int) -> str:
    """``512 B``, ``1 KiB``, ``64 MiB``, ``1.5 GiB``: a size in bytes as tables and plots say it."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{nbytes} B"


def _barrier(device: torch.device, group: dist.ProcessGroup | None) -> None:
    """Every rank of ``group`` gets here before any leaves (a one-element all-reduce, waited
    for): it works alike on gloo and NCCL, and NCCL's ``dist.barrier`` would guess the device."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    synchronize(device)


def _slowest(values: list[float], device: torch.device, group: dist.ProcessGroup | None) -> list:
    """Each value's maximum over the ranks of ``group`` (on the device: NCCL needs it there)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def time_collective(
    op: Callable[[torch.Tensor], object],
    sizes: Sequence[int],
    device: torch.device | str,
    *,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    warmup: int = 2,
    min_seconds: float = 0.005,
    max_iterations: int = 1000,
    group: dist.ProcessGroup | None = None,
) -> dict[int, Timing]:
    """Seconds per call of ``op(tensor)`` for a tensor of each size in bytes (lesson 06b).

    Call it on every rank of ``group`` (default: the whole world) with the same arguments.
    For each size: a zero tensor of that many bytes on ``device``, ``warmup`` calls, one timed
    call to choose how many calls a repeat needs to last ``min_seconds`` (at most
    ``max_iterations``; the slowest rank's choice, so every rank makes the same number of
    calls), then ``repeats`` repeats, each started together (barrier) and ended by a
    device synchronisation. A repeat's time is the slowest rank's, per call. ``op`` may keep
    buffers of its own per size (an all-gather's output). Returns ``{nbytes: Timing}``.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "time_collective times a collective across ranks: call it in a worker started by "
            "launch(...) or after dist.init_process_group(...)"
        )
    if repeats < 1 or warmup < 0 or max_iterations < 1 or not min_seconds >= 0:
        raise ValueError(
            f"need repeats >= 1, warmup >= 0, max_iterations >= 1 and min_seconds >= 0; got "
            f"{repeats}, {warmup}, {max_iterations} and {min_seconds}"
        )
    device = torch.device(device)
    counts = [elements(nbytes, dtype) for nbytes in sizes]  # every size checked before any runs
    results: dict[int, Timing] = {}
    for nbytes, count in zip(sizes, counts, strict=True):
        tensor = torch.zeros(count, dtype=dtype, device=device)  # a sum of zeros stays finite
        for _ in range(warmup):
            op(tensor)
        synchronize(device)
        _barrier(device, group)
        start = time.perf_counter()
        op(tensor)
        synchronize(device)
        (one,) = _slowest([time.perf_counter() - start], device, group)
        calls = max(1, min(max_iterations, math.ceil(min_seconds / max(one, 1e-9))))
        times = []
        for _ in range(repeats):
            _barrier(device, group)  # all ranks start together; it ends with a synchronize
            start = time.perf_counter()
            for _ in range(calls):
                op(tensor)
            synchronize(device)  # the device finished the work before the clock is read
            times.append((time.perf_counter() - start) / calls)
        results[nbytes] = Timing(tuple(_slowest(times, device, group)))
    return results


@dataclass(frozen=True)
class RingStep:
    """One step of a ring all-reduce over n ranks, each rank's message cut into n chunks."""

    phase: str  # "start", "reduce-scatter" or "all-gather"
    step: int  # 1 .. n-1 within its phase (0 for "start")
    # holds[r][c]: the ranks whose chunk c is summed into rank r's copy of chunk c
    holds: tuple[tuple[frozenset[int], ...], ...]
    # received[r]: the chunk rank r received from rank r-1 in this step (None at the start)
    received: tuple[int | None, ...]


def ring_allreduce_steps(n: int) -> list[RingStep]:
    """The 2(n-1) steps of a ring all-reduce, and what every rank holds after each (lesson 06b).

    Reduce-scatter: in step s (0-based) rank r sends chunk (r - s) mod n to rank r + 1, which
    adds it to its own; after n - 1 steps rank r holds the full sum of chunk (r + 1) mod n.
    All-gather: in step s rank r sends chunk (r + 1 - s) mod n, full already, and rank r + 1
    keeps it. Every rank sends one chunk per step: 2(n-1) chunks of S/n bytes in all.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n={n!r}: a ring needs a whole number of ranks >= 2")
    holds = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    steps = [RingStep("start", 0, tuple(map(tuple, holds)), (None,) * n)]
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            before = [list(row) for row in holds]
            received: list[int | None] = [None] * n
            for r in range(n):
                chunk = (r - s) % n if phase == "reduce-scatter" else (r + 1 - s) % n
                to = (r + 1) % n
                if phase == "reduce-scatter":
                    assert not before[to][chunk] & before[r][chunk], "a rank summed twice"
                    holds[to][chunk] = before[to][chunk] | before[r][chunk]
                else:
                    holds[to][chunk] = before[r][chunk]
                received[to] = chunk
            steps.append(RingStep(phase, s + 1, tuple(map(tuple, holds)), tuple(received)))
    return steps


def copy_bandwidth(
    nbytes: int, device: torch.device | str, *, copies: int = 4, repeats: int = 5
) -> tuple[float, Timing]:
    """Bytes per second this process copies between two buffers of ``nbytes`` (lesson 06b).

    ``dst.copy_(src)`` ``copies`` times per timed call, synchronised; returns (bytes copied per
    second from the median call, the Timing). It is a reference line for an all-reduce on one
    machine, measured with this process's own threads: not the machine's peak memory
    bandwidth, which several processes (or all the cores) copying at once may exceed. A copy
    reads and writes each byte, so the memory itself moves twice the number returned.
    """
    if copies < 1:
        raise ValueError(f"copies={copies!r}: copy at least once per timed call")
    src = torch.ones(elements(nbytes), device=device)
    dst = torch.empty_like(src)
    timing = measure(lambda: [dst.copy_(src) for _ in range(copies)], device, repeats=repeats)
    return copies * nbytes / timing.median, timing


def fit_ring_model(sizes: Sequence[int], seconds: Sequence[float], n: int) -> tuple[float, float]:
    """(alpha, beta) fitting t(S) = 2(n-1)·alpha + 2(n-1)/n · S/beta to a sweep (lesson 06b).

    Least squares on relative errors (each residual divided by its measured time), so a 1 KiB
    message weighs as much as a 64 MiB one; plain least squares in seconds would fit the largest
    messages only. A negative latency (noise at small sizes) is set to 0 and beta refitted.
    RuntimeError when no positive bandwidth fits: the times do not grow with size.
    """
    if n < 2 or len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError(
            f"need n >= 2 ranks and times for 2 or more sizes; got n={n}, "
            f"{len(set(sizes))} sizes and {len(seconds)} times"
        )
    t = torch.tensor(list(seconds), dtype=torch.float64)
    x = torch.tensor([[2.0 * (n - 1), 2 * (n - 1) / n * s] for s in sizes], dtype=torch.float64)
    w = 1 / t  # residual / t: relative errors
    solution = torch.linalg.lstsq(x * w[:, None], (t * w)[:, None]).solution.flatten()
    alpha, inv_beta = solution.tolist()
    if alpha < 0:  # a latency cannot be negative: fit the bandwidth term alone
        alpha = 0.0
        xs = x[:, 1] * w
        inv_beta = float((xs @ (t * w)) / (xs @ xs))
    if not inv_beta > 0:
        raise RuntimeError(
            "the fit found no positive bandwidth: the times do not grow with size; measure "
            "again on a quieter machine, or sweep larger messages"
        )
    return alpha, 1 / inv_beta
