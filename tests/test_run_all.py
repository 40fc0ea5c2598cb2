"""`make benchmark`'s runner: one folder of results, each headline next to its target or ideal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_run import ROOT, load_benchmark

run_all = load_benchmark("run_all")


def test_a_target_is_met_or_missed_and_an_ideal_is_a_fraction() -> None:
    met = run_all.Headline("b", "ratio", 1.1, 1.15, "target")
    missed = run_all.Headline("b", "ratio", 1.2, 1.15, "target")
    ideal = run_all.Headline("b", "speed-up", 1.2, 1.6, "ideal")
    assert met.met is True and missed.met is False and ideal.met is None
    assert "target <= 1.15: met" in met.row() and "NOT met" in missed.row()
    assert "75% of it" in ideal.row()


def test_every_benchmark_has_a_reader_and_a_script() -> None:
    assert set(run_all.READERS) == set(run_all.BENCHMARKS)
    for name in run_all.BENCHMARKS:
        assert (ROOT / "benchmarks" / f"{name}.py").exists(), name


def test_default_folder_names_host_and_day() -> None:
    import datetime

    folder = run_all.default_folder(datetime.date(2026, 12, 1))
    assert folder.parent == ROOT / "benchmarks" / "results"
    assert folder.name.endswith("-2026-12-01") and "/" not in folder.name


@pytest.mark.slow  # make test-long
def test_a_real_quick_run_is_summarized_with_a_picture(tmp_path: Path) -> None:
    """One benchmark for real in quick mode through the runner (the others have smoke tests)."""
    name = "pipeline"
    assert run_all.main(["--quick", "--only", name, "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["problems"] == [] and summary["runs"][name]["exit_status"] == 0
    assert summary["headlines"] and all(h["benchmark"] == name for h in summary["headlines"])
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert "results written to" in (tmp_path / f"{name}.txt").read_text()
    assert "quick mode" in (tmp_path / "summary.txt").read_text()


def test_a_failing_benchmark_is_reported_and_fails_the_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(run_all, "run_one", lambda name, folder, quick, timeout: (3, 0.1))
    assert run_all.main(["--only", "pipeline", "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["problems"] == ["pipeline: exited 3"]
    assert "FAILED pipeline: exited 3" in (tmp_path / "summary.txt").read_text()
