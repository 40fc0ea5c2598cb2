"""Timing DDP on groups of 1 .. N ranks for a scaling curve, in one launch (lesson 06b).

Lesson 06b measures weak and strong scaling with one launch of N ranks: it makes a process
group of the first n ranks for every n (``dist.new_group``, in the lesson) and a DDP model on
each. These timers are the measuring part, the same for every group:

- :func:`step_seconds` times DDP training steps, or the same steps inside ``no_sync()`` (the
  compute alone, without the gradient all-reduce);
- :func:`allreduce_seconds` times one all-reduce of a buffer (the gradients' size);
- :func:`scaling_batches` gives each rank its batches: its own for weak scaling, its slice of
  one global batch for strong scaling;
- :func:`time_in_rounds` runs every timer of every world size once per round, in an order that
  changes from round to round, so a slow spell of the machine falls on all of them alike.

Each timer starts with a barrier of its group (no rank's clock runs while it waits for a late
partner), synchronises the device before it reads the clock, and returns the slowest rank's
time: a step is over only when every rank is done.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from .comm import _barrier, _slowest
from .progress import progress_bar
from .timing import round_orders, synchronize

__all__ = [
    "allreduce_seconds",
    "scaling_batches",
    "slowest",
    "step_seconds",
    "time_in_rounds",
]

Batch = tuple[torch.Tensor, torch.Tensor]


def slowest(seconds: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """The largest of the group's ranks' ``seconds`` (every rank of ``group`` calls it)."""
    return _slowest([seconds], device, group)[0]


def step_seconds(
    ddp: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Batch],
    *,
    group: dist.ProcessGroup | None = None,
    sync: bool = True,
) -> float:
    """Seconds per DDP training step (cross-entropy loss) over ``batches``, slowest rank.

    ``sync=False`` runs the same steps inside ``ddp.no_sync()``: no all-reduce, so the time is
    the compute alone. The replicas then drift apart: fine for timing, not for training.
    """
    if not batches:
        raise ValueError("no batches to time: pass at least one (x, y) pair")
    device = batches[0][0].device
    _barrier(device, group)  # start together, every device idle
    start = time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        with contextlib.nullcontext() if sync else ddp.no_sync():
            F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    synchronize(device)
    return slowest(time.perf_counter() - start, device, group) / len(batches)


def allreduce_seconds(
    buffer: torch.Tensor, *, group: dist.ProcessGroup | None = None, calls: int = 1
) -> float:
    """Seconds per all-reduce of ``buffer`` in one message over ``group``, slowest rank."""
    if calls < 1:
        raise ValueError(f"calls={calls!r}: time at least one all-reduce")
    dist.all_reduce(buffer, group=group)  # untimed: the first call sets up the connections
    _barrier(buffer.device, group)
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(buffer, group=group)
    synchronize(buffer.device)
    return slowest(time.perf_counter() - start, buffer.device, group) / calls


def time_in_rounds(
    timers: Mapping[int, Mapping[str, Callable[[], float]]],
    sizes: Sequence[int],
    rounds: int,
    device: torch.device,
    *,
    progress: bool = False,
) -> dict[tuple[str, int], list[float]]:
    """Every timer once per round, for ``rounds`` rounds after one warm-up round (dropped).

    Every rank of the job calls it. ``timers[n]`` maps a name to a function returning seconds
    for world size ``n``; a rank holds entries only for the world sizes it belongs to.
    ``sizes``: every world size, the same list on every rank. Each round visits the world
    sizes, and within one the timers, in the orders of :func:`~mgpu_helpers.timing.round_orders`
    (no timer always right after the same other one); the ranks outside world size ``n`` wait
    in a barrier meanwhile. Returns ``{(name, n): [seconds per round]}``.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds!r}: time at least one round")
    times: dict[tuple[str, int], list[float]] = {
        (name, n): [] for n, named in timers.items() for name in named
    }
    sizes = list(sizes)
    size_orders = round_orders(len(sizes), rounds + 1)
    for r in progress_bar(range(rounds + 1), desc="rounds", disable=not progress):
        for n in (sizes[i] for i in size_orders[r]):
            names = list(timers.get(n, {}))
            order = round_orders(len(names), rounds + 1)[r] if names else ()
            for name in (names[i] for i in order):
                seconds = timers[n][name]()
                if r > 0:  # round 0 only warms up
                    times[name, n].append(seconds)
            _barrier(device, None)  # the ranks outside world size n wait here, idle
    return times


def scaling_batches(
    make_batch: Callable[[int, int, int], Batch],
    rank: int,
    n: int,
    steps: int,
    per_rank: int,
    global_batch: int,
    device: torch.device | str,
) -> dict[str, list[Batch]]:
    """Rank ``rank``'s batches at world size ``n``, for weak and for strong scaling (lesson 06b).

    ``make_batch(rank, step, size)`` gives rank ``rank``'s ``size`` samples of step ``step``,
    the same tensors in every process that asks. "weak": this rank's own ``per_rank`` samples,
    so the global batch grows with n. "strong": this rank's slice of one fixed global batch of
    ``global_batch`` samples (``make_batch(0, step, global_batch)``), ``global_batch // n`` per
    rank; when n does not divide it, the last samples are left out.
    """
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is not one of world size {n}'s ranks 0 .. {n - 1}")
    if global_batch < n:
        raise ValueError(f"a global batch of {global_batch} gives {n} ranks nothing each")
    mine = slice(rank * (global_batch // n), (rank + 1) * (global_batch // n))
    batches: dict[str, list[Batch]] = {"weak": [], "strong": []}
    for step in range(steps):
        batches["weak"].append(make_batch(rank, step, per_rank))
        x, y = make_batch(0, step, global_batch)  # the whole global batch, alike everywhere
        batches["strong"].append((x[mine], y[mine]))
    return {kind: [(x.to(device), y.to(device)) for x, y in b] for kind, b in batches.items()}
