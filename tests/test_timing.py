"""measure(): warm-up, repeats, median, and synchronising the device around the clock."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from mgpu_helpers.timing import Timing, compare, measure, measure_alternating, synchronize


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


def test_measure_alternating_runs_in_rotating_rounds(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr("mgpu_helpers.timing.synchronize", lambda device: events.append("sync"))
    fns = {name: (lambda name=name: events.append(name)) for name in ("a", "b", "c")}
    result = measure_alternating(fns, "cuda:0", warmup=1, repeats=3)
    assert events == (
        ["a", "b", "c", "sync"]  # warm-up of each, then wait for it
        + ["a", "sync", "b", "sync", "c", "sync"]  # round 1
        + ["b", "sync", "c", "sync", "a", "sync"]  # round 2 starts with the next one
        + ["c", "sync", "a", "sync", "b", "sync"]
    )
    assert list(result) == ["a", "b", "c"]
    assert all(len(t.times) == 3 for t in result.values())


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
    assert text.startswith("no measurable difference") and "a ratio would mean nothing" in text
    assert "0.50x to 2.00x" in text
    assert verdict.brief() == "no verdict (0.50x to 2.00x)"


def test_compare_needs_five_rounds_for_a_verdict():
    verdict = compare(Timing((1.0, 1.0, 1.0)), Timing((2.0, 2.0, 2.0)))  # unanimous, but 3
    assert verdict.p_value == pytest.approx(0.25) and not verdict.meaningful
    assert "too few" in verdict.describe("a", "b")


def test_compare_rejects_timings_of_different_lengths():
    with pytest.raises(ValueError, match="measure_alternating"):
        compare(Timing((1.0,)), Timing((1.0, 2.0)))
