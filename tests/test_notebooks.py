"""Every lesson, executed in a real Jupyter kernel in quick mode, in both editions.

The instructor edition must run top to bottom with every self-check passing; the student
edition (solutions replaced by stubs) must still run top to bottom, with every self-check
failing and saying the exercise is not implemented yet. Committed notebooks must be clean.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.course import run_lesson
from mgpu_helpers.notebooks import find_lessons, notebook_problems
from mgpu_helpers.student import BEGIN, make_student_edition

ROOT = Path(__file__).resolve().parents[1]
LESSONS = find_lessons(ROOT / "notebooks")
IDS = [p.stem for p in LESSONS]


@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_committed_notebook_is_clean_and_well_formed(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    assert notebook_problems(nb) == []
    intro = nb.cells[0].source.lower()
    assert nb.cells[0].cell_type == "markdown" and intro.startswith(f"# lesson {path.stem[:2]}")
    for needed in ("learning objectives", "estimated time", "gpu"):
        assert needed in intro, f"the first cell of {path.name} lacks '{needed}'"
    text = "\n".join(c.source for c in nb.cells)
    assert "recap" in text.lower(), f"{path.name} has no recap"
    solutions = [c for c in nb.cells if c.cell_type == "code" and BEGIN in c.source]
    assert len(solutions) >= 2, f"{path.name} needs at least two exercises with solutions"
    for cell in solutions:
        assert cell.metadata.get("jupyter", {}).get("source_hidden"), "solutions start collapsed"


@pytest.mark.notebook
@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_lesson_runs_in_quick_mode_and_solutions_pass(path: Path, tmp_path: Path) -> None:
    run = run_lesson(path, tmp_path, quick=True)
    assert run.status == "passed", f"{path.name} failed: {run.error}"
    assert len(run.checks) >= 2, f"{path.name} ran {len(run.checks)} self-checks, wants >= 2"
    failed = [name for name, ok in run.checks.items() if not ok]
    assert not failed, f"solutions fail their self-checks: {failed}"


@pytest.mark.notebook
@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_student_edition_runs_and_every_stub_fails_clearly(path: Path, tmp_path: Path) -> None:
    (student,) = make_student_edition([path], tmp_path / "student")
    assert BEGIN not in student.read_text()
    run = run_lesson(student, tmp_path / "out", quick=True)
    assert run.status == "passed", f"student edition of {path.name} crashed: {run.error}"
    assert run.checks, "no self-check ran in the student edition"
    passed = [name for name, ok in run.checks.items() if ok]
    assert not passed, f"stubs pass their self-checks (the checks cannot fail?): {passed}"
    nb = nbformat.read(run.output_path, as_version=4)
    printed = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    for name in run.checks:
        assert f"FAIL  {name}: not implemented yet" in printed, f"{name} fails for another reason"
