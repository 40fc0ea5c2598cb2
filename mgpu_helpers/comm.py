"""Timing a collective inside a rank, over message sizes (lesson 06; 08 and 09 reuse it).

Lesson 06 measures how long an all-reduce takes for messages from 1 KiB to tens of MiB;
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
whole number of them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .timing import Timing, synchronize

__all__ = ["elements", "size_label", "time_collective"]


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
    """Seconds per call of ``op(tensor)`` for a tensor of each size in bytes (lesson 06).

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
