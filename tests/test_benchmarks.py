"""Smoke test of the benchmark scripts: they run and report (speed is never asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_run import run_benchmark


@pytest.mark.slow  # make test-long
def test_loop_overhead_quick_prints_a_ratio(tmp_path: Path) -> None:
    out = tmp_path / "loop_overhead.json"
    proc = run_benchmark(
        "loop_overhead",
        "--quick",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--out",
        str(out),
        cwd=tmp_path,  # the script must find the package from anywhere
    )
    assert proc.returncode == 0, proc.stderr
    assert "ratio fit/minimal = " in proc.stdout
    assert "target <= 1.03: " in proc.stdout
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["quick"] is True
    assert set(result["median_seconds"]) == {"minimal", "fit+bar", "fit"}
    assert result["ratio_fit_bar"] > 0 and result["ratio_fit_no_bar"] > 0
    assert result["same_final_weights"] is True  # every variant did the same work
