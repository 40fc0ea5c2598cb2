"""Lesson 06b, section 2 (scaling): the lesson's worker and bounds, and mgpu_helpers.scaling.

One launch measures every world size 1 .. N on process groups of the first n ranks. These tests
run the lesson's worker, read from its notebook, on 2 and 3 real gloo processes, with a small
MLP and one round, and check what the lesson claims of it: strong scaling gives the one-rank
gradient at every world size that splits the global batch evenly, weak scaling does not (a
larger global batch), the sample counts, and that every world size got its timings. The
package's timers run for real too. Speed is never asserted here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code
from mgpu_helpers.placement import place
from mgpu_helpers.plots import plot_scaling
from mgpu_helpers.scaling import (
    allreduce_seconds,
    scaling_batches,
    slowest,
    step_seconds,
    time_in_rounds,
)
from mgpu_helpers.timing import Comparison

ROOT = Path(__file__).resolve().parents[1]
NAMES = [
    "make_model",
    "make_batch",
    "scaling_groups",
    "SCALING_KINDS",
    "scaling_worker",
    "predicted_efficiency",
]
# The head's parameters, made small (the lesson's names, so its code reads them unchanged).
PARAMETERS = {"WIDTH": 64, "DEPTH": 2, "BATCH_SIZE": 4, "SEED": 0, "IN_FEATURES": 16, "CLASSES": 10}
LESSON = load_lesson_code(
    "06b",
    NAMES,
    {**lesson_imports("06b", ROOT / "notebooks"), **PARAMETERS},  # the lesson's own imports
    folder=ROOT / "notebooks",
)


def run(placement, per_rank: int, rounds: int = 1) -> dict:
    results = launch(LESSON.scaling_worker, placement, per_rank, 2, rounds, echo=False, timeout=60)
    assert all(r is None for r in results[1:]), "only rank 0 returns the measurements"
    return results[0]


def check_scaling(result: dict, world: int, per_rank: int, rounds: int = 1) -> None:
    global_batch = per_rank * world
    assert result["global_batch"] == global_batch
    for n in range(1, world + 1):
        assert result["samples"]["weak", n] == n * per_rank, f"weak, {n} ranks"
        assert result["samples"]["strong", n] == n * (global_batch // n), f"strong, {n} ranks"
        if global_batch % n == 0:  # the same global batch, split: the one-rank gradient
            assert result["errors"]["strong", n] < 1e-5, f"strong, {n} ranks: {result['errors']}"
        if n > 1:  # more samples averaged: a different gradient
            assert result["errors"]["weak", n] > 1e-3, f"weak, {n} ranks: {result['errors']}"
        for kind in LESSON.SCALING_KINDS:
            times = result["times"][kind, n]
            assert len(times) == rounds and all(t > 0 for t in times), f"{kind}, {n} ranks: {times}"


@pytest.mark.parametrize(("world", "per_rank"), [(2, 4), (3, 3)])
def test_one_launch_measures_every_world_size(world: int, per_rank: int) -> None:
    # (3, 3): a global batch of 9 does not split over 2 ranks; each takes 4, 8 samples in all
    check_scaling(run(place(world, "cpu"), per_rank), world, per_rank)


@pytest.mark.gpu
def test_ranks_sharing_one_gpu() -> None:
    check_scaling(run(place(2, "cuda", share_gpus=True), 4), 2, 4)


@pytest.mark.multigpu
def test_one_gpu_per_rank_nccl() -> None:
    check_scaling(run(place(2, "cuda"), 4), 2, 4)  # NCCL where torch has it


def test_predicted_efficiency() -> None:
    # weak: 2 ranks do twice the samples; compute 10 ms, all-reduce 5 ms
    assert LESSON.predicted_efficiency(2, 2, 10.0, 10.0, 5.0) == pytest.approx((10 / 15, 1.0))
    # compute slowed to 20 ms by sharing the hardware: at most half the ideal
    assert LESSON.predicted_efficiency(2, 2, 10.0, 20.0, 5.0) == pytest.approx((0.4, 0.5))
    # strong: the same 64 samples on 4 ranks, each computing 4 ms, all-reduce 5 ms
    assert LESSON.predicted_efficiency(4, 1, 16.0, 4.0, 5.0) == pytest.approx((16 / 36, 16 / 20))


# --- mgpu_helpers.scaling ----------------------------------------------------------------------


def fake_batch(rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples numbered so that a slice says where it came from: 1000·rank + 100·step + i."""
    x = torch.tensor([[1000.0 * rank + 100 * step + i] for i in range(size)])
    return x, torch.zeros(size, dtype=torch.long)


def test_scaling_batches_weak_keeps_its_own_strong_takes_its_slice() -> None:
    got = scaling_batches(fake_batch, 1, 3, 2, 4, 9, "cpu")
    assert [x.flatten().tolist() for x, _ in got["weak"]] == [
        [1000.0, 1001.0, 1002.0, 1003.0],  # rank 1's own 4 samples of step 0
        [1100.0, 1101.0, 1102.0, 1103.0],
    ]
    # strong: rank 0's global batch of 9 samples, 3 each; rank 1 holds samples 3, 4, 5
    assert [x.flatten().tolist() for x, _ in got["strong"]] == [
        [3.0, 4.0, 5.0],
        [103.0, 104.0, 105.0],
    ]
    uneven = scaling_batches(fake_batch, 1, 2, 1, 4, 9, "cpu")["strong"]  # 9 over 2: 4 each
    assert uneven[0][0].flatten().tolist() == [4.0, 5.0, 6.0, 7.0]


@pytest.mark.parametrize(("rank", "n", "global_batch"), [(2, 2, 8), (-1, 2, 8), (0, 4, 3)])
def test_scaling_batches_refuses_ranks_and_batches_that_do_not_fit(
    rank: int, n: int, global_batch: int
) -> None:
    with pytest.raises(ValueError, match="is not one of|nothing each"):
        scaling_batches(fake_batch, rank, n, 1, 4, global_batch, "cpu")


def test_the_timers_refuse_nothing_to_time() -> None:
    with pytest.raises(ValueError, match="at least one"):
        step_seconds(None, None, [])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one all-reduce"):
        allreduce_seconds(torch.zeros(4), calls=0)
    with pytest.raises(ValueError, match="at least one round"):
        time_in_rounds({}, [1], 0, torch.device("cpu"))


def timers_worker(env: DistEnv, rounds: int) -> dict:
    """Every rank: slowest, the two DDP timers and the all-reduce timer, then time_in_rounds."""
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(8, 3))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(1 + env.rank)  # each rank its own data
    batches = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(2)]
    calls: list[str] = []

    def timer(name: str, seconds: float):
        def run() -> float:
            calls.append(name)
            return seconds

        return run

    before = [p.detach().clone() for p in ddp.parameters()]
    synced = step_seconds(ddp, optimizer, batches)
    after_sync = [p.detach().clone() for p in ddp.parameters()]
    alone = step_seconds(ddp, optimizer, batches, sync=False)
    both = {n: {name: timer(name, 0.1 * n) for name in "abc"} for n in (1, 2) if env.rank < n}
    times = time_in_rounds(both, [1, 2], rounds, env.device)
    return {
        "slowest": slowest(float(env.rank + 1), env.device),
        "synced": synced,
        "alone": alone,
        "moved": any(not torch.equal(a, b) for a, b in zip(before, after_sync, strict=True)),
        "replicas": [p.detach().clone() for p in ddp.parameters()],
        "allreduce": allreduce_seconds(torch.ones(1024), calls=3),
        "times": times,
        "calls": calls,
    }


def test_the_timers_for_real_on_two_ranks() -> None:
    rounds = 4
    results = launch(timers_worker, 2, rounds, device="cpu", echo=False, timeout=60)
    for r in results:
        assert r["slowest"] == 2.0, "the largest of the ranks' values"
        assert r["synced"] > 0 and r["alone"] > 0 and r["allreduce"] > 0
        assert r["moved"], "step_seconds takes optimizer steps"
    # after steps inside no_sync on different data, the replicas drift apart
    pairs = zip(results[0]["replicas"], results[1]["replicas"], strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)
    times, calls = results[0]["times"], results[0]["calls"]
    assert times == {(name, n): [0.1 * n] * rounds for n in (1, 2) for name in "abc"}
    assert len(calls) == 6 * (rounds + 1), "one warm-up round, dropped, then every round"
    per_round = [tuple(calls[i : i + 6]) for i in range(0, len(calls), 6)]
    assert len(set(per_round)) > 1, "the order changes from round to round"
    assert results[1]["times"] == {(name, 2): [0.2] * rounds for name in "abc"}, (
        "rank 1 is in world size 2 only"
    )


# --- the scaling plot --------------------------------------------------------------------------


def test_plot_scaling_draws_speed_up_efficiency_and_the_predicted_band() -> None:
    ns = [1, 2, 4]
    weak = [Comparison((1.0, 1.0, 1.0)), Comparison((1.6, 1.8, 1.7)), Comparison((3.0, 3.4, 3.2))]
    fig = plot_scaling(ns, {"weak": weak}, {"weak": [(1.0, 1.0), (0.8, 0.9), (0.7, 0.85)]})
    speed_up, efficiency = fig.axes
    assert [t.get_text() for t in speed_up.get_legend().get_texts()] == [
        "linear (ideal)",
        "weak, measured",
    ]
    assert "weak, predicted" in [t.get_text() for t in efficiency.get_legend().get_texts()]
    assert len(efficiency.collections) >= 1  # the band between the two predictions
    # efficiency = speed-up / n, drawn at the medians
    drawn = [line for line in efficiency.get_lines() if list(line.get_xdata()) == ns]
    assert any(list(line.get_ydata()) == [1.0, 0.85, 0.8] for line in drawn)
    with pytest.raises(ValueError, match="need one"):
        plot_scaling(ns, {"weak": weak[:2]}, {})
    with pytest.raises(ValueError, match="need one"):
        plot_scaling(ns, {"weak": weak}, {"weak": [(1.0, 1.0)]})


def test_plot_scaling_draws_no_verdict_hollow() -> None:
    ns = [1, 2, 3]
    agreed = Comparison((1.8, 1.9, 1.7, 1.8, 2.0))  # all 5 rounds faster: a verdict
    torn = Comparison((0.8, 1.3, 0.9, 1.2, 1.1))  # the rounds disagree: no verdict
    fig = plot_scaling(ns, {"weak": [Comparison((1.0,) * 5), agreed, torn]}, {})
    for ax, y in zip(fig.axes, (1.1, 1.1 / 3), strict=True):
        hollow = [line for line in ax.get_lines() if line.get_markerfacecolor() == "white"]
        assert [(list(h.get_xdata()), list(h.get_ydata())) for h in hollow] == [([3], [y])]
