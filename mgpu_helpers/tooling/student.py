"""The student edition: solutions replaced by stubs (`make student`; for instructors).

Solutions sit between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines, the markers
nbgrader uses. Each such block becomes a ``raise NotImplementedError()`` stub at the same
indentation; everything else, the self-checks included, is kept. :func:`make_student_copy`
writes what an instructor hands out: the whole course with those notebooks in ``notebooks/``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat

__all__ = [
    "BEGIN",
    "END",
    "STUDENT_FILES",
    "make_student_copy",
    "make_student_edition",
    "strip_solutions",
]

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"

# What a student copy holds besides the student notebooks: enough to `make lab` and
# `make course` (the package, its requirements, the Makefile) and the course's own texts.
# Not copied: the tests (they expect the solutions), benchmarks, scripts and CI.
STUDENT_FILES = (
    "mgpu_helpers",
    "pyproject.toml",
    "requirements.txt",
    "requirements-dev.txt",
    "environment.yml",
    "Makefile",
    "README.md",
    "docs",
    "jupyter",  # JupyterLab defaults that `make lab` installs (widget state saved)
    "data/README.md",
    ".gitignore",
)
# Left in the folder, so that the next `make student` knows it may replace it.
STAMP = ".mgpu-student-copy"
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".ipynb_checkpoints")


def strip_solutions(source: str) -> str:
    """Replace each solution block in ``source`` with a stub; ValueError on unpaired markers."""
    out: list[str] = []
    inside = False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested '{BEGIN}' before '{END}'")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out += [f"{indent}# YOUR CODE HERE", f"{indent}raise NotImplementedError()"]
        elif stripped == END:
            if not inside:
                raise ValueError(f"'{END}' without a '{BEGIN}' before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"'{BEGIN}' without a matching '{END}'")
    return "\n".join(out)


def make_student_edition(notebooks: list[Path], out_dir: str | Path) -> list[Path]:
    """Write each notebook with its solutions stubbed out under ``out_dir``; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or BEGIN not in cell.source:
                continue
            try:
                cell.source = strip_solutions(cell.source)
            except ValueError as exc:
                raise ValueError(f"{path.name}, cell {i}: {exc}") from None
            cell.metadata.get("jupyter", {}).pop("source_hidden", None)  # show the stub
        target = out_dir / path.name
        nbformat.write(nb, target)
        written.append(target)
    return written


def make_student_copy(root: str | Path, out_dir: str | Path, notebooks: list[Path]) -> Path:
    """Write the student copy of the course in ``root`` to ``out_dir``; returns ``out_dir``.

    ``out_dir`` gets :data:`STUDENT_FILES` from ``root`` and the student edition of
    ``notebooks`` in ``out_dir/notebooks/``. A previous copy there is replaced; any other
    non-empty folder is refused (ValueError), so that nothing of yours is deleted.
    """
    root, out_dir = Path(root).resolve(), Path(out_dir).resolve()
    missing = [name for name in STUDENT_FILES if not (root / name).exists()]
    if missing:
        raise ValueError(
            f"{root} lacks {', '.join(missing)}: run `mgpu student` in the course's top folder"
        )
    sources = [root / name for name in STUDENT_FILES] + [
        Path(nb).resolve().parent for nb in notebooks
    ]
    if _inside(root, out_dir) or any(_inside(out_dir, source) for source in sources):
        raise ValueError(f"--out {out_dir} is part of the course itself; choose another folder")
    if out_dir.exists() and any(out_dir.iterdir()):
        # `mgpu student` before the copies wrote only the notebooks, into build/student/
        old_edition = (root / "build") in out_dir.parents and all(
            p.suffix == ".ipynb" for p in out_dir.iterdir()
        )
        if not (out_dir / STAMP).exists() and not old_edition:
            raise ValueError(
                f"{out_dir} is not empty and holds no student copy written by `mgpu student`; "
                "remove it or choose another --out"
            )
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for name in STUDENT_FILES:
        source, target = root / name, out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=_SKIP)
        else:
            shutil.copy2(source, target)
    make_student_edition(notebooks, out_dir / "notebooks")
    (out_dir / STAMP).write_text(
        "Student copy of the course, written by `mgpu student` (`make student`).\n"
        "The next `make student` replaces this folder.\n"
    )
    return out_dir


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents
