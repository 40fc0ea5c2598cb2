"""benchmarks/ddp_from_scratch.py runs lesson 06a's own code and writes its JSON (no timing is
asserted: speed belongs in the benchmark, not in the tests)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from benchmark_run import load_benchmark, run_benchmark

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_benchmark("ddp_from_scratch", *args, timeout=timeout)


@pytest.mark.slow  # make test-long
def test_quick_run_prints_the_ratio_against_its_target_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    result = run("--quick", "--device", "cpu", "--out", str(out))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "equals DDP's gradients" in text  # the check ran before the timing
    assert "target <= 1.15 on the CPU with gloo: " in text.splitlines()[-2]
    for variant in ("DDP", "hand-built", "no communication"):
        assert variant in text
    data = json.loads(out.read_text())
    assert data["benchmark"] == "ddp_from_scratch" and data["quick"] is True
    assert data["placement"]["backend"] == "gloo" and data["placement"]["world_size"] == 2
    assert {"threads_per_rank", "devices"} <= set(data["placement"])
    assert {"torch", "python", "cpu_count", "gpus"} <= set(data["hardware"])
    assert set(data["seconds_per_timing"]) == {"DDP", "hand-built", "no communication"}
    assert all(len(t) == data["repeats"] for t in data["seconds_per_timing"].values())
    assert len(data["round_ratios"]) == data["repeats"]
    assert data["target"] == 1.15 and data["target_applies"] is True
    assert data["passed"] == (data["ratio"] <= 1.15)
    assert data["max_difference"] < 1e-6
    assert sorted(i for b in data["buckets"] for i in b) == list(range(2 * (data["depth"] + 1)))


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark("ddp_from_scratch")
    for args, message in ((["--cap-mb", "0"], "--cap-mb"), (["--ranks", "1"], "at least 2 ranks")):
        with pytest.raises(SystemExit) as stopped:
            benchmark.parse_args(["--quick", *args])
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_benchmark_runs_lesson_06as_own_code() -> None:
    """OverlapBuckets and make_buckets are written in lesson 06a's cells only."""
    benchmark = load_benchmark("ddp_from_scratch")
    notebook = str(ROOT / "notebooks" / "06a_ddp_speed_by_hand.ipynb")
    assert benchmark.lesson.OverlapBuckets.__module__ == "06a_ddp_speed_by_hand"
    assert benchmark.lesson.make_buckets.__code__.co_filename.startswith(notebook)
    assert getattr(benchmark, "OverlapBuckets", None) is None  # no copy of its own
