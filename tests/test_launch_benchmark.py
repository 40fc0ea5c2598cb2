"""Smoke test of benchmarks/launch_overhead.py (lesson 04's launcher against bare fork and spawn).

It runs the script as a learner would, from the source tree, in quick mode on CPU processes, and
checks that it finishes, reports every variant on both workloads and the ratios, writes its JSON
and leaves no process behind. No timing is asserted: speed belongs to the benchmark, not to the
tests.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psutil
import pytest
from benchmark_run import run_benchmark


def processes_tagged(tag: str) -> list[psutil.Process]:
    """Processes still running whose environment carries ``MGPU_BENCH_TAG=tag``."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("MGPU_BENCH_TAG") == tag and p.is_running():
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.mark.slow  # make test-long
def test_launch_overhead_runs_in_quick_mode(tmp_path: Path) -> None:
    out = tmp_path / "launch.json"
    tag = uuid.uuid4().hex  # inherited by every process the script starts
    run = run_benchmark(
        "launch_overhead",
        "--quick",
        "--device",
        "cpu",
        "--out",
        str(out),
        cwd=tmp_path,  # not the repository root: PYTHONPATH alone must find the package
        env={"MGPU_BENCH_TAG": tag},
        timeout=400,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "allreduce  ratio launcher/fork" in run.stdout
    assert "ddp20      ratio launcher/fork" in run.stdout
    assert "target <= 2.0 for repeated launches" in run.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "launch_overhead"
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    for workload in ("allreduce", "ddp20"):
        for variant in ("launcher", "fork", "spawn"):
            assert len(result["seconds"][workload][variant]) == 1
            assert result["first_seconds"][workload][variant] > 0
            assert result["median_seconds"][workload][variant] > 0
        assert result["ratios"][workload]["launcher/fork"] > 0
    assert processes_tagged(tag) == []


def test_launch_overhead_refuses_what_the_hardware_cannot_do(tmp_path: Path) -> None:
    run = run_benchmark(
        "launch_overhead",
        "--quick",
        "--device",
        "cuda",
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
        timeout=120,
    )
    assert run.returncode == 2
    assert "no GPU is visible" in run.stderr
