"""What one lesson adds to another, shown as a diff (lessons 04 and later).

:func:`lesson_function` reads the source of a function written in a code cell of another
lesson's notebook; :func:`show_diff` shows two sources as a unified diff, coloured in
JupyterLab and plain text elsewhere. Lesson 04 shows its DDP worker as a diff of lesson 02's
single-device loop, the way pytorch/examples' DDP series shows each step as a small diff.
"""

from __future__ import annotations

import ast
import difflib
import html
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Diff", "lesson_function", "show_diff"]

_NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"  # beside the package


def _find_lesson(lesson: str, folder: str | Path | None) -> Path:
    """The notebook ``NN_*.ipynb`` of ``lesson`` ("02"), or ``lesson`` itself if it is a path."""
    if lesson.endswith(".ipynb"):
        path = Path(lesson)
        if not path.is_file():
            raise ValueError(f"no notebook at {path}; give an existing path or a number like '02'")
        return path
    folders = [Path(folder)] if folder is not None else [Path.cwd(), _NOTEBOOKS]
    for where in folders:
        found = sorted(where.glob(f"{lesson}_*.ipynb"))
        if found:
            return found[0]
    raise ValueError(
        f"no notebook for lesson {lesson!r} ({lesson}_*.ipynb) in "
        f"{', '.join(str(f) for f in folders)}; run from the notebooks folder or pass folder="
    )


def _cell_tree(source: str) -> tuple[ast.Module, str] | None:
    """Parse one code cell; IPython lines (``%magic``, ``!command``) are blanked first."""
    lines = source.splitlines()
    plain = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)
    try:
        return ast.parse(plain), plain
    except SyntaxError:
        return None


def lesson_function(lesson: str, name: str, folder: str | Path | None = None) -> str:
    """The source of the function ``name`` written in a code cell of ``lesson``'s notebook.

    ``lesson`` is the number ("02") or a path to the ``.ipynb``. The notebook is looked for in
    ``folder``, else in the current folder (a lesson's own), then in the course's ``notebooks/``.
    When several cells define ``name``, the last one wins, as in a kernel run top to bottom.
    """
    path = _find_lesson(lesson, folder)
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found: str | None = None
    defined: list[str] = []
    for cell in cells:
        if cell.get("cell_type") != "code":
            continue
        source = cell["source"]
        parsed = _cell_tree(source if isinstance(source, str) else "".join(source))
        if parsed is None:
            continue
        tree, text = parsed
        lines = text.splitlines()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.append(node.name)
                if node.name == name:
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    found = "\n".join(lines[first - 1 : node.end_lineno]) + "\n"
    if found is None:
        names = ", ".join(dict.fromkeys(defined)) or "none"
        raise ValueError(
            f"{path.name} defines no function {name!r} in its code cells; it defines: {names}"
        )
    return found


@dataclass(frozen=True)
class Diff:
    """A unified diff: coloured HTML in Jupyter, plain text anywhere else."""

    text: str  # the unified diff, as `diff -u` prints it
    added: int  # lines only in the second source
    removed: int  # lines only in the first source

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        styles = {
            "+": "background:#e6ffec;color:#116329",
            "-": "background:#ffebe9;color:#82071e",
            "@": "color:#6e7781",
        }
        rows = []
        for line in self.text.splitlines():
            head = line[:3] in ("+++", "---")
            style = "font-weight:bold" if head else styles.get(line[:1], "")
            cell = html.escape(line) or " "
            rows.append(f'<span style="{style}">{cell}</span>' if style else cell)
        body = "\n".join(rows)
        summary = f"{self.added} line(s) added, {self.removed} removed"
        return (
            f'<pre style="line-height:1.3;font-size:12px">{body}</pre>'
            f"<p style='font-size:12px'>{summary}</p>"
        )


def show_diff(
    before: str,
    after: str,
    labels: tuple[str, str] = ("before", "after"),
    context: int | None = None,
) -> Diff:
    """The unified diff from ``before`` to ``after`` (lesson 04: its DDP worker vs lesson 02).

    ``context``: unchanged lines shown around each change (None: every line, so the whole
    function reads top to bottom with its changes marked). Display the result in a notebook
    (it renders coloured) or ``print`` it.
    """
    old, new = before.splitlines(), after.splitlines()
    n = max(len(old), len(new)) if context is None else context
    lines = list(difflib.unified_diff(old, new, labels[0], labels[1], n=n, lineterm=""))
    body = [line for line in lines if line[:3] not in ("+++", "---")]
    added = sum(line.startswith("+") for line in body)
    removed = sum(line.startswith("-") for line in body)
    return Diff("\n".join(lines) + ("\n" if lines else ""), added, removed)
