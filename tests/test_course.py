"""The course runner on tiny notebooks, and the notebook file rules (mgpu_helpers.notebooks).

Kernel starts cost seconds each, so three tests start three kernels in all: one course run of a
passing and a failing lesson (two kernels), and one lesson run in full mode.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.course import LessonRun, inject_parameters, run_course, run_lesson
from mgpu_helpers.notebooks import (
    KERNELSPEC,
    clean_notebook,
    find_lessons,
    notebook_problems,
    parameters_cell_index,
)

PASSING = [
    ("markdown", "# A passing lesson"),
    ("params", 'N = 1\nLABEL = "default"'),
    (
        "code",
        "import os\n"
        "from mgpu_helpers import check, quick_from_env, record\n"
        'record("n_squared", N * N)\n'
        'record("label", LABEL)\n'
        'record("quick", quick_from_env())\n'
        'record("cwd", os.getcwd())\n'
        'record("speed", 1234.5, unit="samples/s")',
    ),
    (
        "code",
        'check("n is three", lambda: N == 3, "run with N=3")\n'
        'check("always fails", lambda: False, "nothing to fix")',
    ),
]

FAILING = [
    ("params", "N = 1"),
    ("code", 'from mgpu_helpers import record\nrecord("before", N)'),
    ("code", 'raise ValueError("boom in lesson two")'),
    ("code", 'record("after", 1)'),
]


@pytest.fixture(scope="module")
def course_run(tmp_path_factory, notebook_writer):
    """Run a passing and a failing lesson through run_course once (two kernel starts)."""
    folder = tmp_path_factory.mktemp("lessons")
    out = tmp_path_factory.mktemp("course")
    passing = notebook_writer(folder / "01_pass.ipynb", PASSING)
    failing = notebook_writer(folder / "02_fail.ipynb", FAILING)
    mp = pytest.MonkeyPatch()
    mp.setenv("MGPU_QUICK", "sentinel")  # must be overridden for the kernel, then restored
    try:
        runs = run_course(
            [failing, passing],  # the failure comes first: the next lesson must still run
            out,
            quick=True,
            params={"N": 3, "LABEL": "injected"},
            echo=False,
        )
        env_after = os.environ.get("MGPU_QUICK")
    finally:
        mp.undo()
    return {"runs": runs, "out": out, "folder": folder, "env_after": env_after}


def test_course_runs_every_lesson_in_order(course_run):
    runs = course_run["runs"]
    assert [r.name for r in runs] == ["02_fail", "01_pass"]
    assert all(isinstance(r, LessonRun) for r in runs)
    assert course_run["env_after"] == "sentinel"  # the runner restored the environment


def test_passing_lesson_collects_results_and_checks(course_run):
    run = course_run["runs"][1]
    assert run.status == "passed" and run.error == ""
    assert run.results["n_squared"] == 9  # the injected N=3 overrode the parameters cell
    assert run.results["label"] == "injected"
    assert run.results["quick"] is True  # MGPU_QUICK reached the kernel
    assert run.results["speed"] == 1234.5
    assert run.results["cwd"] == str(course_run["folder"].resolve())  # runs beside the notebook
    assert run.checks == {"n is three": True, "always fails": False}
    assert run.seconds > 0

    executed = nbformat.read(run.output_path, as_version=4)
    assert run.output_path == str(course_run["out"] / "01_pass.ipynb")
    assert executed.cells[2].metadata["tags"] == ["injected-parameters"]
    texts = [
        out.get("data", {}).get("text/plain", "") + out.get("text", "")
        for cell in executed.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    ]
    assert any("speed = 1234 samples/s" in t for t in texts)  # what the learner saw
    assert any("PASS  n is three" in t for t in texts)


def test_failing_lesson_reports_the_exception(course_run):
    run = course_run["runs"][0]
    assert run.status == "failed"
    assert "ValueError" in run.error and "boom in lesson two" in run.error
    assert run.results == {"before": 3}  # recorded before the failure; nothing after
    executed = nbformat.read(run.output_path, as_version=4)
    assert any(
        o.output_type == "error" for c in executed.cells if c.cell_type == "code" for o in c.outputs
    )


def test_course_report_lists_both_lessons(course_run):
    out = course_run["out"]
    data = json.loads((out / "report.json").read_text())
    assert data["mode"] == "quick"
    assert [(x["name"], x["status"]) for x in data["lessons"]] == [
        ("02_fail", "failed"),
        ("01_pass", "passed"),
    ]
    assert data["lessons"][1]["results"]["n_squared"] == 9
    assert "gloo" in data["hardware"]["backends"] and data["plan"].startswith("[")
    page = (out / "report.html").read_text()
    assert "1 of 2 lessons passed" in page
    assert "02_fail" in page and "01_pass" in page and "boom in lesson two" in page
    assert 'href="01_pass.ipynb"' in page
    assert "n_squared = 9" in page and "1/2" in page  # results and self-checks columns


def test_full_mode_and_default_parameters(tmp_path, notebook_writer, monkeypatch):
    monkeypatch.setenv("MGPU_QUICK", "1")
    path = notebook_writer(tmp_path / "01_pass.ipynb", PASSING)
    run = run_lesson(path, tmp_path / "out", quick=False)  # the third and last kernel
    assert run.status == "passed", run.error
    assert run.results["quick"] is False
    assert run.results["n_squared"] == 1 and run.results["label"] == "default"
    assert run.checks["n is three"] is False
    assert os.environ["MGPU_QUICK"] == "1"


# --- inject_parameters (no kernel) ----------------------------------------------------------


def _notebook(notebook_writer, tmp_path, cells):
    return nbformat.read(notebook_writer(tmp_path / "nb.ipynb", cells), as_version=4)


def test_inject_parameters_goes_right_after_the_parameters_cell(notebook_writer, tmp_path):
    nb = _notebook(notebook_writer, tmp_path, PASSING)
    inject_parameters(nb, {"N": 3, "LABEL": "it's", "SIZES": [1, 2]})
    assert len(nb.cells) == len(PASSING) + 1
    cell = nb.cells[2]
    assert cell.cell_type == "code" and cell.metadata["tags"] == ["injected-parameters"]
    namespace: dict = {}
    exec(nb.cells[1].source, namespace)
    exec(cell.source, namespace)
    assert (namespace["N"], namespace["LABEL"], namespace["SIZES"]) == (3, "it's", [1, 2])
    assert nb.cells[3].source == PASSING[2][1]  # the rest follows unchanged


def test_inject_nothing_changes_nothing(notebook_writer, tmp_path):
    nb = _notebook(notebook_writer, tmp_path, PASSING)
    before = nbformat.writes(nb)
    inject_parameters(nb, {})
    assert nbformat.writes(nb) == before


@pytest.mark.parametrize("name", ["1N", "a-b", "", "N M", "class"])
def test_inject_rejects_names_that_are_not_python_names(notebook_writer, tmp_path, name):
    nb = _notebook(notebook_writer, tmp_path, PASSING)
    with pytest.raises(ValueError, match="not a Python identifier"):
        inject_parameters(nb, {"N": 2, name: 1})
    assert len(nb.cells) == len(PASSING)


def test_inject_needs_a_parameters_cell(notebook_writer, tmp_path):
    nb = _notebook(notebook_writer, tmp_path, [("code", "N = 1")])
    with pytest.raises(ValueError, match="no code cell tagged 'parameters'"):
        inject_parameters(nb, {"N": 2})


def test_run_lesson_refuses_a_notebook_without_parameters_cell(notebook_writer, tmp_path):
    path = notebook_writer(tmp_path / "01_x.ipynb", [("code", "N = 1")])
    with pytest.raises(ValueError, match="parameters"):
        run_lesson(path, tmp_path / "out", quick=True, params={"N": 2})  # before any kernel


# --- find_lessons, notebook_problems, clean_notebook ----------------------------------------


def test_find_lessons_in_course_order(tmp_path):
    for name in [
        "10_last.ipynb",
        "02_b.ipynb",
        "00_setup.ipynb",
        "notes.ipynb",
        "1_short.ipynb",
        "03_c.txt",
        "05_x.ipynb.bak",
    ]:
        (tmp_path / name).write_text("{}")
    assert [p.name for p in find_lessons(tmp_path)] == [
        "00_setup.ipynb",
        "02_b.ipynb",
        "10_last.ipynb",
    ]


@pytest.mark.parametrize("make", [True, False])
def test_find_lessons_without_lessons_raises(tmp_path, make):
    folder = tmp_path / "empty"
    if make:
        folder.mkdir()
        (folder / "README.md").write_text("no lessons here")
    with pytest.raises(FileNotFoundError, match="no lesson notebooks.*empty"):
        find_lessons(folder)


def test_notebook_problems_of_a_clean_notebook(notebook_writer, tmp_path):
    nb = _notebook(notebook_writer, tmp_path, PASSING)
    assert notebook_problems(nb) == []
    assert parameters_cell_index(nb) == 1


def test_notebook_problems_finds_outputs_and_counts(notebook_writer, tmp_path):
    nb = _notebook(notebook_writer, tmp_path, PASSING)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="hi\n")]
    nb.cells[3].execution_count = 4
    problems = notebook_problems(nb)
    assert len(problems) == 2
    assert problems[0].startswith("cell 2 ") and problems[1].startswith("cell 3 ")
    assert all("mgpu clean" in p for p in problems)


def test_notebook_problems_parameters_cell_rules(notebook_writer, tmp_path):
    nb = _notebook(notebook_writer, tmp_path, [("code", "import torch"), ("params", "N = 1")])
    assert notebook_problems(nb) == ["the cell tagged 'parameters' is not the first code cell"]
    nb = _notebook(notebook_writer, tmp_path, [("markdown", "# t"), ("code", "N = 1")])
    assert notebook_problems(nb) == ["the notebook has no code cell tagged 'parameters'"]


def test_clean_notebook_strips_outputs_and_editor_metadata(notebook_writer, tmp_path):
    path = notebook_writer(tmp_path / "01_x.ipynb", PASSING)
    nb = nbformat.read(path, as_version=4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="hi\n")]
    nb.cells[2].execution_count = 7
    nb.cells[2].metadata.update({"collapsed": True, "scrolled": True, "execution": {"x": 1}})
    nb.metadata["widgets"] = {"state": {}}
    nb.metadata["jupytext"] = {"formats": "ipynb,py"}
    nbformat.write(nb, path)
    assert notebook_problems(nbformat.read(path, as_version=4))

    assert clean_notebook(path) is True
    cleaned = nbformat.read(path, as_version=4)
    assert notebook_problems(cleaned) == []
    assert cleaned.cells[2].outputs == [] and cleaned.cells[2].execution_count is None
    assert not {"collapsed", "scrolled", "execution"} & set(cleaned.cells[2].metadata)
    assert "widgets" not in cleaned.metadata and "jupytext" not in cleaned.metadata
    assert cleaned.metadata["kernelspec"] == KERNELSPEC
    assert cleaned.cells[1].metadata["tags"] == ["parameters"]  # tags are kept
    assert [c.source for c in cleaned.cells] == [c.source for c in nb.cells]

    text = path.read_text()
    assert clean_notebook(path) is False  # already clean: the file is not rewritten
    assert path.read_text() == text


def test_clean_notebook_collapses_and_marks_solution_cells(notebook_writer, tmp_path):
    solution = "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"
    path = notebook_writer(
        tmp_path / "04_ddp.ipynb",
        [("params", "N = 1"), ("code", solution), ("code", "x = 1"), ("code", solution)],
    )
    assert clean_notebook(path) is True
    cells = nbformat.read(path, as_version=4).cells
    for index, number in ((1, 1), (3, 2)):
        meta = cells[index].metadata
        assert meta["jupyter"]["source_hidden"] is True
        assert meta["nbgrader"]["solution"] is True
        assert meta["nbgrader"]["grade_id"] == f"04_ddp-solution-{number}"
    assert "nbgrader" not in cells[2].metadata and "jupyter" not in cells[2].metadata
    assert clean_notebook(path) is False


def test_injected_values_must_be_python_literals() -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("X = 1", metadata={"tags": ["parameters"]}))
    with pytest.raises(ValueError, match="plain Python literal"):
        inject_parameters(nb, {"X": float("nan")})
    with pytest.raises(ValueError, match="plain Python literal"):
        inject_parameters(nb, {"X": Path("data")})
    inject_parameters(nb, {"X": [1, "a", None]})
    assert "X = [1, 'a', None]" in nb.cells[1].source


def test_a_lesson_that_cannot_start_is_reported_and_the_course_goes_on(tmp_path) -> None:
    broken = tmp_path / "00_broken.ipynb"
    broken.write_text("this is not a notebook")
    runs = run_course([broken], tmp_path / "out", quick=True, echo=False)
    assert runs[0].status == "failed" and runs[0].error
    assert (tmp_path / "out" / "report.html").exists()
