"""The student edition: solution blocks become stubs; everything else is kept."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.tooling.cli import main
from mgpu_helpers.tooling.notebooks import find_lessons
from mgpu_helpers.tooling.student import (
    BEGIN,
    END,
    STUDENT_FILES,
    make_student_copy,
    make_student_edition,
    strip_solutions,
)

SOLVED = f"""\
def scale(x, k):
    \"\"\"Multiply by k.\"\"\"
    {BEGIN}
    y = x * k
    return y
    {END}


result = scale(2, 3)"""


def test_strip_solutions_replaces_the_block_at_its_indentation():
    assert strip_solutions(SOLVED) == (
        "def scale(x, k):\n"
        '    """Multiply by k."""\n'
        "    # YOUR CODE HERE\n"
        "    raise NotImplementedError()\n"
        "\n"
        "\n"
        "result = scale(2, 3)"
    )


def test_strip_solutions_several_blocks_and_top_level():
    source = f"a = 1\n{BEGIN}\nb = 2\n{END}\nif a:\n        {BEGIN}\n        c = 3\n        {END}\n"
    assert strip_solutions(source).splitlines() == [
        "a = 1",
        "# YOUR CODE HERE",
        "raise NotImplementedError()",
        "if a:",
        "        # YOUR CODE HERE",
        "        raise NotImplementedError()",
    ]


def test_strip_solutions_keeps_code_without_markers():
    source = "x = 1\n    y = 2  # indented\n\nz = '### BEGIN SOLUTION in a string'"
    assert strip_solutions(source) == source


def test_stripped_code_compiles_and_raises_not_implemented():
    namespace: dict = {}
    with pytest.raises(NotImplementedError):
        exec(strip_solutions(SOLVED), namespace)
    exec(SOLVED, namespace)  # the solution itself runs
    assert namespace["result"] == 6


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (f"{BEGIN}\nx = 1\n", "without a matching"),
        (f"x = 1\n{END}\n", "without a '### BEGIN SOLUTION' before it"),
        (f"{BEGIN}\n{BEGIN}\nx = 1\n{END}\n{END}\n", "nested"),
        (f"{BEGIN}\nx = 1\n{END}\n{END}\n", "without a '### BEGIN SOLUTION' before it"),
    ],
)
def test_strip_solutions_rejects_unpaired_and_nested_markers(source, message):
    with pytest.raises(ValueError, match=message):
        strip_solutions(source)


def _lesson(path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(f"## Exercise\nFill in `scale` (between {BEGIN} markers)."),
        nbformat.v4.new_code_cell("from mgpu_helpers.exercises import check"),
        nbformat.v4.new_code_cell(
            SOLVED, metadata={"jupyter": {"source_hidden": True}, "tags": ["solution"]}
        ),
        nbformat.v4.new_code_cell(
            'check("scale", lambda: scale(2, 3) == 6, "multiply x by k")',
            metadata={"tags": ["self-check"]},
        ),
    ]
    nbformat.write(nb, path)
    return nb


def _run_cells(nb) -> str:
    """Execute the code cells in order in one namespace, as a kernel would; return stdout."""
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            try:
                exec(cell.source, namespace)
            except NotImplementedError:
                pass  # the stub cell raises when run; the self-check reports it
    return out.getvalue()


def test_make_student_edition(tmp_path):
    src = tmp_path / "lessons" / "05_exercise.ipynb"
    src.parent.mkdir()
    teacher = _lesson(src)
    before = src.read_text()
    written = make_student_edition([src], tmp_path / "student")
    assert written == [tmp_path / "student" / "05_exercise.ipynb"]
    assert src.read_text() == before  # the teacher edition is untouched

    student = nbformat.read(written[0], as_version=4)
    nbformat.validate(student)
    assert len(student.cells) == len(teacher.cells)
    assert student.cells[0].source == teacher.cells[0].source  # markdown kept, even with BEGIN
    assert student.cells[1].source == teacher.cells[1].source
    stub = student.cells[2]
    assert BEGIN not in stub.source and "y = x * k" not in stub.source
    assert "raise NotImplementedError()" in stub.source
    assert "source_hidden" not in stub.metadata.get("jupyter", {})  # the stub is shown
    assert stub.metadata["tags"] == ["solution"]
    assert student.cells[3].source == teacher.cells[3].source  # the self-check is kept

    # the solutions pass, the stubs fail with the "not implemented yet" message
    assert "PASS  scale" in _run_cells(teacher)
    student_out = _run_cells(student)
    assert "FAIL  scale" in student_out
    assert "not implemented yet" in student_out


def test_make_student_edition_names_the_bad_cell(tmp_path):
    path = tmp_path / "03_bad.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(f"{BEGIN}\ny = 2")]
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match=r"^03_bad.ipynb, cell 1: .*without a matching"):
        make_student_edition([path], tmp_path / "out")


def test_make_student_edition_of_several_notebooks(tmp_path):
    paths = [tmp_path / "01_a.ipynb", tmp_path / "02_b.ipynb"]
    for p in paths:
        _lesson(p)
    out = make_student_edition(paths, tmp_path / "nested" / "student")
    assert [p.name for p in out] == ["01_a.ipynb", "02_b.ipynb"]
    assert all(p.exists() for p in out)


# --- the student copy of the whole course (`make student`) ---------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_make_student_copy_is_the_course_with_student_notebooks(tmp_path):
    lessons = find_lessons(ROOT / "notebooks")
    out = make_student_copy(ROOT, tmp_path / "handout", lessons)
    for name in STUDENT_FILES:
        assert (out / name).exists(), f"the student copy lacks {name}"
    assert (out / "mgpu_helpers" / "exercises.py").read_text() == (
        ROOT / "mgpu_helpers" / "exercises.py"
    ).read_text()
    assert not list(out.rglob("__pycache__"))
    assert not (out / "tests").exists() and not (out / "grading").exists()
    written = sorted(p.name for p in (out / "notebooks").iterdir())
    assert written == [p.name for p in lessons]
    for path in (out / "notebooks").iterdir():
        text = path.read_text()
        assert BEGIN not in text and "raise NotImplementedError()" in text
    assert list((out / "data").iterdir()) == [out / "data" / "README.md"]


def test_make_student_copy_replaces_its_own_copy_and_nothing_else(tmp_path):
    lessons = find_lessons(ROOT / "notebooks")[:1]
    out = make_student_copy(ROOT, tmp_path / "copy", lessons)
    (out / "notebooks" / "99_stale.ipynb").write_text("{}")
    make_student_copy(ROOT, out, lessons)  # the next `make student`
    assert not (out / "notebooks" / "99_stale.ipynb").exists()

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep me")
    with pytest.raises(ValueError, match="not empty and holds no student copy"):
        make_student_copy(ROOT, mine, lessons)
    assert (mine / "thesis.tex").read_text() == "keep me"


@pytest.mark.parametrize("inside", ["", "notebooks", "mgpu_helpers/x", "docs"])
def test_make_student_copy_refuses_to_write_into_the_course(inside):
    with pytest.raises(ValueError, match="is part of the course itself"):
        make_student_copy(ROOT, ROOT / inside, find_lessons(ROOT / "notebooks"))


def test_make_student_copy_needs_the_course_files(tmp_path):
    lesson = tmp_path / "notebooks" / "01_a.ipynb"
    lesson.parent.mkdir()
    _lesson(lesson)
    with pytest.raises(ValueError, match="lacks mgpu_helpers, pyproject.toml"):
        make_student_copy(tmp_path, tmp_path / "out", [lesson])


def test_mgpu_student_writes_the_copy(tmp_path, capsys):
    out = tmp_path / "student"
    assert main(["student", "--notebooks", str(ROOT / "notebooks"), "--out", str(out)]) == 0
    assert (out / "Makefile").exists() and (out / "notebooks" / "00_setup.ipynb").exists()
    assert f"wrote the student copy of {ROOT} to {out}" in capsys.readouterr().out
