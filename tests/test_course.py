"""The course runner on tiny notebooks, and the notebook file rules (tooling.notebooks).

Kernel starts cost seconds each, so five tests start five kernels in all: one course run of a
passing and a failing lesson (two kernels), one lesson run in full mode, one as an autograder
runs it, and one whose self-check cell crashes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.exercises import VERDICT_MIME
from mgpu_helpers.tooling.cli import main
from mgpu_helpers.tooling.notebooks import (
    KERNELSPEC,
    SELF_CHECK_TAG,
    clean_notebook,
    find_lessons,
    is_self_check_cell,
    notebook_problems,
    parameter_names,
    parameters_cell_index,
)
from mgpu_helpers.tooling.runner import (
    LessonRun,
    inject_parameters,
    plan_parameters,
    run_course,
    run_lesson,
)

PASSING = [
    ("markdown", "# A passing lesson"),
    ("params", 'N = 1\nLABEL = "default"'),
    (
        "code",
        "import os\n"
        "from mgpu_helpers.config import quick_from_env\n"
        "from mgpu_helpers.exercises import check\n"
        "from mgpu_helpers.record import record\n"
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
    ("code", 'from mgpu_helpers.record import record\nrecord("before", N)'),
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
    assert not any("[self-check]" in t for t in texts)
    outputs = executed.cells[4].outputs  # the cell with the two checks: one display each
    assert [o.output_type for o in outputs][:2] == ["display_data", "display_data"]
    assert not any(o.output_type == "stream" for o in outputs)  # nothing printed besides
    verdicts = outputs[:2]
    assert verdicts[0].data["text/plain"] == "PASS  n is three"
    assert verdicts[0].data[VERDICT_MIME]["name"] == "n is three"
    assert verdicts[1].data[VERDICT_MIME]["passed"] is False
    assert verdicts[1].data["text/plain"].startswith("FAIL  always fails: the check returned")


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
    assert "gloo" in data["hardware"]["backends"] and data["placement"].startswith("[")
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
        "06b_second_part.ipynb",
        "02_b.ipynb",
        "06a_first_part.ipynb",
        "00_setup.ipynb",
        "notes.ipynb",
        "1_short.ipynb",
        "03_c.txt",
        "05_x.ipynb.bak",
        "07ab_two_letters.ipynb",
        "08-dash.ipynb",
    ]:
        (tmp_path / name).write_text("{}")
    assert [p.name for p in find_lessons(tmp_path)] == [
        "00_setup.ipynb",
        "02_b.ipynb",
        "06a_first_part.ipynb",
        "06b_second_part.ipynb",
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


# --- self-checks as an autograder runs them, and a self-check cell that crashes ---------------

GRADED = [
    ("params", "N = 1"),
    ("code", "from mgpu_helpers.exercises import check\nfrom mgpu_helpers.record import record"),
    ("code", "def answer():\n    ### BEGIN SOLUTION\n    return N\n    ### END SOLUTION"),
    ("code", '_ = check("exercise 1: wrong", lambda: answer() == 2, hint="return 2")'),
    ("code", "def other():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"),
    ("code", 'check("exercise 2: right", lambda: other() == 1, hint="return 1");'),
    ("code", 'import os\nrecord("grading", os.environ["MGPU_GRADING"])\nrecord("end", True)'),
]


def test_grading_mode_raises_in_tagged_checks_and_the_run_goes_on(tmp_path, notebook_writer):
    path = notebook_writer(tmp_path / "07_graded.ipynb", GRADED)
    clean_notebook(path)  # tags the self-checks, as every committed lesson is
    run = run_lesson(path, tmp_path / "out", quick=True, grading=True)
    assert run.status == "passed", run.error
    assert run.results == {"grading": "1", "end": True}  # the cell after a raise still ran
    assert run.checks == {"exercise 1: wrong": False, "exercise 2: right": True}
    cells = nbformat.read(run.output_path, as_version=4).cells
    wrong, right = cells[3].outputs, cells[5].outputs
    assert wrong[0].data["text/plain"].startswith("FAIL  exercise 1: wrong: the check returned")
    assert wrong[-1].output_type == "error" and wrong[-1].ename == "CheckFailed"
    assert [o.output_type for o in right] == ["display_data"]  # a pass raises nothing


def test_a_self_check_cell_that_crashes_fails_the_lesson(tmp_path, notebook_writer):
    cells = [*GRADED[:3], ("code", 'check("exercise 1", lambda: True, hint="h")\nundefined_name')]
    path = notebook_writer(tmp_path / "08_crash.ipynb", [*cells, GRADED[-1]])
    clean_notebook(path)
    run = run_lesson(path, tmp_path / "out", quick=True)  # a learner's run: checks never raise
    assert run.status == "failed"
    assert run.error.startswith("NameError") and "undefined_name" in run.error
    assert run.results["grading"] == "0" and run.checks == {"exercise 1": True}


# --- which lessons get which --param --------------------------------------------------------


def _lessons_with(tmp_path, notebook_writer, **params_cells):
    return [
        notebook_writer(tmp_path / f"{stem}.ipynb", [("params", source), ("code", "x = 1")])
        for stem, source in params_cells.items()
    ]


def test_parameter_names_reads_the_parameters_cell(notebook_writer, tmp_path):
    source = "EPOCHS = 3  # passes\nA, B = 1, 2\nLR: float = 0.1\n%time\nEPOCHS = 4"
    nb = _notebook(notebook_writer, tmp_path, [("markdown", "# x"), ("params", source)])
    assert parameter_names(nb) == ["EPOCHS", "A", "B", "LR"]


def test_plan_parameters_sends_each_to_the_lessons_that_have_it(tmp_path, notebook_writer):
    lessons = _lessons_with(
        tmp_path, notebook_writer, **{"00_a": "SEED = 0", "02_b": "EPOCHS = 3\nSEED = 0"}
    )
    per_lesson, ignored = plan_parameters(lessons, {"EPOCHS": 1, "SEED": 5})
    assert per_lesson == {"00_a": {"SEED": 5}, "02_b": {"EPOCHS": 1, "SEED": 5}}
    assert ignored == {"EPOCHS": ["00_a"]}


@pytest.mark.parametrize(("name", "suggestion"), [("EPOCH", "EPOCHS"), ("epochs", "EPOCHS")])
def test_a_param_no_lesson_has_is_an_error_naming_the_closest(
    tmp_path, notebook_writer, name, suggestion
):
    lessons = _lessons_with(
        tmp_path, notebook_writer, **{"00_a": "SEED = 0", "02_b": "EPOCHS = 3\nLR = 0.1"}
    )
    with pytest.raises(ValueError, match=rf"--param {name}: .*did you mean {suggestion}\?"):
        plan_parameters(lessons, {"SEED": 1, name: 1})
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="parameters of these lessons: EPOCHS, LR, SEED"):
        run_course(lessons, out, quick=True, params={name: 1}, echo=False)
    assert not out.exists()  # nothing ran, no report


def test_mgpu_course_reports_a_misspelt_param_before_running(tmp_path, notebook_writer, capsys):
    folder = tmp_path / "notebooks"
    _lessons_with(folder, notebook_writer, **{"00_a": "SEED = 0", "02_b": "EPOCHS = 3"})
    with pytest.raises(SystemExit) as info:
        main(["course", "--notebooks", str(folder), "--out", str(tmp_path / "out"),
                  "--only", "02", "--param", "EPOCH=1"])  # fmt: skip
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--param EPOCH: no lesson run here has a parameter EPOCH; did you mean EPOCHS?" in err
    with pytest.raises(SystemExit):  # SEED is lesson 00's, which --only leaves out
        main(["course", "--notebooks", str(folder), "--only", "02", "--param", "SEED=1"])
    assert not (tmp_path / "out").exists()


def test_run_course_gives_each_lesson_its_params_and_says_who_ignores_one(
    tmp_path, notebook_writer, capsys, monkeypatch
):
    lessons = _lessons_with(tmp_path, notebook_writer, **{"00_a": "X = 0", "02_b": "EPOCHS = 3"})
    asked = {}

    def fake_run_lesson(path, out_dir, *, quick, params=None):  # no kernel
        asked[path.stem] = params
        return LessonRun(path.stem, "passed", 0.0, params=dict(params or {}))

    monkeypatch.setattr("mgpu_helpers.tooling.runner.run_lesson", fake_run_lesson)
    runs = run_course(lessons, tmp_path / "out", quick=True, params={"X": 1, "EPOCHS": 2})
    assert asked == {"00_a": {"X": 1}, "02_b": {"EPOCHS": 2}}
    out = capsys.readouterr().out
    assert "note: X is not a parameter of 02_b: ignored there" in out
    assert "note: EPOCHS is not a parameter of 00_a: ignored there" in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [r["params"] for r in report["lessons"]] == [{"X": 1}, {"EPOCHS": 2}]
    assert [r.status for r in runs] == ["passed", "passed"]


# --- the exercise rules: graded, locked self-checks after collapsed, marked solutions ----------

SOLUTION = "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"
CHECK = '_ = check("exercise 1: f", lambda: f() == 1, hint="return 1")'


def _exercise(notebook_writer, tmp_path, cells=None):
    path = notebook_writer(
        tmp_path / "04_ex.ipynb",
        cells or [("params", "N = 1"), ("code", SOLUTION), ("code", CHECK)],
    )
    clean_notebook(path)
    return path, nbformat.read(path, as_version=4)


def test_clean_marks_self_checks_as_graded_locked_tagged_tests(notebook_writer, tmp_path):
    path, nb = _exercise(notebook_writer, tmp_path)
    assert notebook_problems(nb) == []
    meta = nb.cells[2].metadata
    assert meta["nbgrader"] == {
        "grade": True,
        "grade_id": "04_ex-check-1",
        "locked": True,
        "points": 1,
        "schema_version": 3,
        "solution": False,
    }
    assert meta["tags"] == [SELF_CHECK_TAG]
    nb.cells[2].metadata["nbgrader"]["points"] = 3  # an instructor's weighting is kept
    nbformat.write(nb, path)
    assert clean_notebook(path) is False
    assert nbformat.read(path, as_version=4).cells[2].metadata["nbgrader"]["points"] == 3


def test_a_solution_collapsed_by_hand_without_nbgrader_metadata_is_a_problem(
    notebook_writer, tmp_path
):
    _, nb = _exercise(notebook_writer, tmp_path)
    nb.cells[1].metadata = {"jupyter": {"source_hidden": True}}  # collapsed in JupyterLab
    assert notebook_problems(nb) == [
        "cell 1 is a solution cell without nbgrader's answer metadata (run `mgpu clean`)"
    ]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda nb: nb.cells[2].metadata.pop("nbgrader"), "cell 2 is a self-check without"),
        (lambda nb: nb.cells[2].metadata["nbgrader"].update(locked=False), "cell 2 is a self-"),
        (lambda nb: nb.cells[2].metadata["nbgrader"].update(points=0), "cell 2 is a self-"),
        (lambda nb: nb.cells[2].metadata.pop("tags"), "not tagged 'raises-exception'"),
        (lambda nb: nb.cells[1].metadata.pop("jupyter"), "does not start collapsed"),
        (lambda nb: nb.cells.pop(2), "cell 1 is a solution cell not followed by its self-check"),
        (
            lambda nb: nb.cells[2].metadata["nbgrader"].update(grade_id="04_ex-solution-1"),
            "grade_id '04_ex-solution-1' is used by 2 cells",
        ),
        (
            lambda nb: setattr(nb.cells[1], "source", "def f():\n    return 1"),
            "cell 1 carries nbgrader metadata but is neither",
        ),
    ],
)
def test_exercise_problems_are_reported(notebook_writer, tmp_path, change, problem):
    _, nb = _exercise(notebook_writer, tmp_path)
    change(nb)
    problems = notebook_problems(nb)
    assert any(p.startswith(problem) or problem in p for p in problems), problems


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (CHECK, True),
        ('check("x", t, hint="h");', True),
        ('exercises.check("x", t, "h")', True),
        ("def t():\n    check_all()\n", False),
        ('print("check(")', False),
        ("%time\n_ = check(\n", True),  # a half-typed cell falls back to the text
    ],
)
def test_is_self_check_cell(source, expected):
    assert is_self_check_cell(nbformat.v4.new_code_cell(source)) is expected


def test_mgpu_clean_with_paths_needs_no_lessons_folder(notebook_writer, tmp_path, monkeypatch):
    path = notebook_writer(tmp_path / "anywhere" / "x.ipynb", [("code", SOLUTION)])
    monkeypatch.chdir(tmp_path)  # no notebooks/ here
    assert main(["clean", str(path)]) == 0
    assert nbformat.read(path, as_version=4).cells[0].metadata["nbgrader"]["solution"] is True
