"""The student edition: solutions replaced by stubs (`make student`; for instructors).

Solutions sit between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines, the markers
nbgrader uses. Each such block becomes a ``raise NotImplementedError()`` stub at the same
indentation; everything else, the self-checks included, is kept.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

__all__ = ["BEGIN", "END", "make_student_edition", "strip_solutions"]

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"


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
