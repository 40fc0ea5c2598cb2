"""mgpu_helpers.loader_timing (lesson 02, section 9): alternating rounds over loaders, tables."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mgpu_helpers.loader_timing import (
    FirstBatches,
    LoaderTiming,
    first_batch_table,
    loader_table,
    time_first_batches,
    time_loaders,
    worker_start_method,
)
from mgpu_helpers.timing import Timing, round_orders


def _loader(n: int, batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size)


def test_time_loaders_runs_a_warm_up_then_balanced_rounds_and_drops_the_warm_up() -> None:
    loaders = {"a": _loader(8), "b": _loader(12), "c": _loader(4)}
    calls: list[str] = []
    name_of = {id(loader): name for name, loader in loaders.items()}

    def epoch(loader: DataLoader) -> float:
        calls.append(name_of[id(loader)])
        return 0.5 if len(calls) <= 3 else 0.0  # only the warm-up epochs "wait"

    timings = time_loaders(loaders, epoch, rounds=4, progress=False)
    assert calls[:3] == ["a", "b", "c"]  # the untimed epoch of each
    names = list(loaders)
    expected = [names[i] for order in round_orders(3, 4) for i in order]
    assert calls[3:] == expected  # measure_alternating's balanced order
    for name, t in timings.items():
        assert len(t.timing.times) == 4 and t.waited == (0.0,) * 4  # warm-up dropped
        assert t.samples == len(loaders[name].dataset)


def test_loader_timing_reports_throughput_and_the_median_share_of_waiting() -> None:
    t = LoaderTiming(100, Timing((1.0, 2.0, 4.0)), (0.5, 0.5, 3.0))
    assert t.samples_per_sec == 50.0  # 100 samples / the median epoch (2 s)
    assert t.waiting_share == 0.5  # shares 0.5, 0.25, 0.75


def test_loader_table_quotes_a_ratio_only_where_the_rounds_agree() -> None:
    base = LoaderTiming(64, Timing((1.0,) * 5), (0.9,) * 5)
    faster = LoaderTiming(64, Timing((0.5,) * 5), (0.1,) * 5)
    noisy = LoaderTiming(64, Timing((0.5, 2.0, 0.5, 2.0, 1.0)), (0.1,) * 5)
    table = loader_table({"0 workers": base, "2 workers": faster, "1 worker": noisy}, "0 workers")
    lines = table.splitlines()
    assert "speed vs 0 workers" in lines[0] and all(len(line) <= 100 for line in lines)
    assert lines[1].rstrip().endswith("90%")  # the baseline row has no ratio
    assert "2.00x" in lines[2] and "no verdict" not in lines[2]
    assert "no verdict (0.50x to 2.00x)" in lines[3]
    assert "speed vs" not in loader_table({"x": base})
    with pytest.raises(ValueError, match="baseline 'y' is not one of x"):
        loader_table({"x": base}, "y")


def test_time_first_batches_builds_a_fresh_loader_each_round() -> None:
    built: list[str] = []

    def new(name: str) -> DataLoader:
        built.append(name)
        return _loader(8)

    results = time_first_batches(
        {"p": lambda: new("p"), "q": lambda: new("q")}, epochs=3, rounds=5, progress=False
    )
    assert built.count("p") == built.count("q") == 6  # 5 rounds and the untimed one
    for r in results.values():
        assert len(r.timing.times) == 5 and len(r.waits) == 5
        assert all(len(w) == 3 and all(s > 0 for s in w) for w in r.waits)
        assert len(r.median_waits) == 3


def test_first_batch_table_prints_the_median_wait_per_epoch_in_ms() -> None:
    result = FirstBatches(
        Timing((1.0, 1.0, 1.0)), ((0.1, 0.02, 0.03), (0.3, 0.02, 0.01), (0.2, 0.04, 0.02))
    )
    assert result.median_waits == pytest.approx([0.2, 0.02, 0.02])
    lines = first_batch_table({"persistent": result}).splitlines()
    assert lines[0].split() == ["epoch", "1", "epoch", "2", "epoch", "3"]
    assert lines[1].split() == ["persistent", "200.0", "ms", "20.0", "ms", "20.0", "ms"]


@pytest.mark.parametrize("rounds", [0, -1, 2.5, True])
def test_rounds_must_be_a_whole_number_of_at_least_one(rounds: object) -> None:
    with pytest.raises(ValueError, match="whole number"):
        time_loaders({"a": _loader(4)}, lambda loader: 0.0, rounds=rounds, progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="whole number"):
        time_first_batches({"a": lambda: _loader(4)}, epochs=rounds, progress=False)  # type: ignore[arg-type]


def test_nothing_to_time_is_refused() -> None:
    with pytest.raises(ValueError, match="nothing to time"):
        time_loaders({}, lambda loader: 0.0)
    with pytest.raises(ValueError, match="nothing to time"):
        time_first_batches({})


def test_worker_start_method_names_a_method_this_python_has() -> None:
    before = multiprocessing.get_start_method(allow_none=True)
    assert worker_start_method() in multiprocessing.get_all_start_methods()
    assert multiprocessing.get_start_method(allow_none=True) == before  # asking sets nothing
