"""benchmarks/pipeline.py runs from the source tree and writes its table and JSON (no timings
are asserted: speed belongs in the benchmark, not in the tests)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from benchmark_run import load_benchmark, run_benchmark

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_benchmark("pipeline", *args, timeout=timeout)


@pytest.mark.slow  # make test-long
def test_quick_run_prints_ratios_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    result = run("--quick", "--devices", "cpu,cpu", "--micro", "1", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "S*M/(M+S-1)" in text  # the formula behind the ideal column is stated
    assert "a pipelined step (M=2) equals the naive step" in text
    for variant in ("unsplit", "naive", "pipe M=1", "pipe M=2"):
        assert variant in text
    data = json.loads(out.read_text())
    assert data["devices"] == ["cpu", "cpu"]
    assert set(data["ratio_to_unsplit"]) == {"unsplit", "naive", "pipe M=1", "pipe M=2"}
    assert data["ratio_to_unsplit"]["unsplit"] == 1.0
    assert data["ideal_ratio_to_unsplit"]["pipe M=2"] in (1.0, 4 / 3)  # 4/3 with 2+ cores
    assert data["bubble_fraction"] == {"pipe M=1": 0.5, "pipe M=2": 1 / 3}
    # the naive split (M=1) cannot overlap: stage 1 starts only after stage 0's one forward
    assert data["forward_overlap_seconds"]["pipe M=1"] <= 0
    assert set(data["forward_overlap_seconds"]) == {"pipe M=1", "pipe M=2"}
    assert all(len(t) == data["repeats"] for t in data["seconds_per_step"].values())


@pytest.mark.slow  # make test-long
def test_three_stages() -> None:
    result = run("--quick", "--devices", "cpu,cpu,cpu", "--micro", "3")
    assert result.returncode == 0, result.stderr
    assert "S=3 stages" in result.stdout and "pipe M=3" in result.stdout


def test_bad_arguments_are_refused() -> None:
    bad = run("--quick", "--devices", "cpu")
    assert bad.returncode == 2 and "two or more devices" in bad.stderr
    bad = run("--quick", "--micro", "0")
    assert bad.returncode == 2 and "--micro" in bad.stderr


def test_the_benchmark_runs_lesson_05s_own_code() -> None:
    """The split model and the GPipe step are written in lesson 05a's cells only: the benchmark
    loads them from the notebook (as tests/lesson05_code.py does), it holds no copy."""
    import inspect

    from lesson05_code import NAMES

    benchmark = load_benchmark("pipeline")  # loads the lesson's code; main() does not run
    notebook = str(ROOT / "notebooks" / "05a_model_parallel.ipynb")
    for name in NAMES:
        defined = getattr(benchmark.lesson, name)
        assert getattr(benchmark, name, None) is None, f"the benchmark defines its own {name}"
        if inspect.isfunction(defined):
            assert defined.__code__.co_filename.startswith(notebook), name
    assert benchmark.lesson.SplitModel.__module__ == "05a_model_parallel"
