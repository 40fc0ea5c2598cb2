"""measure() and measure_alternating(): warm-up, repeats, medians, synchronising the device around
the clock, the order of the rounds, and lining up the ranks (their real multi-process runs are in
test_timing_ranks.py)."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist

from mgpu_helpers.timing import (
    Timing,
    compare,
    measure,
    measure_alternating,
    round_orders,
    synchronize,
)


def test_measure_counts_warmup_and_repeats():
    calls = []
    result = measure(lambda: calls.append(1), warmup=3, repeats=4)
    assert len(calls) == 3 + 4
    assert isinstance(result, Timing)
    assert len(result.times) == 4
    assert all(t >= 0 for t in result.times)


def test_measure_without_warmup():
    calls = []
    result = measure(lambda: calls.append(1), warmup=0, repeats=1)
    assert len(calls) == 1 and len(result.times) == 1


def test_measure_synchronises_after_warmup_and_after_every_timed_call(monkeypatch):
    events: list[str] = []

    def record_sync(device: str) -> None:
        events.append(f"sync {device}")

    monkeypatch.setattr("mgpu_helpers.timing.synchronize", record_sync)
    measure(lambda: events.append("call"), "cuda:0", warmup=2, repeats=3)
    assert events == ["call", "call", "sync cuda:0"] + ["call", "sync cuda:0"] * 3


@pytest.mark.parametrize(("warmup", "repeats"), [(-1, 5), (2, 0), (0, -3)])
def test_measure_rejects_bad_counts(warmup, repeats):
    calls = []
    with pytest.raises(ValueError, match="warmup >= 0 and repeats >= 1"):
        measure(lambda: calls.append(1), warmup=warmup, repeats=repeats)
    assert calls == []  # nothing ran before the check


def test_timing_median_spread_and_str():
    t = Timing((0.003, 0.001, 0.002, 0.010))
    assert t.median == statistics.median(t.times) == 0.0025
    assert t.spread == pytest.approx((0.010 - 0.001) / 0.0025)
    assert str(t) == "median 2.500 ms over 4 repeats"
    assert Timing((0.0, 0.0)).spread == 0.0


def test_measure_median_ignores_one_slow_repeat(monkeypatch):
    clock = iter([0.0, 1.0, 10.0, 11.0, 20.0, 121.0, 130.0, 131.0])  # durations 1, 1, 101, 1
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))  # timing.py's clock
    result = measure(lambda: None, warmup=0, repeats=4)
    assert result.times == (1.0, 1.0, 101.0, 1.0)
    assert result.median == 1.0


def _forbid(*args, **kwargs):
    raise AssertionError("a CUDA/MPS call on the CPU path")


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_synchronize_on_cpu_is_a_no_op(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "synchronize", _forbid)
    monkeypatch.setattr(torch.mps, "synchronize", _forbid)
    assert synchronize(device) is None


def test_synchronize_waits_for_the_named_cuda_device(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: seen.append(dev))
    synchronize("cuda:1")
    assert seen == [torch.device("cuda", 1)]


def test_synchronize_mps(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: seen.append("mps"))
    synchronize("mps")
    assert seen == ["mps"]


@pytest.mark.gpu
def test_measure_on_a_gpu_times_the_work_not_the_launch():
    x = torch.randn(2048, 2048, device="cuda")
    result = measure(lambda: x @ x, "cuda", warmup=2, repeats=3)
    assert len(result.times) == 3 and result.median > 0
    assert torch.cuda.current_stream().query()  # all queued work has finished


def test_synchronize_several_devices_waits_for_each(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: seen.append(dev))
    synchronize(["cuda:0", torch.device("cuda", 1), "cpu"])
    assert seen == [torch.device("cuda", 0), torch.device("cuda", 1)]
    seen.clear()
    synchronize(("cuda:1",))
    assert seen == [torch.device("cuda", 1)]


def test_measure_on_several_devices_waits_for_all_of_them(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: seen.append(dev.index))
    measure(lambda: None, ["cuda:0", "cuda:1"], warmup=1, repeats=2)
    assert seen == [0, 1] * 3  # after the warm-up, then after each timed call


# --- measure_alternating and compare (lesson 03's like-for-like comparison) ------------------


def test_measure_alternating_runs_in_rounds_of_varying_order(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr("mgpu_helpers.timing.synchronize", lambda device: events.append("sync"))
    fns = {name: (lambda name=name: events.append(name)) for name in ("a", "b", "c")}
    result = measure_alternating(fns, "cuda:0", warmup=1, repeats=3)
    assert events == (
        ["a", "b", "c", "sync"]  # warm-up of each, then wait for it
        + ["a", "sync", "b", "sync", "c", "sync"]  # round 1
        + ["c", "sync", "b", "sync", "a", "sync"]  # round 2: the reverse, so b follows c too
        + ["b", "sync", "c", "sync", "a", "sync"]  # round 3: the next row of round_orders
    )
    assert list(result) == ["a", "b", "c"]
    assert all(len(t.times) == 3 for t in result.values())


def test_measure_alternating_keeps_round_i_in_times_i(monkeypatch):
    """compare() pairs times[i] of two functions: both must come from round i."""
    clock = {"now": 0.0, "round": 0, "calls": 0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])

    def work(cost: float):
        def run() -> None:  # takes cost + the round's number, in fake seconds
            clock["now"] += cost + clock["round"]
            clock["calls"] += 1
            clock["round"] = clock["calls"] // 3  # 3 functions: a new round every 3 calls

        return run

    fns = {"x": work(0.1), "y": work(0.2), "z": work(0.4)}
    result = measure_alternating(fns, warmup=0, repeats=6)
    for name, cost in (("x", 0.1), ("y", 0.2), ("z", 0.4)):
        assert result[name].times == pytest.approx([cost + r for r in range(6)])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_round_orders_puts_every_function_after_every_other(n):
    period = n if n % 2 == 0 else 2 * n if n > 1 else 1
    orders = round_orders(n, period)
    assert all(sorted(order) == list(range(n)) for order in orders)  # each once per round
    follows = Counter(pair for order in orders for pair in pairwise(order))
    each = 1 if n % 2 == 0 else 2
    assert follows == {(a, b): each for a in range(n) for b in range(n) if a != b}
    first = Counter(order[0] for order in orders)  # none always first either
    assert first == {i: period // n for i in range(n)}


def test_round_orders_is_the_same_sequence_for_the_same_inputs():
    assert round_orders(5, 23) == round_orders(5, 23)  # every rank computes the same
    assert round_orders(4, 9)[:4] == round_orders(4, 4)  # more rounds only extend it
    assert round_orders(4, 9)[4:8] == round_orders(4, 4)  # by repeating the rows
    assert round_orders(3, 0) == []
    assert round_orders(2, 4) == [(0, 1), (1, 0), (0, 1), (1, 0)]


def test_round_orders_no_longer_keeps_a_fixed_successor():
    """A rotation (ABC, BCA, CAB) keeps B right after A in 2 rounds of 3; these orders do not."""
    after_a = Counter(order[order.index(0) + 1] for order in round_orders(3, 6) if order[-1] != 0)
    assert after_a == {1: 2, 2: 2}


def test_round_orders_rejects_bad_input():
    with pytest.raises(ValueError, match="n >= 1"):
        round_orders(0, 3)
    with pytest.raises(ValueError, match="rounds >= 0"):
        round_orders(3, -1)


class _Recorder:
    """Stands in for torch.distributed and the clock: writes down what happens, in order."""

    def __init__(self, monkeypatch, backend: str) -> None:
        self.events: list[str] = []
        self.now = 0.0
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(dist, "barrier", self.barrier)
        monkeypatch.setattr(time, "perf_counter", self.clock)
        monkeypatch.setattr("mgpu_helpers.timing.synchronize", self.sync)

    def barrier(self, group=None, device_ids=None) -> None:
        self.events.append(f"barrier {group} {device_ids}")

    def clock(self) -> float:
        self.events.append("clock")
        return self.now

    def sync(self, device) -> None:
        self.events.append(f"sync {device}")


def test_measure_alternating_lines_up_the_ranks_outside_the_clock(monkeypatch):
    rec = _Recorder(monkeypatch, "gloo")
    fns = {name: (lambda name=name: rec.events.append(name)) for name in ("a", "b")}
    measure_alternating(fns, "cpu", warmup=1, repeats=2, group="g")
    line_up = ["sync cpu", "barrier g None", "clock"]  # this rank's work done, then every rank's

    def timed(name: str) -> list[str]:
        return [*line_up, name, "sync cpu", "clock"]

    warm_up = ["a", "b", "sync cpu"]
    assert rec.events == warm_up + timed("a") + timed("b") + timed("b") + timed("a")


def test_measure_alternating_runs_nccls_barrier_on_the_ranks_own_gpu(monkeypatch):
    rec = _Recorder(monkeypatch, "nccl")
    measure_alternating({"a": lambda: rec.events.append("a")}, "cuda:3", warmup=0, repeats=1)
    assert rec.events == [
        "sync cuda:3",  # after the (empty) warm-up
        "sync cuda:3",  # this GPU's queued work first,
        "barrier None [3]",  # then the barrier, on this rank's GPU (no guess)
        f"sync {torch.device('cuda', 3)}",  # which the host waits for before the clock
        "clock", "a", "sync cuda:3", "clock",
    ]  # fmt: skip


def test_measure_alternating_can_time_on_one_rank_alone(monkeypatch):
    rec = _Recorder(monkeypatch, "gloo")
    measure_alternating({"a": lambda: None}, warmup=0, repeats=2, sync_ranks=False)
    assert not any(e.startswith("barrier") for e in rec.events)


def test_measure_alternating_shares_a_slow_spell_between_both():
    """A machine that slows down half-way hurts both functions alike, not the one timed last."""
    clock = {"calls": 0}

    def work() -> None:  # the same work; the machine is 3x slower for the second half
        clock["calls"] += 1
        time.sleep(0.01 if clock["calls"] <= 6 else 0.03)

    sequential = {name: measure(work, warmup=0, repeats=6) for name in ("first", "second")}
    assert compare(sequential["second"], sequential["first"]).median < 0.5  # a false "2x"
    clock["calls"] = 0
    alternating = measure_alternating({"first": work, "second": work}, warmup=0, repeats=6)
    verdict = compare(alternating["second"], alternating["first"])
    assert 0.6 < verdict.median < 1.6


def test_measure_alternating_rejects_bad_input():
    with pytest.raises(ValueError, match="nothing to time"):
        measure_alternating({})
    with pytest.raises(ValueError, match="repeats >= 1"):
        measure_alternating({"a": lambda: None}, repeats=0)


def test_compare_ratio_and_sign_test():
    fast, slow = Timing((1.0, 1.1, 0.9, 1.0, 1.2)), Timing((2.0, 2.1, 2.0, 1.9, 2.4))
    verdict = compare(fast, slow)
    assert verdict.ratios == pytest.approx((2.0, 2.1 / 1.1, 2.0 / 0.9, 1.9, 2.0))
    assert verdict.median == pytest.approx(2.0)
    assert verdict.p_value == pytest.approx(2 / 32)
    assert verdict.meaningful
    assert verdict.describe("A", "B").startswith("A ran 2.00x as fast as B")
    assert verdict.brief() == "2.00x"


def test_compare_says_when_the_rounds_disagree():
    a, b = Timing((1.0, 2.0, 1.0, 2.0, 1.0, 2.0)), Timing((2.0, 1.0, 2.0, 1.0, 2.0, 1.5))
    verdict = compare(a, b)
    assert verdict.low < 1 < verdict.high
    assert verdict.p_value == 1.0 and not verdict.meaningful
    text = verdict.describe("DataParallel", "one device")
    assert text.startswith("no verdict on DataParallel against one device: the rounds disagree")
    assert "6 rounds do not resolve a difference smaller than their spread" in text
    assert "equal" not in text and "no measurable difference" not in text  # not equality
    assert "0.50x to 2.00x" in text
    assert verdict.brief() == "no verdict (0.50x to 2.00x)"


def test_compare_needs_five_rounds_for_a_verdict():
    verdict = compare(Timing((1.0, 1.0, 1.0)), Timing((2.0, 2.0, 2.0)))  # unanimous, but 3
    assert verdict.p_value == pytest.approx(0.25) and not verdict.meaningful
    assert "too few" in verdict.describe("a", "b")


def test_compare_rejects_timings_of_different_lengths():
    with pytest.raises(ValueError, match="measure_alternating"):
        compare(Timing((1.0,)), Timing((1.0, 2.0)))
