"""nbgrader grades the lessons as committed (docs/instructors.md, "Autograding").

A fast test checks that every lesson's exercises carry the cell metadata nbgrader needs. Two
slower ones grade lesson 00 with real nbgrader 0.9, installed in its own environment
(``.venv-grading``, which `make test` creates and names in ``MGPU_NBGRADER``), through
``grading/nbgrader_config.py``: the student edition must score 0 and one wrong answer partial
points (make test), the solutions full points (make test-long).
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.tooling.notebooks import (
    SELF_CHECK_TAG,
    clean_notebook,
    exercise_check_indices,
    find_lessons,
    is_solution_cell,
)
from mgpu_helpers.tooling.student import BEGIN, END, strip_solutions

ROOT = Path(__file__).resolve().parents[1]
LESSONS = find_lessons(ROOT / "notebooks")


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_exercise_is_a_graded_locked_check_after_a_marked_solution(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    solutions = [i for i, cell in enumerate(nb.cells) if is_solution_cell(cell)]
    checks = exercise_check_indices(nb)
    assert len(checks) == len(solutions) >= 2, f"{path.name}: each solution needs its check"
    for n, (solution, check) in enumerate(zip(solutions, checks, strict=True), start=1):
        answer = nb.cells[solution].metadata.get("nbgrader", {})
        assert answer.get("solution") is True and answer.get("grade") is False, (
            f"{path.name}, cell {solution}: not an nbgrader answer cell (run `mgpu clean`)"
        )
        test = nb.cells[check].metadata.get("nbgrader", {})
        assert test == {
            "grade": True,
            "grade_id": f"{path.stem}-check-{n}",
            "locked": True,
            "points": test.get("points"),
            "schema_version": 3,
            "solution": False,
        }, f"{path.name}, cell {check}: not a graded, locked test cell (run `mgpu clean`)"
        assert isinstance(test["points"], (int, float)) and test["points"] > 0
        assert SELF_CHECK_TAG in nb.cells[check].metadata.get("tags", [])
    ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if "nbgrader" in c.metadata]
    assert len(ids) == len(set(ids)), f"{path.name}: grade ids repeat"


def _nbgrader() -> Path:
    """The nbgrader command: from `make test`, or `make grading-env` run before."""
    named = os.environ.get("MGPU_NBGRADER")
    path = Path(named) if named else ROOT / ".venv-grading" / "bin" / "nbgrader"
    if not path.exists():
        if named:
            pytest.fail(f"MGPU_NBGRADER={named} does not exist: run `make grading-env`")
        pytest.skip("nbgrader 0.9 is not installed: `make grading-env` (make test does it)")
    return path


def _run(nbgrader: Path, *args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MGPU_QUICK", "MGPU_GRADING")}
    env["PATH"] = os.pathsep.join([str(nbgrader.parent), env.get("PATH", "")])  # alembic
    env["MGPU_PYTHON"] = sys.executable  # the kernel: this environment, with the package
    done = subprocess.run(
        [str(nbgrader), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def _wrong(source: str) -> str:
    """The solution with its answer replaced by ``return None`` at the answer's indentation."""
    lines = source.splitlines()
    begin = next(i for i, line in enumerate(lines) if line.strip() == BEGIN)
    end = next(i for i, line in enumerate(lines) if line.strip() == END)
    indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
    return "\n".join([*lines[: begin + 1], f"{indent}return None", *lines[end:]])


def _grade(tmp_path: Path, students: tuple[str, ...]) -> tuple[dict, Path, int]:
    """Lesson 00 released and graded by real nbgrader for ``students``, each one of "stubs"
    (the student edition nbgrader released), "solved" (the lesson as committed) and "wrong"
    (its first answer replaced by ``return None``): each one's (score, max score), the course
    folder and the number of exercises."""
    nbgrader = _nbgrader()
    lesson = LESSONS[0]  # lesson 00: the quickest to run, with two exercises
    course = tmp_path / "grading"
    source = course / "source" / "ps" / lesson.name
    source.parent.mkdir(parents=True)
    shutil.copy(lesson, source)
    clean_notebook(source)  # as a committed lesson is (the test above checks that)
    config = ROOT / "grading" / "nbgrader_config.py"
    (course / "nbgrader_config.py").write_text(
        f"c = get_config()\nload_subconfig({str(config)!r})\n"
    )

    _run(nbgrader, "generate_assignment", "ps", "--force", cwd=course)
    released = nbformat.read(course / "release" / "ps" / lesson.name, as_version=4)
    solved = nbformat.read(source, as_version=4)
    for mine, theirs in zip(solved.cells, released.cells, strict=True):
        if is_solution_cell(mine):  # nbgrader's stubs are the student edition's
            assert theirs.source == strip_solutions(mine.source)

    wrong = nbformat.read(source, as_version=4)
    first = next(cell for cell in wrong.cells if is_solution_cell(cell))
    first.source = _wrong(first.source)
    editions = {"stubs": released, "solved": solved, "wrong": wrong}
    for student in students:
        folder = course / "submitted" / student / "ps"
        folder.mkdir(parents=True)
        nbformat.write(editions[student], folder / lesson.name)

    _run(nbgrader, "autograde", "ps", "--force", cwd=course)
    _run(nbgrader, "export", cwd=course)
    with open(course / "grades.csv") as f:
        rows = list(csv.DictReader(f))
    scores = {row["student_id"]: (float(row["score"]), float(row["max_score"])) for row in rows}
    return scores, course, len(exercise_check_indices(solved))


# Each submission is a kernel run of lesson 00 (~10 s): make test grades two, the student
# edition and one wrong answer among solved exercises (whose points show that a solution
# scores); make test-long grades the whole solved lesson.
@pytest.mark.notebook
def test_nbgrader_scores_stubs_zero_and_a_wrong_answer_partly(tmp_path: Path) -> None:
    scores, course, n = _grade(tmp_path, ("stubs", "wrong"))
    assert scores == {"stubs": (0.0, n), "wrong": (n - 1, n)}

    graded = nbformat.read(course / "autograded" / "wrong" / "ps" / LESSONS[0].name, as_version=4)
    first_check = graded.cells[exercise_check_indices(graded)[0]]
    kinds = [out.output_type for out in first_check.outputs]
    assert kinds[-1] == "error" and first_check.outputs[-1].ename == "CheckFailed"
    shown = first_check.outputs[0].data["text/plain"]
    assert shown.startswith("FAIL  exercise 1") and "hint:" in shown  # the learner's feedback


@pytest.mark.slow
@pytest.mark.notebook
def test_nbgrader_scores_the_solutions_full(tmp_path: Path) -> None:
    scores, _, n = _grade(tmp_path, ("solved",))
    assert scores == {"solved": (n, n)}
