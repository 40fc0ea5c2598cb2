"""Code written in the lessons, read from their notebooks (lessons 03 and later).

Later lessons show it as a diff (lesson 04b: its DDP worker against lesson 02's loop; lesson 07:
the course's ``torchrun`` script against lesson 04b's worker, through :func:`script_function`),
and tests and benchmarks run it (:func:`load_lesson_code`), so no copy exists to drift from the
lesson. Standard library only: the GPU machine runs the tests without Jupyter.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import html
import json
import linecache
import symtable
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Definition",
    "Diff",
    "lesson_definitions",
    "lesson_function",
    "lesson_imports",
    "load_lesson_code",
    "python_only",
    "script_function",
    "show_diff",
]

_NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def python_only(source: str) -> str:
    """A code cell without IPython's lines (``%magic``, ``!command``), blanked so that ``ast``
    reads it and line numbers stay those of the cell."""
    return "\n".join("" if x.lstrip()[:1] in ("%", "!") else x for x in source.splitlines())


def _find_lesson(lesson: str, folder: str | Path | None) -> Path:
    """The notebook ``NN_*.ipynb`` of ``lesson`` ("02"), or ``lesson`` itself if it is a path."""
    pattern = f"{lesson}_*.ipynb"
    folders = [Path(folder)] if folder is not None else [Path.cwd(), _NOTEBOOKS]
    if lesson.endswith(".ipynb"):
        pattern, folders = Path(lesson).name, [Path(lesson).parent]
    for where in folders:
        if found := sorted(where.glob(pattern)):
            return found[0]
    raise ValueError(
        f"no notebook for lesson {lesson!r} ({pattern}) in {', '.join(map(str, folders))}; "
        "run from the notebooks folder or pass folder="
    )


@dataclass(frozen=True)
class Definition:
    """One top-level definition in a lesson's code cell."""

    name: str
    kind: str  # "function", "class" or "assignment"
    source: str  # its lines in the cell (decorators included), ending with a newline
    node: ast.stmt  # parsed, with line numbers counted in its cell
    filename: str  # "<notebook path> (cell N)": what tracebacks of the loaded code show
    cell_text: str  # the whole cell (IPython lines blanked), for those tracebacks


def _names(node: ast.stmt) -> tuple[str, list[str]] | None:
    """What a top-level statement defines: its kind and names (None: not a definition)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "function", [node.name]
    if isinstance(node, ast.ClassDef):
        return "class", [node.name]
    if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
        return "assignment", [t.id for t in node.targets]  # x = 1, or x = y = 1
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
        return "assignment", [node.target.id]  # x: int = 1
    return None


def _code_cells(path: Path) -> Iterator[tuple[int, str, ast.Module]]:
    """Each code cell of the notebook ``path`` that parses: its number, Python text and tree."""
    for number, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"], 1):
        if cell["cell_type"] != "code":
            continue
        text = python_only("".join(cell["source"])) + "\n"  # source: a string, or a list of lines
        try:
            yield number, text, ast.parse(text)
        except SyntaxError:
            continue


def lesson_imports(lesson: str, folder: str | Path | None = None) -> dict[str, Any]:
    """The names bound by ``lesson``'s top-level imports, imported here (lessons 09a, 09b, 10).

    The namespace :func:`load_lesson_code` needs, taken from the lesson itself rather than
    listed again by each test and benchmark. An import this Python cannot do (IPython on a bare
    GPU machine, say) is left out: code that reads one of its names then fails with NameError.
    """
    path = _find_lesson(lesson, folder)
    namespace: dict[str, Any] = {}
    for _, _, tree in _code_cells(path):
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                try:
                    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
                except ImportError:
                    continue
    namespace.pop("__builtins__", None)
    return namespace


def lesson_definitions(lesson: str, folder: str | Path | None = None) -> dict[str, Definition]:
    """The top-level functions, classes and simple assignments of ``lesson``'s code cells.

    ``lesson``: "02" (looked for in ``folder``, else here, then in the course's ``notebooks/``)
    or a path. In notebook order; the last cell defining a name wins, as in a kernel.
    """
    path = _find_lesson(lesson, folder)
    found: dict[str, Definition] = {}
    for number, text, tree in _code_cells(path):
        lines = text.splitlines()
        for node in tree.body:
            if (defined := _names(node)) is None:
                continue
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            code = "\n".join(lines[first - 1 : node.end_lineno]) + "\n"
            for name in defined[1]:
                found.pop(name, None)  # a later definition moves to the end
                found[name] = Definition(
                    name, defined[0], code, node, f"{path.resolve()} (cell {number})", text
                )
    return found


def _lookup(
    lesson: str, folder: str | Path | None, names: Sequence[str], kind: str = ""
) -> tuple[Path, dict[str, Definition]]:
    """``lesson``'s notebook and definitions; ValueError naming what it has if one is missing."""
    path = _find_lesson(lesson, folder)
    found = lesson_definitions(str(path))
    if missing := [n for n in names if n not in found or kind not in ("", found[n].kind)]:
        named = [n for n, d in found.items() if d.kind != "assignment"]
        raise ValueError(
            f"{path.name} defines no {kind + ' ' if kind else ''}{', '.join(map(repr, missing))} "
            f"in its code cells; it defines: {', '.join(named) or 'no function or class'} "
            f"(and {len(found) - len(named)} assigned names)"
        )
    return path, found


def lesson_function(lesson: str, name: str, folder: str | Path | None = None) -> str:
    """The source of the function ``name`` in ``lesson``'s notebook (lesson 04b's diff)."""
    return _lookup(lesson, folder, [name], "function")[1][name].source


def script_function(path: str | Path, name: str) -> str:
    """The source of the top-level function ``name`` in the Python file ``path`` (lesson 07).

    Read with ``ast``, not imported, so the file's imports and side effects never run: lesson 07
    diffs ``scripts/train_ddp.py``'s ``train_ddp`` against lesson 04b's worker this way. Its
    decorators are included; ValueError names the functions the file defines if ``name`` is
    not one of them.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no Python file at {path.resolve()}; pass the script's path")
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in functions:
        if node.name == name:
            lines = text.splitlines()
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return "\n".join(lines[first - 1 : node.end_lineno]) + "\n"
    defined = ", ".join(n.name for n in functions) or "no top-level function"
    raise ValueError(f"{path.name} defines no top-level function {name!r}; it defines: {defined}")


def _reads(table: symtable.SymbolTable) -> set[str]:
    """The global names a scope and the scopes inside it read."""
    symbols = [s for s in table.get_symbols() if s.is_referenced() and not s.is_local()]
    names = {s.get_name() for s in symbols if s.is_global()}
    return names.union(*map(_reads, table.get_children()))


def load_lesson_code(
    lesson: str, names: Sequence[str], namespace: dict, folder: str | Path | None = None
) -> types.SimpleNamespace:
    """Run the definitions ``names`` of ``lesson``'s code cells in ``namespace``; return them.

    ``namespace`` holds the lesson's imports the code reads (ValueError names any missing) and
    receives the definitions. Their module is ``namespace["__name__"]`` (default: the notebook's,
    which no one can import, so ``launch`` sends them by value); tracebacks name the cell.
    """
    path, definitions = _lookup(lesson, folder, names)
    chosen = list({id(d.node): d for n, d in definitions.items() if n in names}.values())  # x=y=1
    wanted = {n for d in chosen for n in _names(d.node)[1]}
    unbound = set().union(*(_reads(symtable.symtable(d.source, "", "exec")) for d in chosen))
    lacking = sorted(n for n in unbound - wanted if n not in namespace and not hasattr(builtins, n))
    if lacking:
        raise ValueError(
            f"the code of {', '.join(names)} in {path.name} uses {', '.join(lacking)}, which the "
            "namespace lacks: add them to the namespace you pass (the lesson's imports, or "
            "other names it defines)"
        )
    namespace.setdefault("__name__", path.stem)
    for d in chosen:  # no file to read: tracebacks take the cell's lines from linecache
        lines = d.cell_text.splitlines(keepends=True)
        linecache.cache[d.filename] = (len(d.cell_text), None, lines, d.filename)
        # dont_inherit: compiled as in the notebook, not under this module's `from __future__
        # import annotations` (which would turn the cell's annotations into strings; DDP's
        # register_comm_hook, for one, checks the hook's annotations)
        code = compile(ast.Module([d.node], []), d.filename, "exec", dont_inherit=True)
        exec(code, namespace)
    return types.SimpleNamespace(**{name: namespace[name] for name in names})


_STYLES = {"+": "background:#e6ffec;color:#116329", "-": "background:#ffebe9;color:#82071e"}


@dataclass(frozen=True, repr=False)
class Diff:
    """A unified diff: coloured HTML in Jupyter, plain text anywhere else."""

    text: str  # the unified diff, as `diff -u` prints it
    added: int  # lines only in the second source
    removed: int  # lines only in the first source

    def __repr__(self) -> str:  # str() too
        return self.text

    def _repr_html_(self) -> str:
        rows = []
        for line in self.text.splitlines():
            style = "font-weight:bold" if line[:3] in ("+++", "---") else _STYLES.get(line[:1], "")
            rows.append(f'<span style="{style}">{html.escape(line)}</span>\n')
        return (
            f'<pre style="line-height:1.3;font-size:12px">{"".join(rows)}</pre>'
            f"<p style='font-size:12px'>{self.added} line(s) added, {self.removed} removed</p>"
        )


def show_diff(
    before: str,
    after: str,
    labels: tuple[str, str] = ("before", "after"),
    context: int | None = None,
) -> Diff:
    """The unified diff from ``before`` to ``after`` (lesson 04b: its DDP worker vs lesson 02).

    ``context``: unchanged lines around each change (None: all, the whole function reads on).
    """
    old, new = before.splitlines(), after.splitlines()
    n = max(len(old), len(new)) if context is None else context
    lines = list(difflib.unified_diff(old, new, *labels, n=n, lineterm=""))
    body = lines[2:]  # after the ---/+++ header
    added = sum(line.startswith("+") for line in body)
    removed = sum(line.startswith("-") for line in body)
    return Diff("".join(line + "\n" for line in lines), added, removed)
