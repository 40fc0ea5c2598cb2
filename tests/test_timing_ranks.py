"""measure_alternating across ranks (lessons 06a, 06b), with real processes over gloo on the CPU.

In a distributed run every rank times the same functions. A rank that is still working when the
others start the next function makes them wait at that function's first collective, and without
a barrier that wait is charged to whichever function comes next. These tests build that skew on
purpose, with sleeps: they measure where the waiting lands, not how fast anything is.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.timing import Timing, compare, measure_alternating

LATE = 0.3  # seconds rank 1 spends in "late" (rank 0: none)
ROUNDS = 5


def late_then_collective(env: DistEnv) -> dict[bool, dict[str, tuple[float, ...]]]:
    """Rank 1 works LATE seconds longer in "late"; "collective" is one tiny all-reduce.

    Timed twice in one launch: with the ranks lined up (sync_ranks=True), then without.
    """

    def late() -> None:
        if env.rank == 1:
            time.sleep(LATE)

    def collective() -> None:
        dist.all_reduce(torch.ones(1))

    fns = {"late": late, "collective": collective}
    runs = {}
    for sync_ranks in (True, False):
        times = measure_alternating(fns, "cpu", warmup=1, repeats=ROUNDS, sync_ranks=sync_ranks)
        runs[sync_ranks] = {name: t.times for name, t in times.items()}
    return runs


def test_a_late_rank_no_longer_leaks_into_the_next_function() -> None:
    ranks = launch(late_then_collective, 2, device="cpu", echo=False)
    fair, unfair = ranks[0][True], ranks[0][False]  # rank 0's, with and without lining up
    # rank 1's own work is counted, in both runs
    for run in (ranks[1][True], ranks[1][False]):
        assert min(run["late"]) > 0.9 * LATE, run
    # without lining up the ranks, rank 0's all-reduce waits for every one of rank 1's sleeps
    # (measured: the 5 sleeps, 1.5 s in all, in 3 of the 5 rounds); half of that is a generous
    # margin
    assert sum(unfair["collective"]) > 0.5 * ROUNDS * LATE, unfair
    # with it, the wait happens at the barrier, outside the clock: the all-reduce stays small in
    # every round (measured: under 5 ms each on a busy 2-core machine). The bound, 150 ms, is
    # half of one sleep: a single sleep leaking into one round would break it.
    assert max(fair["collective"]) < 0.5 * LATE, fair


DRIFT = 0.04  # seconds rank 1 works longer in each of the two drifting functions
WORK = 0.01  # seconds every rank works in each of the three identical functions
SAME_ROUNDS = 10


def identical_after_drift(env: DistEnv) -> dict[str, Timing]:
    """Two drifting functions without collectives, then three identical ones with one each.

    In this order a plain rotation (the order before issue 22's fix) puts "same A" right after
    the drifting pair in every round and "same B" never: without a barrier rank 0's "same A"
    waited for rank 1 in all 10 rounds and the rounds gave a false verdict.
    """

    def drift() -> None:
        if env.rank == 1:
            time.sleep(DRIFT)

    def same() -> None:
        dist.all_reduce(torch.ones(1))
        time.sleep(WORK)

    fns = {"drift 1": drift, "drift 2": drift, "same A": same, "same C": same, "same B": same}
    return measure_alternating(fns, "cpu", warmup=1, repeats=SAME_ROUNDS)


def test_two_identical_functions_get_no_verdict_across_ranks() -> None:
    # Identical functions still make each round a coin toss, and 9 or more of 10 tosses landing
    # the same way happens by chance with probability 2 * 11 / 1024 (2%): a verdict is measured
    # once more, and a chance verdict twice in a row has probability 0.05%. The biased timing
    # gave a verdict every time (A slower in 10 rounds of 10).
    for _ in range(2):
        times = launch(identical_after_drift, 2, device="cpu", echo=False)[0]  # rank 0's
        verdict = compare(times["same A"], times["same B"])
        if not verdict.meaningful:
            break
    assert not verdict.meaningful, verdict.describe("same A", "same B")
    assert 0.5 < verdict.median < 2.0, verdict.describe("same A", "same B")
