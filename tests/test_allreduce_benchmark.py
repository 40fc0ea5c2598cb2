"""Smoke test of benchmarks/allreduce.py (lesson 06b, section 1: all-reduce bandwidth).

It runs the script as a learner would, from the source tree, in quick mode on two CPU processes
with small messages, and checks the table, the fitted model and the JSON it writes; then that
it refuses what it cannot measure. No speed is asserted: speed belongs to the benchmark.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from benchmark_run import load_benchmark, run_benchmark


def run_script(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    # cwd: not the repository root, so PYTHONPATH alone must find the package
    return run_benchmark("allreduce", *args, cwd=cwd, timeout=timeout)


@pytest.mark.slow  # make test-long
def test_allreduce_benchmark_writes_its_schema(tmp_path: Path) -> None:
    out = tmp_path / "allreduce.json"
    args = ("--quick", "--device", "cpu", "--world-size", "2", "--max-mb", "2")
    run = run_script(*args, "--repeats", "2", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "busbw GB/s" in run.stdout and "reference: rank 0 alone copying 256 MiB" in run.stdout
    assert "not the machine's peak" in run.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "allreduce" and result["quick"] is True
    assert result["placement"]["world_size"] == 2 and result["placement"]["backend"] == "gloo"
    assert result["busbw_factor"] == 1.0 and result["repeats"] == 2
    assert result["hardware"]["torch"] and "cpu_count" in result["hardware"]
    sizes = result["sizes"]
    assert [r["bytes"] for r in sizes] == [2**k for k in range(10, 22)]  # 1 KiB .. 2 MiB
    reference = result["ceiling"]["bytes_per_s"]  # the key run_all.py reads
    for r in sizes:
        assert len(r["seconds"]) == 2 and r["median_seconds"] > 0
        assert r["algbw_bytes_per_s"] == r["bytes"] / r["median_seconds"]
        assert r["busbw_bytes_per_s"] == r["algbw_bytes_per_s"]  # n = 2
        assert r["busbw_over_reference"] == r["busbw_bytes_per_s"] / reference
        assert r["model_seconds"] is None or r["model_seconds"] > 0  # None: noise beat the fit
    assert "bytes copied" in result["ceiling"]["counted"] and len(result["ceiling"]["seconds"]) == 2
    assert result["ceiling"]["what"].startswith("rank 0 alone copying")
    model = result["model"]
    if model["error"] is None:
        assert model["alpha_seconds"] >= 0 and model["beta_bytes_per_s"] > 0
    else:  # times that did not grow with size (a busy machine): said, not crashed on
        assert "no positive bandwidth" in model["error"] and "no fit" in run.stdout
    assert "relative" in model["fit"]


def test_allreduce_benchmark_refuses_what_it_cannot_measure(capsys) -> None:
    bench = load_benchmark("allreduce")
    assert bench.main(["--device", "cpu", "--world-size", "512"]) == 2
    err = capsys.readouterr().err
    assert "more than the" in err and "use --world-size" in err
    assert bench.main(["--device", "cpu", "--world-size", "1"]) == 2
    assert "2 or more ranks" in capsys.readouterr().err
    for too_small in ("0.0001", "0.0015"):  # no size at all; only 1 KiB: no fit from one size
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--max-mb", too_small])
        assert exit_.value.code == 2 and "needs two sizes" in capsys.readouterr().err
