"""measure(): warm-up, repeats, median, and synchronising the device around the clock."""

from __future__ import annotations

import statistics

import pytest
import torch

import mgpu_helpers.timing as timing
from mgpu_helpers.timing import Timing, measure, synchronize


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
    monkeypatch.setattr(timing, "synchronize", lambda device: events.append(f"sync {device}"))
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
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
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
