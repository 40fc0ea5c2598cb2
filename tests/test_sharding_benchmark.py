"""benchmarks/sharding.py runs lesson 08's own trainers and writes its JSON; run_all reads it.

The memory target is exact tensor accounting, so the quick run must meet it; no timing is
asserted (speed belongs in the benchmark, not in the tests). That the target can be missed is
checked through run_all's reader, on a result made to miss it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from benchmark_run import ROOT, load_benchmark, run_benchmark

run_all = load_benchmark("run_all")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """One quick run on CPU processes, one launch: 3 ranks, where the rows do not split evenly
    (FSDP2 pads them: its ratio is above 1). Each further world size costs a launch."""
    out = tmp_path_factory.mktemp("sharding") / "sharding.json"
    args = ("--quick", "--device", "cpu", "--world-sizes", "3", "--out", str(out))
    done = run_benchmark("sharding", *args, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


@pytest.mark.slow  # make test-long
def test_quick_run_reports_memory_per_rank_and_the_target(result: tuple[str, dict]) -> None:
    text, data = result
    assert "target <= 1.10 at every N" in text.splitlines()[-2] and "PASS" in text
    assert data["benchmark"] == "sharding" and data["quick"] is True and data["steps"] >= 3
    assert data["world_sizes"] == [3] and data["methods"] == ["DDP", "ZeRO-1", "ZeRO-2", "FSDP2"]
    assert {"torch", "python", "cpu_count", "gpus"} <= set(data["hardware"])
    ddp = {"3": data["runs"]["3"]["memory"]["DDP"]["total"]}
    assert ddp["3"] == 16 * data["parameters"]  # fp32 Adam: 4 + 4 + 8 bytes each, on any N
    n = "3"
    run = data["runs"][n]
    assert run["placement"]["world_size"] == int(n) and run["placement"]["backend"] == "gloo"
    assert len(run["total_per_rank"]["FSDP2"]) == int(n)
    for name in data["methods"]:
        memory = run["memory"][name]
        kinds = ("parameters", "gradients", "optimizer")
        assert memory["total"] == sum(memory[k] for k in kinds)
        assert len(run["seconds_per_step"][name]) == data["repeats"]
    fsdp = run["memory"]["FSDP2"]["total"]
    assert data["fsdp_ratio"][n] == pytest.approx(fsdp / (ddp[n] / int(n)))
    assert 1.0 < data["fsdp_ratio"][n] <= data["target"] == 1.10  # > 1: padded rows
    meta = run["meta_build"]  # lesson 08b's meta-device build: shards plus one layer at a time
    assert meta["peak"] == meta["shards"] + meta["largest_layer"] < 4 * data["parameters"]
    assert data["meta_build_peak_over_full_model"][n] == meta["peak"] / (4 * data["parameters"])
    assert "the meta-device build" in text
    # each sharding step holds less than the one before it
    totals = [run["memory"][m]["total"] for m in data["methods"]]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]
    assert data["time_ratio"][n]["DDP"] == 1.0
    assert data["passed"] is True


@pytest.mark.slow  # make test-long
def test_run_all_reads_it_and_a_result_over_the_target_is_not_met(
    result: tuple[str, dict], tmp_path: Path
) -> None:
    _, data = result
    headlines = run_all._sharding(data)
    targets = [h for h in headlines if h.kind == "target"]
    assert [h.what for h in targets] == ["FSDP2 state / (DDP's / N), N=3"]
    assert all(h.met for h in targets)
    assert [h.kind for h in headlines if "time" in h.what] == ["report"]
    over = copy.deepcopy(data)
    over["fsdp_ratio"]["3"] = 1.25  # as if FSDP2 kept a quarter more than DDP / 3
    missed = [h for h in run_all._sharding(over) if h.what.endswith("N=3") and h.kind == "target"]
    assert missed[0].met is False and "NOT met" in missed[0].row()
    one = copy.deepcopy(data)  # one rank: FSDP2 holds what DDP holds, nothing to judge
    one["fsdp_ratio"]["1"], one["time_ratio"]["1"] = 1.0, {"FSDP2": 1.0}
    rows = {h.what: h for h in run_all._sharding(one)}
    assert rows["FSDP2 state / (DDP's / N), N=1"].kind == "report"
    assert rows["FSDP2 state / (DDP's / N), N=1"].met is None
    run_all._plot_sharding(data).savefig(tmp_path / "sharding.png", dpi=60)
    assert (tmp_path / "sharding.png").stat().st_size > 1000


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark("sharding")
    refused = (
        (["--steps", "2"], "at least 3"),  # steps 1 and 2 are not timed
        (["--world-sizes", "0"], "at least 1"),
    )
    for args, message in refused:
        with pytest.raises(SystemExit) as stopped:
            benchmark.parse_args(["--quick", "--device", "cpu", *args])
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_benchmark_runs_lesson_08s_own_code() -> None:
    """The trainers and train_worker are written in lesson 08's cells only."""
    benchmark = load_benchmark("sharding")
    part_a = str(ROOT / "notebooks" / "08a_memory_and_zero.ipynb")
    for name in ("DDPTrainer", "ZeroTrainer", "FSDPTrainer"):
        # one namespace for both parts: its module is the first part's
        assert getattr(benchmark.lesson, name).__module__ == "08a_memory_and_zero"
    assert benchmark.lesson.train_worker.__code__.co_filename.startswith(part_a)
    part_b = str(ROOT / "notebooks" / "08b_fsdp2.ipynb")
    assert benchmark.lesson.FSDPTrainer.__init__.__code__.co_filename.startswith(part_b)
    assert getattr(benchmark, "FSDPTrainer", None) is None  # no copy of its own
