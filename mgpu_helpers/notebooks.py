"""Lesson notebooks as files: finding them, their parameters cell, and keeping them clean.

Notebooks are committed without outputs, each with a first code cell tagged ``parameters``.
:func:`notebook_problems` says what breaks those rules (the tests use it) and
:func:`clean_notebook` fixes what can be fixed (``mgpu clean``, before a commit).
"""

from __future__ import annotations

from pathlib import Path

import nbformat

__all__ = [
    "PARAMETERS_TAG",
    "clean_notebook",
    "find_lessons",
    "notebook_problems",
    "parameters_cell_index",
]

PARAMETERS_TAG = "parameters"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
_EDITOR_KEYS = ("lines_to_next_cell", "execution", "collapsed", "scrolled")


def find_lessons(directory: str | Path = "notebooks") -> list[Path]:
    """The lesson notebooks, in course order (their names start with the lesson number)."""
    paths = sorted(Path(directory).glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise FileNotFoundError(
            f"no lesson notebooks (NN_name.ipynb) in {Path(directory).resolve()}"
        )
    return paths


def parameters_cell_index(nb: nbformat.NotebookNode) -> int:
    """Index of the cell tagged ``parameters``; ValueError when the notebook lacks one."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and PARAMETERS_TAG in cell.get("metadata", {}).get("tags", []):
            return i
    raise ValueError("the notebook has no code cell tagged 'parameters'")


def notebook_problems(nb: nbformat.NotebookNode) -> list[str]:
    """What breaks the commit rules: outputs, execution counts, a missing parameters cell."""
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
    return problems


def clean_notebook(path: str | Path) -> bool:
    """Strip outputs, execution counts and editor metadata in place; True when it changed.

    Solution cells are collapsed and marked as nbgrader solution cells on the way.
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
    solutions = 0
    for cell in nb.cells:
        if cell.cell_type == "code" and "### BEGIN SOLUTION" in cell.source:
            solutions += 1
            cell.metadata.setdefault("jupyter", {})["source_hidden"] = True  # collapsed
            cell.metadata["nbgrader"] = {  # lets nbgrader's generate_assignment take it as is
                "grade": False,
                "grade_id": f"{path.stem}-solution-{solutions}",
                "locked": False,
                "schema_version": 3,
                "solution": True,
            }
    nb.metadata.pop("jupytext", None)
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata.setdefault("language_info", {"name": "python"})
    nbformat.validate(nb)
    after = nbformat.writes(nb) + "\n"
    if after != before:
        path.write_text(after)
        return True
    return False
