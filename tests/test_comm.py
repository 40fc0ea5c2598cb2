"""Lesson 06b, section 1: the collective-timing harness, the ring drawn, and the cost model.

The harness (mgpu_helpers.comm) runs in a one-process gloo group in this process, with a
counting collective and a recording synchronize, and for real over 2 and 3 ranks. The ring's
steps, the copy reference and the fit are the package's; the formulas (algbw, busbw, the ring
model, the prediction, exercise 1's solution) are the lesson's own, read from its notebook. No
speed is asserted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from matplotlib.patches import FancyArrowPatch, Rectangle

from mgpu_helpers import comm
from mgpu_helpers.comm import (
    copy_bandwidth,
    elements,
    fit_ring_model,
    ring_allreduce_steps,
    size_label,
    time_collective,
)
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import load_lesson_code
from mgpu_helpers.plots import plot_bandwidth, plot_cost_model, plot_ring_allreduce
from mgpu_helpers.timing import Timing

ROOT = Path(__file__).resolve().parents[1]
ALPHA, BETA = 80e-6, 3e9  # the fit must find these again (80 µs, 3 GB/s)
lesson = load_lesson_code(
    "06b",
    (
        "algbw",
        "busbw",
        "ring_allreduce_seconds",
        "predict_allreduce_seconds",
        "two_point_fit",
    ),
    {"torch": torch, "ring_alpha": ALPHA, "ring_beta": BETA},
    folder=ROOT / "notebooks",
)


# --- elements and size_label -------------------------------------------------------------------


def test_elements_counts_whole_elements() -> None:
    assert elements(4096) == 1024
    assert elements(4096, torch.float16) == 2048
    assert elements(8, torch.float64) == 1


@pytest.mark.parametrize("nbytes", [4097, 2, 6])
def test_elements_refuses_part_of_an_element(nbytes: int) -> None:
    with pytest.raises(ValueError, match="not a whole number of torch.float32 elements"):
        elements(nbytes)


@pytest.mark.parametrize("nbytes", [0, -4, 4.0, True, "4"])
def test_elements_refuses_sizes_that_are_not_positive_whole_bytes(nbytes: object) -> None:
    with pytest.raises(ValueError, match="whole number of bytes > 0"):
        elements(nbytes)  # type: ignore[arg-type]


def test_size_label() -> None:
    assert [size_label(s) for s in (100, 1024, 1536, 2**20 * 9.05, 64 * 2**20, 2**30)] == [
        "100 B",
        "1 KiB",
        "1.5 KiB",
        "9.05 MiB",
        "64 MiB",
        "1 GiB",
    ]


# --- the harness in one process ----------------------------------------------------------------


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-process gloo group in this process (no other test here has one open)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_time_collective_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="launch"):
        time_collective(lambda t: None, [1024], "cpu")


def test_time_collective_repeats_and_synchronizes(one_rank_group, monkeypatch) -> None:
    log: list[str] = []
    monkeypatch.setattr(comm, "synchronize", lambda device: log.append("sync"))

    def op(tensor: torch.Tensor) -> None:
        assert tensor.dtype == torch.float32 and tensor.count_nonzero() == 0
        log.append(f"op{tensor.numel()}")
        time.sleep(0.002)

    result = time_collective(op, [1024, 4096], "cpu", repeats=4, warmup=2, min_seconds=0.005)
    assert list(result) == [1024, 4096]
    for timing in result.values():
        assert isinstance(timing, Timing) and len(timing.times) == 4
        assert all(0.002 <= t < 0.5 for t in timing.times)  # per call, never per repeat
    # per size: 2 warm-up calls, one timing call, then 4 repeats of the same number of calls
    ops = [e for e in log if e.startswith("op")]
    per_size = {e: ops.count(e) for e in ("op256", "op1024")}
    for count in per_size.values():
        calls = (count - 3) / 4
        assert calls == int(calls) and 1 <= calls <= 3, per_size  # 0.005 s / 0.002 s per call
    # every clock reading follows a synchronize: each run of ops ends with "sync"
    for i, event in enumerate(log):
        if event.startswith("op") and (i + 1 == len(log) or not log[i + 1].startswith("op")):
            assert log[i + 1 : i + 2] == ["sync"], f"ops not followed by a synchronize at {i}"


def test_time_collective_caps_the_calls_of_tiny_messages(one_rank_group) -> None:
    calls = []
    time_collective(calls.append, [64], "cpu", repeats=2, warmup=0, max_iterations=7)
    assert len(calls) == 1 + 2 * 7  # the timing call, then 2 repeats of the cap


def test_time_collective_checks_every_size_first(one_rank_group) -> None:
    calls = []
    with pytest.raises(ValueError, match="not a whole number"):
        time_collective(calls.append, [1024, 1022], "cpu")
    assert calls == []  # refused before anything ran
    with pytest.raises(ValueError, match="repeats >= 1"):
        time_collective(calls.append, [1024], "cpu", repeats=0)


# --- the harness for real, over 2 and 3 ranks ---------------------------------------------------


def sweep_worker(env, sizes: list[int], slow_rank: int) -> dict:
    """Every rank times an all-reduce; ``slow_rank`` also sleeps 20 ms after each call."""

    def op(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)
        if env.rank == slow_rank:
            time.sleep(0.02)

    return time_collective(op, sizes, env.device, repeats=2, warmup=1, min_seconds=0.0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_time_collective_reports_the_slowest_rank(world_size: int) -> None:
    sizes = [1024, 65536]
    results = launch(sweep_worker, world_size, sizes, world_size - 1, device="cpu", echo=False)
    assert all(r == results[0] for r in results), "every rank returns the slowest rank's times"
    for s in sizes:
        assert len(results[0][s].times) == 2
        assert min(results[0][s].times) >= 0.02, "the slow rank's time, not the fast ranks'"


# --- the ring drawn: what each rank holds after each step ---------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_allreduce_steps_end_with_every_chunk_summed_everywhere(n: int) -> None:
    steps = ring_allreduce_steps(n)
    assert [s.phase for s in steps] == ["start"] + ["reduce-scatter"] * (n - 1) + ["all-gather"] * (
        n - 1
    )
    start = steps[0]
    assert start.holds == tuple(tuple(frozenset([r]) for _ in range(n)) for r in range(n))
    assert start.received == (None,) * n
    everyone = frozenset(range(n))
    for step in steps[1:]:
        assert None not in step.received, "every rank receives one chunk in every step"
    after_reduce_scatter = steps[n - 1]
    for r in range(n):  # rank r holds the full sum of chunk r + 1, and no other yet
        full = [c for c in range(n) if after_reduce_scatter.holds[r][c] == everyone]
        assert full == [(r + 1) % n], (r, after_reduce_scatter.holds[r])
    assert all(chunk == everyone for row in steps[-1].holds for chunk in row)


def test_ring_allreduce_steps_send_2_n_minus_1_chunks_per_rank() -> None:
    n = 5
    received = [step.received for step in ring_allreduce_steps(n)[1:]]
    assert len(received) == 2 * (n - 1)  # one chunk of S/n per step: 2(n-1)/n · S in all
    for step, got in enumerate(received[: n - 1]):  # reduce-scatter: from rank r - 1
        assert got == tuple((r - 1 - step) % n for r in range(n))


@pytest.mark.parametrize("n", [1, 0, -2, 2.0, True, "4"])
def test_ring_allreduce_steps_refuse_what_is_not_a_ring(n: object) -> None:
    with pytest.raises(ValueError, match="whole number of ranks >= 2"):
        ring_allreduce_steps(n)  # type: ignore[arg-type]


# --- the copy reference line -------------------------------------------------------------------


def test_copy_bandwidth_counts_the_bytes_of_every_copy(monkeypatch) -> None:
    seen = {}

    def fake_measure(fn, device, *, repeats):  # 0.5 s per timed call, whatever ran
        fn()
        seen["device"], seen["repeats"] = device, repeats
        return Timing((0.5,) * repeats)

    monkeypatch.setattr(comm, "measure", fake_measure)
    rate, timing = copy_bandwidth(2**20, "cpu", copies=4, repeats=3)
    assert rate == 4 * 2**20 / 0.5 and timing.times == (0.5, 0.5, 0.5)
    assert seen == {"device": "cpu", "repeats": 3}


def test_copy_bandwidth_for_real_and_its_refusals() -> None:
    rate, timing = copy_bandwidth(2**20, "cpu", copies=2, repeats=2)
    assert rate > 0 and len(timing.times) == 2
    with pytest.raises(ValueError, match="copy at least once"):
        copy_bandwidth(2**20, "cpu", copies=0)
    with pytest.raises(ValueError, match="not a whole number"):
        copy_bandwidth(1022, "cpu")


# --- the lesson's arithmetic --------------------------------------------------------------------


def test_algbw_and_busbw_on_numbers_worked_by_hand() -> None:
    algbw = lesson.algbw(2**20, 1e-3)
    assert math.isclose(algbw, 1.048576e9)
    assert lesson.busbw(2**20, 1e-3, 2) == algbw  # 2(n-1)/n = 1
    assert math.isclose(lesson.busbw(2**20, 1e-3, 4), 1.5 * algbw)
    assert math.isclose(lesson.busbw(2**20, 1e-3, 8), 1.75 * algbw)
    assert lesson.busbw(2**20, 1e-3, 1) == 0.0  # one rank sends nothing
    assert math.isclose(lesson.busbw(64 * 2**20, 0.05, 4), 64 * 2**20 / 0.05 * 1.5)


@pytest.mark.parametrize(
    "args", [(0, 1e-3, 2), (-4, 1e-3, 2), (1024, 0.0, 2), (1024, -1.0, 2), (1024, 1e-3, 0)]
)
def test_busbw_refuses_impossible_input(args: tuple) -> None:
    with pytest.raises(ValueError):
        lesson.busbw(*args)


def test_the_ring_model_on_numbers_worked_by_hand() -> None:
    # n = 4: 6 latencies and 6/4 of the message over beta
    assert math.isclose(lesson.ring_allreduce_seconds(3e9, 4, 1e-4, 3e9), 6e-4 + 1.5)
    assert lesson.ring_allreduce_seconds(2**20, 1, 1e-4, 1e9) == 0.0


@pytest.mark.parametrize("n", [2, 3, 8])
def test_the_fit_recovers_known_alpha_and_beta(n: int) -> None:
    sizes = [2**k for k in range(10, 27)]
    exact = [lesson.ring_allreduce_seconds(s, n, ALPHA, BETA) for s in sizes]
    alpha, beta = fit_ring_model(sizes, exact, n)
    assert math.isclose(alpha, ALPHA, rel_tol=1e-6) and math.isclose(beta, BETA, rel_tol=1e-6)
    # +-10% noise in a fixed pattern: both ends still come back to within 10%
    noisy = [t * (1.1 if i % 2 else 0.9) for i, t in enumerate(exact)]
    alpha, beta = fit_ring_model(sizes, noisy, n)
    assert abs(alpha / ALPHA - 1) < 0.1 and abs(beta / BETA - 1) < 0.1, (alpha, beta)


def test_the_fit_weighs_small_and_large_messages_alike() -> None:
    # Only the smallest sizes carry the latency: an unweighted fit in seconds loses it in the
    # large messages' noise, the relative one does not.
    sizes = [2**k for k in range(10, 27)]
    times = [lesson.ring_allreduce_seconds(s, 2, ALPHA, BETA) for s in sizes]
    times[-1] *= 1.05  # 5% noise on the largest message is 8 times the whole latency term
    alpha, _ = fit_ring_model(sizes, times, 2)
    assert abs(alpha / ALPHA - 1) < 0.1, alpha


def test_the_fit_never_returns_a_negative_latency() -> None:
    sizes = [2**k for k in range(10, 20)]
    times = [s / BETA - 1e-7 for s in sizes]  # a line through a negative intercept
    alpha, beta = fit_ring_model(sizes, times, 2)
    assert alpha == 0.0 and math.isclose(beta, BETA, rel_tol=0.1)


def test_the_fit_refuses_what_cannot_be_fitted() -> None:
    with pytest.raises(ValueError, match="n >= 2"):
        fit_ring_model([1024, 2048], [1e-4, 2e-4], 1)
    with pytest.raises(ValueError, match="2 or more sizes"):
        fit_ring_model([1024, 1024], [1e-4, 2e-4], 2)
    with pytest.raises(RuntimeError, match="no positive bandwidth"):
        fit_ring_model([1024, 2**20, 2**24], [3e-3, 2e-3, 1e-3], 2)


def test_predict_uses_the_fitted_model_for_any_world_size() -> None:
    s = 10 * 2**20
    for n in (2, 4, 8):
        expected = 2 * (n - 1) * ALPHA + 2 * (n - 1) / n * s / BETA
        assert math.isclose(lesson.predict_allreduce_seconds(s, n), expected)
    assert lesson.predict_allreduce_seconds(s, 1) == 0.0
    with pytest.raises(ValueError, match="n >= 1"):
        lesson.predict_allreduce_seconds(s, 0)


def test_exercise_1_solution_goes_through_both_points() -> None:
    for n in (2, 4, 8):
        points = [(s, lesson.ring_allreduce_seconds(s, n, ALPHA, BETA)) for s in (4096, 2**24)]
        alpha, beta = lesson.two_point_fit(*points, n)
        assert math.isclose(alpha, ALPHA, rel_tol=1e-6) and math.isclose(beta, BETA, rel_tol=1e-9)
    with pytest.raises(ValueError):
        lesson.two_point_fit((4096, 1e-4), (4096, 2e-4), 2)


# --- the plots ---------------------------------------------------------------------------------


def test_plot_bandwidth_draws_equal_curves_once() -> None:
    sizes = [1024, 2048, 4096]
    fig = plot_bandwidth(sizes, {"busbw": [1e6, 2e6, 3e6], "algbw": [1e6, 2e6, 3e6]}, ceiling=1e9)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["busbw = algbw", "memory copy (reference)"]  # 2 ranks: one curve
    fig = plot_bandwidth(sizes, {"busbw": [1.5, 3.0, 4.5], "algbw": [1.0, 2.0, 3.0]})
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["busbw", "algbw"]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1 KiB", "2 KiB", "4 KiB"]
    with pytest.raises(ValueError, match="need one"):
        plot_bandwidth(sizes, {"busbw": [1.0, 2.0]})


def test_plot_cost_model() -> None:
    fig = plot_cost_model([1024, 2048], [1e-3, 2e-3], [1.1e-3, 1.9e-3], spread=[(1e-3, 2e-3)] * 2)
    assert fig.axes[0].get_yscale() == "log" and fig.axes[0].get_xscale() == "log"
    with pytest.raises(ValueError, match="one time and one model time per size"):
        plot_cost_model([1024, 2048], [1e-3], [1e-3, 2e-3])
    with pytest.raises(ValueError, match="per size"):
        plot_cost_model([1024], [1e-3], [1e-3], spread=[])


@pytest.mark.parametrize("n", [2, 4, 6])
def test_plot_ring_allreduce_draws_every_chunk_of_every_step(n: int) -> None:
    fig = plot_ring_allreduce(n)
    ax = fig.axes[0]
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    steps = 2 * (n - 1) + 1  # the start, then every step
    assert len(boxes) == n * n * steps  # n chunks per rank, every row
    assert len(arrows) == n  # rank r to r + 1, and the last back to rank 0
    received = [b for b in boxes if b.get_linewidth() > 1]  # the red edges
    assert len(received) == n * (steps - 1), "one chunk received per rank per step"
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("all") == sum(
        chunk == frozenset(range(n))
        for s in ring_allreduce_steps(n)
        for row in s.holds
        for chunk in row
    )
    assert {f"rank {r}" for r in range(n)} <= set(texts)
    assert f"{2 * (n - 1)} chunks of S/{n}" in ax.get_title()


@pytest.mark.parametrize("n", [1, 9, 2.0, True])
def test_plot_ring_allreduce_refuses_rings_it_cannot_draw(n: object) -> None:
    with pytest.raises(ValueError, match="2 to 8 ranks"):
        plot_ring_allreduce(n)  # type: ignore[arg-type]


# --- on a GPU: the clock waits for the device -----------------------------------------------------


@pytest.mark.gpu
def test_time_collective_waits_for_the_gpu(one_rank_group) -> None:
    """A kernel that keeps the GPU busy 20 ms or more per call must show in the time: without
    the synchronize the host would read the clock while the kernel still runs (microseconds)."""

    def op(tensor: torch.Tensor) -> None:
        torch.cuda._sleep(50_000_000)  # 50 M clock cycles: 20-50 ms at 1-2.5 GHz, queued

    result = time_collective(op, [4096], "cuda:0", repeats=2, warmup=1, min_seconds=0.0)
    assert min(result[4096].times) >= 0.01, result[4096].times


@pytest.mark.multigpu
def test_time_collective_over_nccl() -> None:
    sizes = [1024, 2**20]
    results = launch(sweep_worker, 2, sizes, -1, device="cuda", echo=False)
    assert all(r == results[0] for r in results)
    assert all(len(results[0][s].times) == 2 and results[0][s].median > 0 for s in sizes)
