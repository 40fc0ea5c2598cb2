"""Code written in the lessons, read from their notebooks (lessons 03 and later).

A lesson writes what it teaches in its own cells. The same definitions are shown as a diff in
later lessons (:func:`lesson_function`, :func:`show_diff`: lesson 04 shows its DDP worker as a
diff of lesson 02's single-device loop, the way pytorch/examples' DDP series shows each step) and
run by the tests and benchmarks (:func:`load_lesson_code`), so no copy of a lesson's code exists
to drift from it. Standard library only: the GPU machine runs tests without Jupyter.
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Definition",
    "Diff",
    "lesson_definitions",
    "lesson_function",
    "load_lesson_code",
    "show_diff",
]

_NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"  # beside the package
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


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
    if isinstance(node, _FUNCTIONS):
        return "function", [node.name]
    if isinstance(node, ast.ClassDef):
        return "class", [node.name]
    if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
        return "assignment", [t.id for t in node.targets]  # x = 1, or x = y = 1
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
        return "assignment", [node.target.id]  # x: int = 1
    return None


def lesson_definitions(lesson: str, folder: str | Path | None = None) -> dict[str, Definition]:
    """The top-level functions, classes and simple assignments of ``lesson``'s code cells.

    ``lesson`` is the number ("02") or a path to the ``.ipynb``; the notebook is looked for in
    ``folder``, else in the current folder (a lesson's own), then in the course's ``notebooks/``.
    Keyed by name, in notebook order; when several cells define a name, the last one wins, as in
    a kernel run top to bottom.
    """
    path = _find_lesson(lesson, folder)
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found: dict[str, Definition] = {}
    for number, cell in enumerate(cells, start=1):
        if cell.get("cell_type") != "code":
            continue
        source = cell["source"]
        parsed = _cell_tree(source if isinstance(source, str) else "".join(source))
        if parsed is None:
            continue
        tree, text = parsed
        lines = text.splitlines()
        for node in tree.body:
            defined = _names(node)
            if defined is None:
                continue
            kind, names = defined
            decorators = getattr(node, "decorator_list", [])
            first = min([node.lineno, *(d.lineno for d in decorators)])
            code = "\n".join(lines[first - 1 : node.end_lineno]) + "\n"
            for name in names:
                found.pop(name, None)  # a later definition moves to the end
                found[name] = Definition(
                    name, kind, code, node, f"{path.resolve()} (cell {number})", text + "\n"
                )
    return found


def _defines(definitions: dict[str, Definition], kind: str | None = None) -> str:
    """What a notebook defines, for error messages: its functions and classes by name."""
    if kind is not None:
        return ", ".join(n for n, d in definitions.items() if d.kind == kind) or "none"
    named = [n for n, d in definitions.items() if d.kind != "assignment"]
    assigned = len(definitions) - len(named)
    return f"{', '.join(named) or 'no function or class'} (and {assigned} assigned names)"


def lesson_function(lesson: str, name: str, folder: str | Path | None = None) -> str:
    """The source of the function ``name`` written in a code cell of ``lesson``'s notebook.

    ``lesson`` is the number ("02") or a path to the ``.ipynb``. The notebook is looked for in
    ``folder``, else in the current folder (a lesson's own), then in the course's ``notebooks/``.
    When several cells define ``name``, the last one wins, as in a kernel run top to bottom.
    """
    path = _find_lesson(lesson, folder)
    definitions = lesson_definitions(str(path))
    found = definitions.get(name)
    if found is None or found.kind != "function":
        raise ValueError(
            f"{path.name} defines no function {name!r} in its code cells; it defines: "
            f"{_defines(definitions, 'function')}"
        )
    return found.source


def _unbound_names(definition: Definition) -> set[str]:
    """The global names ``definition`` reads (in its body, nested functions and classes too)."""
    table = symtable.symtable(definition.source, definition.filename, "exec")
    names: set[str] = set()
    stack = [table]
    while stack:
        scope = stack.pop()
        stack.extend(scope.get_children())
        for symbol in scope.get_symbols():
            if not symbol.is_referenced():
                continue
            if scope.get_type() == "module":
                if not (symbol.is_assigned() or symbol.is_imported()):
                    names.add(symbol.get_name())
            elif symbol.is_global() and not symbol.is_declared_global():
                names.add(symbol.get_name())
    return names


def load_lesson_code(
    lesson: str,
    names: Sequence[str],
    namespace: dict,
    folder: str | Path | None = None,
) -> types.SimpleNamespace:
    """Run the definitions ``names`` of ``lesson``'s code cells in ``namespace``; return them.

    ``namespace`` holds what the lesson's code uses (its imports: ``torch``, ``nn``, the package
    helpers...) and receives the definitions, which run in notebook order, so one can use
    another (``Streams`` before ``copy_streams``). Each is compiled under a file name naming the
    notebook and cell, so a traceback through it points at the lesson. Functions get the
    module name ``namespace["__name__"]`` (default: the notebook's name, which is no importable
    module, so ``launch`` sends them to the ranks by value). Tests and benchmarks run the
    lesson's own code this way: ``load_lesson_code("05", ["SplitModel", "cut"], {...})``.

    Raises ValueError naming the notebook and what it defines when a name is missing, or naming
    the global names the code reads that ``namespace`` lacks.
    """
    path = _find_lesson(lesson, folder)
    definitions = lesson_definitions(str(path))
    missing = [name for name in names if name not in definitions]
    if missing:
        raise ValueError(
            f"{path.name} defines no {', '.join(map(repr, missing))} in its code cells; it "
            f"defines: {_defines(definitions)}"
        )
    chosen = [d for name, d in definitions.items() if name in names]  # notebook order
    chosen = list({id(d.node): d for d in chosen}.values())  # x = y = 1: once
    wanted = {n for d in chosen for n in _names(d.node)[1]}
    unbound = set().union(*(_unbound_names(d) for d in chosen)) - wanted
    lacking = sorted(n for n in unbound if n not in namespace and not hasattr(builtins, n))
    if lacking:
        raise ValueError(
            f"the code of {', '.join(names)} in {path.name} uses {', '.join(lacking)}, which the "
            "namespace lacks: add them to the namespace you pass (the lesson's imports, or "
            "other names it defines)"
        )
    namespace.setdefault("__name__", path.stem)
    for definition in chosen:
        lines = definition.cell_text.splitlines(keepends=True)
        linecache.cache[definition.filename] = (
            len(definition.cell_text),
            None,
            lines,
            definition.filename,
        )  # no file to read: tracebacks take the cell's lines from here
        module = ast.Module(body=[definition.node], type_ignores=[])
        exec(compile(module, definition.filename, "exec"), namespace)  # the lesson's own code
    return types.SimpleNamespace(**{name: namespace[name] for name in names})


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
