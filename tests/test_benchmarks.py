"""Smoke test of the benchmark scripts: they run and report (speed is never asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_loop_overhead_quick_prints_a_ratio(tmp_path: Path) -> None:
    out = tmp_path / "loop_overhead.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "loop_overhead.py"),
            "--quick",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # the script must find the package from anywhere
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ratio fit/minimal = " in proc.stdout
    assert "target <= 1.03: " in proc.stdout
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["quick"] is True
    assert set(result["median_seconds"]) == {"minimal", "fit+bar", "fit"}
    assert result["ratio_fit_bar"] > 0 and result["ratio_fit_no_bar"] > 0
    assert result["same_final_weights"] is True  # every variant did the same work
