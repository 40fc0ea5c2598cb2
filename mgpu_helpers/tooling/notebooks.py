"""Lesson notebooks as files: finding them, their parameters cell, and keeping them clean.

Committed without outputs, with a first code cell tagged ``parameters``; each exercise is a
solution cell (``### BEGIN SOLUTION``) and next a self-check calling ``check(...)``, with
nbgrader's metadata so nbgrader grades the lessons as they are. :func:`notebook_problems` says
what breaks these rules; :func:`clean_notebook` (``mgpu clean``) fixes what it can.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from itertools import pairwise
from pathlib import Path

import nbformat

from mgpu_helpers.lesson_code import python_only

__all__ = [
    "PARAMETERS_TAG",
    "SELF_CHECK_TAG",
    "clean_notebook",
    "exercise_check_indices",
    "find_lessons",
    "is_self_check_cell",
    "is_solution_cell",
    "notebook_problems",
    "parameter_names",
    "parameters_cell_index",
]

PARAMETERS_TAG = "parameters"
# nbclient (and so papermill, the course runner and the tests) goes on after an error in a cell
# with this tag. A self-check raises only under an autograder; the tag lets such a run reach the
# end, as nbgrader's own executor does.
SELF_CHECK_TAG = "raises-exception"
SOLUTION_BEGIN = "### BEGIN SOLUTION"  # nbgrader's marker (the student edition strips it too)
DEFAULT_POINTS = 1  # points of a self-check cell that has none yet
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
_EDITOR_KEYS = ("lines_to_next_cell", "execution", "collapsed", "scrolled")


def find_lessons(directory: str | Path = "notebooks") -> list[Path]:
    """The lesson notebooks, in course order (their names start with the lesson number).

    A lesson in parts has a letter after its number: ``06a_name.ipynb``, ``06b_name.ipynb``.
    """
    paths = sorted(
        p for p in Path(directory).glob("[0-9][0-9]*.ipynb") if re.match(r"\d\d[a-z]?_", p.name)
    )
    if not paths:
        raise FileNotFoundError(
            f"no lesson notebooks (NN_name.ipynb, or NNa_name.ipynb for a part) in "
            f"{Path(directory).resolve()}"
        )
    return paths


def parameters_cell_index(nb: nbformat.NotebookNode) -> int:
    """Index of the cell tagged ``parameters``; ValueError when the notebook lacks one."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and PARAMETERS_TAG in cell.get("metadata", {}).get("tags", []):
            return i
    raise ValueError("the notebook has no code cell tagged 'parameters'")


def parameter_names(nb: nbformat.NotebookNode) -> list[str]:
    """The names the parameters cell assigns, in order (what ``--param NAME=...`` may set)."""
    tree = ast.parse(python_only(nb.cells[parameters_cell_index(nb)].source))
    names: list[str] = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            for leaf in ast.walk(target) if target is not None else ():
                if isinstance(leaf, ast.Name) and leaf.id not in names:
                    names.append(leaf.id)
    return names


def is_solution_cell(cell: nbformat.NotebookNode) -> bool:
    """A code cell holding an exercise's solution between nbgrader's markers."""
    return cell.cell_type == "code" and SOLUTION_BEGIN in cell.source


def is_self_check_cell(cell: nbformat.NotebookNode) -> bool:
    """A code cell that calls ``check(...)`` at its top level (``_ = check(...)`` too)."""
    if cell.cell_type != "code" or "check(" not in cell.source:
        return False
    try:
        tree = ast.parse(python_only(cell.source))
    except SyntaxError:  # a learner's half-typed cell: fall back to the text
        return re.search(r"^(_\s*=\s*)?check\(", cell.source, re.MULTILINE) is not None
    calls = [n.value for n in tree.body if isinstance(n, (ast.Expr, ast.Assign))]
    funcs = [call.func for call in calls if isinstance(call, ast.Call)]
    return any(getattr(f, "id", getattr(f, "attr", None)) == "check" for f in funcs)


def exercise_check_indices(nb: nbformat.NotebookNode) -> list[int]:
    """Indices of the graded self-checks: the code cell right after each solution cell, when it
    calls ``check(...)`` (a ``check`` elsewhere in a lesson is a plain check, not graded)."""
    code = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    return [
        after
        for i, after in pairwise(code)
        if is_solution_cell(nb.cells[i]) and is_self_check_cell(nb.cells[after])
    ]


def _solution_metadata(grade_id: str) -> dict:
    # An autograded answer: nbgrader's generate_assignment takes it as is.
    meta = {"grade": False, "grade_id": grade_id, "locked": False}
    return {**meta, "schema_version": 3, "solution": True}


def _check_metadata(grade_id: str, points: float) -> dict:
    # An autograder test: graded, and locked so a learner cannot edit it away.
    meta = {"grade": True, "grade_id": grade_id, "locked": True, "points": points}
    return {**meta, "schema_version": 3, "solution": False}


def _marked(meta: dict | None, expected: dict) -> bool:
    """nbgrader metadata ``meta`` says what ``expected`` says, under any grade id."""
    if not meta or not meta.get("grade_id"):
        return False
    return all(meta.get(key) == value for key, value in expected.items() if key != "grade_id")


def _points(cell: nbformat.NotebookNode) -> float:
    """The points an instructor gave this check (kept by ``mgpu clean``), else the default."""
    points = cell.metadata.get("nbgrader", {}).get("points")
    ok = isinstance(points, (int, float)) and not isinstance(points, bool) and points > 0
    return points if ok else DEFAULT_POINTS


def notebook_problems(nb: nbformat.NotebookNode) -> list[str]:
    """What breaks the commit rules: outputs, no parameters cell first, exercises nbgrader would
    not grade (metadata, collapse, tag, a self-check right after each solution, unique ids)."""
    problems = []
    code = [c for c in nb.cells if c.cell_type == "code"]
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count")):
            problems.append(f"cell {i} has outputs or an execution count (run `mgpu clean`)")
    try:
        index = parameters_cell_index(nb)
        if code and nb.cells[index] is not code[0]:
            problems.append("the cell tagged 'parameters' is not the first code cell")
    except ValueError as exc:
        problems.append(str(exc))
    fix = "(run `mgpu clean`)"
    graded = set(exercise_check_indices(nb))
    for i, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader")
        if is_solution_cell(cell):
            if not _marked(meta, _solution_metadata("")):
                problems.append(
                    f"cell {i} is a solution cell without nbgrader's answer metadata {fix}"
                )
            if not cell.metadata.get("jupyter", {}).get("source_hidden"):
                problems.append(f"cell {i} is a solution cell that does not start collapsed {fix}")
            after = next((c for c in nb.cells[i + 1 :] if c.cell_type == "code"), None)
            if after is None or not is_self_check_cell(after):
                problems.append(
                    f"cell {i} is a solution cell not followed by its self-check (the next code "
                    'cell must call check("exercise N: ...", test, hint=...))'
                )
        elif i in graded:
            if not _marked(meta, _check_metadata("", _points(cell))):
                problems.append(
                    f"cell {i} is a self-check without nbgrader's graded, locked test metadata "
                    f"{fix}"
                )
            if SELF_CHECK_TAG not in cell.metadata.get("tags", []):
                problems.append(f"cell {i} is a self-check not tagged '{SELF_CHECK_TAG}' {fix}")
        elif meta is not None and (meta.get("solution") or meta.get("grade")):
            problems.append(
                f"cell {i} carries nbgrader metadata but is neither a solution cell (with "
                f"'{SOLUTION_BEGIN}') nor the self-check right after one; remove the metadata or "
                "the cell"
            )
    ids = Counter(
        c.metadata["nbgrader"].get("grade_id") for c in nb.cells if "nbgrader" in c.metadata
    )
    for grade_id, n in ids.items():
        if grade_id and n > 1:
            problems.append(f"grade_id {grade_id!r} is used by {n} cells {fix}")
    return problems


def clean_notebook(path: str | Path) -> bool:
    """Strip outputs, execution counts and editor metadata in place; True when it changed.

    Solution cells are collapsed and marked as nbgrader answer cells on the way, and the
    self-check after each as a graded, locked nbgrader test cell (its points kept) tagged
    ``raises-exception``.
    """
    path = Path(path)
    before = path.read_text()
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        for key in _EDITOR_KEYS:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    solutions = checks = 0
    graded = set(exercise_check_indices(nb))
    for i, cell in enumerate(nb.cells):
        if is_solution_cell(cell):
            solutions += 1
            cell.metadata.setdefault("jupyter", {})["source_hidden"] = True  # collapsed
            cell.metadata["nbgrader"] = _solution_metadata(f"{path.stem}-solution-{solutions}")
        elif i in graded:
            checks += 1
            grade_id = f"{path.stem}-check-{checks}"
            cell.metadata["nbgrader"] = _check_metadata(grade_id, _points(cell))
            tags = cell.metadata.setdefault("tags", [])
            if SELF_CHECK_TAG not in tags:
                tags.append(SELF_CHECK_TAG)
    for key in ("jupytext", "widgets"):
        nb.metadata.pop(key, None)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata.setdefault("language_info", {"name": "python"})
    nbformat.validate(nb)
    after = nbformat.writes(nb) + "\n"
    if after != before:
        path.write_text(after)
        return True
    return False
