#!/usr/bin/env python3
"""Run the lessons on a machine without Jupyter: each notebook's code cells as a script.

``scripts/gpu_check.sh`` uses it to run every lesson, in quick mode, on a GPU machine whose
Python has torch but perhaps not the Jupyter stack. From the repository root, with the package
used through ``PYTHONPATH`` (nothing installed):

    PYTHONPATH=$PWD python3 scripts/lesson_as_script.py run --out DIR [--quick | --full]
        [--timeout 90] [--total 300] [--mode auto|script|kernel] [--param NAME=VALUE ...]
        [NOTEBOOK ...]                      (default: notebooks/NN_*.ipynb, in order)
    python3 scripts/lesson_as_script.py export NOTEBOOK SCRIPT.py   (the script only)
    python3 scripts/lesson_as_script.py exec SCRIPT.py --out DIR    (one exported lesson)

``run`` first reports which of the lessons' libraries this Python lacks, then runs each lesson
in its own process, with a time limit per lesson and a cap on the total; a lesson that fails or
runs out of time is reported with the failing cell and its error, and the next one still runs.
The exit status is 0 only when every lesson ran to the end with every self-check passing.

Modes. ``kernel`` executes the notebook in a real Jupyter kernel (``mgpu_helpers.tooling.runner.
run_lesson``, as ``make course`` does); ``script`` exports the code cells to a Python file and
runs them one at a time, like a kernel, with the kernel shim in ``scripts/kernel_shim/``
standing in for IPython (``display``, ``get_ipython``, magics, ``!`` commands) and ipywidgets
(``interact`` calls its function once with the starting values); figures become PNG files.
``auto`` (the default) takes ``kernel`` when nbformat, nbclient, jupyter_client and ipykernel
all import, else ``script``. When tqdm is missing, ``scripts/kernel_shim_fallback/`` provides
a plain text bar (and the report says so).

How a script run stays true to the notebook. The cells run in a fresh ``__main__`` module
that, like a kernel's, has no file behind it: a function written in a cell is pickled by
reference to ``__main__``, which a spawned child process cannot import, so lesson 04a's naive
``mp.spawn`` fails exactly as it does in JupyterLab, and the course's ``launch`` sends such
workers by value (cloudpickle), as from a notebook. (Run as a plain ``python lesson.py``, a
script's ``__main__`` is its file, which children re-run; the runner avoids that on purpose.)
The working directory is the notebook's folder, as in a kernel; the value of a cell's last
expression is displayed; cells tagged ``raises-exception`` may fail and ``skip-execution``
cells are skipped, as nbclient does.

Results (``--out DIR``):

    DIR/summary.json          mode, quick/full, limits, environment (each module's version or
                              "missing"), and per lesson: status, seconds, error, failed cell,
                              results, self-checks
    DIR/NN_name/output.log    everything the lesson printed (stdout and stderr, interleaved, in
                              order), a "=== cell N" line before each cell, progress bars as
                              their last state, and the failing cell's traceback
    DIR/NN_name/lesson.json   this lesson's entry of summary.json, plus per-cell times
    DIR/NN_name/figures/      cellNNN-K.png: the K-th figure shown by notebook cell NNN
    DIR/NN_name/NN_name.py    the exported script (script mode)
    DIR/NN_name/displays.json every ``application/vnd.mgpu...`` item the lesson displayed
                              (recorded results, self-check verdicts), in order (script mode)
    DIR/NN_name/NN_name.ipynb the executed notebook, and NN_name.kernel.log (kernel mode)

Recorded results come from ``mgpu_helpers.record.record`` (its MIME type in displays.json);
self-check verdicts from the ``[self-check] PASS name`` lines in the output, or from a display
of an ``application/vnd.mgpu...`` type carrying a name and a verdict. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import builtins
import codecs
import importlib.util
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Cell",
    "LessonResult",
    "environment_report",
    "exec_script",
    "export",
    "main",
    "run_lessons",
    "to_python",
]

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
SHIM_DIR = SCRIPTS / "kernel_shim"
FALLBACK_DIR = SCRIPTS / "kernel_shim_fallback"
BACKEND = "module://lesson_shim_backend"
# Self-check verdicts come as a display of an application/vnd.mgpu... type with a name and a
# verdict (mgpu_helpers.exercises), or, from older versions of the package, as printed lines
# "[self-check] PASS name": both are read.
MARKER = "[self-check]"
# mgpu_helpers.record.RESULT_MIME (the tests check they agree). Not imported: importing the
# submodule mgpu_helpers.record in the lesson's process would shadow the function
# `mgpu_helpers.record` that lessons import from the package.
RESULT_MIME = "application/vnd.mgpu.result+json"
MGPU_MIME_PREFIX = "application/vnd.mgpu"
JUPYTER_STACK = ("nbformat", "nbclient", "jupyter_client", "ipykernel")
# The lessons' libraries, and what fails without each (reported before the lessons run).
LIBRARIES = {
    "torch": "every lesson",
    "numpy": "mgpu_helpers.train and the lessons that train (02-05)",
    "matplotlib": "every lesson's figures (mgpu_helpers.plots)",
    "sklearn": "the default 'digits' data set (the lessons that train)",
    "tqdm": "progress bars: the script mode falls back to a plain text bar",
    "cloudpickle": "workers written in a cell, sent to the ranks (lesson 04a imports it)",
    "torchvision": "only DATASET='cifar10' or 'fashionmnist'",
    **{name: "kernel mode (the script mode needs none of it)" for name in JUPYTER_STACK},
    "IPython": "nothing here: the script mode's kernel shim stands in for it",
    "ipywidgets": "nothing here: the script mode's kernel shim stands in for it",
}
_CELL_LINE = re.compile(r"^# %% \[(?:cell (\d+)|(injected parameters))\](?: tags: (.*))?$")


# --- export: notebook -> script --------------------------------------------------------------


@dataclass
class Cell:
    """One code cell of an exported lesson: its notebook index, tags and source."""

    index: int  # in the notebook; -1 for injected parameters
    source: str
    tags: list[str] = field(default_factory=list)
    first_line: int = 0  # where its source starts in the exported script (1-based)


def read_notebook(path: str | Path) -> dict[str, Any]:
    """A notebook as plain JSON (nbformat 4), without the nbformat package."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(nb, dict) or nb.get("nbformat") != 4 or "cells" not in nb:
        raise ValueError(f"{path} is not a version 4 Jupyter notebook")
    return nb


def _text(source: str | list[str]) -> str:
    return source if isinstance(source, str) else "".join(source)


def _line_magic(indent: str, target: str, kind: str, rest: str) -> str:
    assign = f"{target} = " if target else ""
    if kind == "!!" or (kind == "!" and target):
        return f"{indent}{assign}get_ipython().getoutput({rest!r})"
    if kind == "!":
        return f"{indent}get_ipython().system({rest!r})"
    name, _, args = rest.partition(" ")
    return f"{indent}{assign}get_ipython().run_line_magic({name!r}, {args.strip()!r})"


_MAGIC_LINE = re.compile(
    r"^(?P<indent>\s*)(?:(?P<target>[A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)\s*=\s*)?"
    r"(?P<kind>!!|!|%)(?P<rest>\S.*)$"
)


def to_python(source: str) -> str:
    """A cell's IPython syntax as plain Python: ``%magic``, ``%%magic``, ``!cmd`` become calls.

    A cell that already parses as Python is returned unchanged; otherwise every line that
    starts (after its indentation, or ``name =``) with ``%`` or ``!`` is turned into the
    ``get_ipython()`` call IPython makes of it. Such a line inside a multi-line string of a
    cell that also holds real magics would be turned too (IPython's own transformer knows
    better); the lessons have none.
    """
    lines = source.splitlines()
    if lines and lines[0].startswith("%%"):
        name, _, line = lines[0][2:].partition(" ")
        body = "\n".join(lines[1:]) + "\n"
        return f"get_ipython().run_cell_magic({name.strip()!r}, {line.strip()!r}, {body!r})\n"
    try:
        ast.parse(source)
        return source
    except SyntaxError:
        pass
    out = []
    for line in lines:
        match = _MAGIC_LINE.match(line)
        if match and not match.group("rest").startswith("="):  # not `x = !=`, `!= y`
            out.append(_line_magic(*match.group("indent", "target", "kind", "rest")))
        else:
            out.append(line)
    return "\n".join(out) + ("\n" if source.endswith("\n") else "")


def notebook_cells(nb: dict[str, Any], params: dict[str, object] | None = None) -> list[Cell]:
    """The code cells, as Python, with ``params`` as a cell after the parameters cell."""
    cells = []
    for index, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code":
            continue
        tags = list(cell.get("metadata", {}).get("tags", []))
        cells.append(Cell(index, to_python(_text(cell.get("source", ""))), tags))
        if params and "parameters" in tags:
            lines = "".join(f"{k} = {v!r}\n" for k, v in params.items())
            cells.append(Cell(-1, lines, ["injected-parameters"]))
    if params and not any(c.index == -1 for c in cells):
        raise ValueError("parameters given, but the notebook has no cell tagged 'parameters'")
    return cells


def _header(notebook: Path) -> str:
    return f"""#!/usr/bin/env python3
# {notebook.name} as a script: its code cells, in order, exported by scripts/lesson_as_script.py
# (do not edit; export again). Each cell starts with a "# %% [cell N]" line (N: its index in the
# notebook); IPython syntax (%magics, !commands) became get_ipython() calls, which the kernel
# shim in scripts/kernel_shim/ runs. Run this file (from the notebook's folder, as a kernel
# would; MGPU_QUICK=1 for quick mode), or `lesson_as_script.py exec` on it: either way the
# cells run one at a time, like a kernel runs them, in a __main__ without a file.
if __name__ == "__main__":
    import sys

    sys.path.insert(0, {str(SCRIPTS)!r})
    from lesson_as_script import main

    raise SystemExit(main(["exec", __file__]))
raise ImportError("run this file rather than import it (see its first lines)")
"""


def export(
    notebook: str | Path, script: str | Path, params: dict[str, object] | None = None
) -> list[Cell]:
    """Write ``notebook``'s code cells to ``script`` (standard library only); returns them."""
    notebook, script = Path(notebook), Path(script)
    cells = notebook_cells(read_notebook(notebook), params)
    parts = [_header(notebook)]
    for cell in cells:
        if any(_CELL_LINE.match(line) for line in cell.source.splitlines()):
            raise ValueError(f"cell {cell.index} of {notebook} contains a '# %% [cell N]' line")
        label = f"cell {cell.index}" if cell.index >= 0 else "injected parameters"
        tags = f" tags: {', '.join(cell.tags)}" if cell.tags else ""
        body = cell.source if cell.source.endswith("\n") or not cell.source else cell.source + "\n"
        parts.append(f"\n# %% [{label}]{tags}\n{body}")
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("".join(parts), encoding="utf-8")
    return parse_script(script)


def parse_script(script: str | Path) -> list[Cell]:
    """The cells of an exported script, with the line where each one's source starts."""
    cells: list[Cell] = []
    lines = Path(script).read_text(encoding="utf-8").splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        match = _CELL_LINE.match(line.rstrip("\n"))
        if match:
            index = int(match.group(1)) if match.group(1) else -1
            tags = [t.strip() for t in (match.group(3) or "").split(",") if t.strip()]
            cells.append(Cell(index, "", tags, number + 1))
        elif cells:
            cells[-1].source += line
    if not cells:
        raise ValueError(f"{script} has no '# %% [cell N]' lines: export the notebook again")
    return cells


# --- exec: run an exported script, one cell at a time ---------------------------------------


class LessonTimeout(BaseException):
    """The runner stopped the lesson: it ran past its time limit (a BaseException, like
    KeyboardInterrupt, so that a cell's ``except Exception`` does not swallow it)."""


_STOPPED: list[bool] = []  # set once the runner's SIGTERM arrived


def _on_sigterm(signum: int, frame: object) -> None:
    _STOPPED.append(True)
    raise LessonTimeout("stopped by the runner: the lesson ran past its time limit")


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=repr) + "\n")
    os.replace(tmp, path)


def _with_path(value: str | None, *first: Path) -> str:
    parts = [str(p) for p in first] + ([value] if value else [])
    seen: list[str] = []
    for part in os.pathsep.join(parts).split(os.pathsep):
        if part and part not in seen:
            seen.append(part)
    return os.pathsep.join(seen)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def lesson_environ(
    base: dict[str, str], *, quick: bool | None, shim: bool = True
) -> dict[str, str]:
    """The environment of a lesson's process: the package (and the shim) first on the path.

    ``shim=False`` for kernel mode: a real kernel needs the real IPython.
    """
    env = dict(base)
    first = [SHIM_DIR] if shim else []
    if shim and not _importable("tqdm"):
        first.append(FALLBACK_DIR)
    env["PYTHONPATH"] = _with_path(env.get("PYTHONPATH"), *first, ROOT)
    if shim:
        env["MPLBACKEND"] = BACKEND
        # tqdm (4.66+) reads defaults from TQDM_* variables: every bar on one line (no cursor
        # moves for nested bars), redrawn at most once a second; the log keeps each bar's last
        # state (see _copy_output).
        env.setdefault("TQDM_POSITION", "0")
        env.setdefault("TQDM_MININTERVAL", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if quick is not None:
        env["MGPU_QUICK"] = "1" if quick else "0"
    return env


def _install_paths() -> None:
    """Make this process see what the runner would have given it (for a direct run)."""
    env = lesson_environ(dict(os.environ), quick=None)
    os.environ.update({k: env[k] for k in ("PYTHONPATH", "MPLBACKEND", "PYTHONUNBUFFERED")})
    for entry in reversed(env["PYTHONPATH"].split(os.pathsep)):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if str(SHIM_DIR) in sys.path:  # the shim must win over a real IPython
        sys.path.remove(str(SHIM_DIR))
    sys.path.insert(0, str(SHIM_DIR))


def _script_traceback(exc: BaseException, script: str) -> tuple[str, int]:
    """The traceback from the lesson's own code on, and the script line it left the cell at."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    line = tb.tb_lineno if tb is not None else 0
    text = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
    return text, line


def _run_cell(cell: Cell, script: str, ns: dict[str, Any]) -> None:
    """Run one cell as IPython does: statements, then the last expression's value displayed."""
    padded = "\n" * (cell.first_line - 1) + cell.source
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    tree = compile(padded, script, "exec", flags | ast.PyCF_ONLY_AST)
    last = None
    quiet = cell.source.rstrip().endswith(";")
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not quiet:
        last = ast.Expression(tree.body.pop().value)
    for code, mode in ((tree, "exec"), (last, "eval")):
        if code is None:
            continue
        compiled = compile(code, script, mode, flags)
        value = eval(compiled, ns)
        if compiled.co_flags & inspect.CO_COROUTINE:  # a cell with a top-level await
            value = asyncio.run(value)
        if mode == "eval" and value is not None:
            ns["_"] = value
            ns["display"](value)


def exec_script(script: str | Path, out_dir: str | Path | None = None) -> int:
    """Run an exported lesson cell by cell, like a kernel; 0 when every cell ran.

    Writes ``exec.json`` (status, per-cell seconds, the failed cell, its error and traceback),
    ``displays.json`` and ``figures/`` to ``out_dir`` (default: the script's folder).
    """
    script = str(Path(script).resolve())
    out = Path(out_dir) if out_dir is not None else Path(script).parent
    out.mkdir(parents=True, exist_ok=True)
    cells = parse_script(script)
    _install_paths()
    import lesson_kernel  # from the shim folder, now first on sys.path

    # A __main__ with no file behind it, as in a kernel (see the module's docstring).
    main_module = types.ModuleType("__main__", "the lesson's namespace (like a kernel's)")
    sys.modules["__lesson_runner__"] = sys.modules["__main__"]
    sys.modules["__main__"] = main_module
    ns = main_module.__dict__
    ns["__builtins__"] = builtins
    shell = lesson_kernel.configure(out, ns)
    ns.update(display=lesson_kernel.display, get_ipython=lesson_kernel.get_ipython)
    builtins.get_ipython = lesson_kernel.get_ipython  # type: ignore[attr-defined]
    if "" not in sys.path:
        sys.path.insert(1, "")  # a kernel imports modules from its working directory
    sys.argv = [script]
    signal.signal(signal.SIGTERM, _on_sigterm)
    report: dict[str, Any] = {
        "script": script,
        "main_module": "a module without a file, as in a Jupyter kernel",
        "status": "running",
        "cells": [],
        "failed_cell": None,
        "error": "",
        "traceback": "",
    }
    for cell in cells:
        if "skip-execution" in cell.tags:
            continue
        label = f"cell {cell.index}" if cell.index >= 0 else "injected parameters"
        print(f"\n=== {label} (script line {cell.first_line})", flush=True)
        report["current_cell"] = cell.index
        _write_json(out / "exec.json", report)
        lesson_kernel.set_cell(cell.index)
        start = time.perf_counter()
        try:
            _run_cell(cell, script, ns)
            lesson_kernel.flush_figures()
            shell.events.trigger("post_execute")
        except BaseException as exc:  # noqa: B036 (a cell's SystemExit or timeout is its failure)
            text, line = _script_traceback(exc, script)
            sys.stdout.flush()
            sys.stderr.write(text)
            sys.stderr.flush()
            seconds = time.perf_counter() - start
            report["cells"].append({"cell": cell.index, "seconds": round(seconds, 3)})
            if "raises-exception" in cell.tags and not isinstance(exc, LessonTimeout):
                continue
            status = "timeout" if isinstance(exc, LessonTimeout) else "failed"
            error = f"{type(exc).__name__}: {exc}".strip()
            report.update(status=status, failed_cell=cell.index, failed_line=line, error=error)
            report["traceback"] = text
            report["figures"] = lesson_kernel._STATE.figures
            _write_json(out / "exec.json", report)
            return 1
        report["cells"].append(
            {"cell": cell.index, "seconds": round(time.perf_counter() - start, 3)}
        )
    report["status"] = "passed"
    report["figures"] = lesson_kernel._STATE.figures
    report.pop("current_cell", None)
    _write_json(out / "exec.json", report)
    return 0


# --- kernel mode: a real Jupyter kernel, when the stack is installed ------------------------


def run_in_kernel(
    notebook: Path, out: Path, *, quick: bool, timeout: float, params: dict[str, object]
) -> int:
    """Execute the notebook with ``tooling.runner.run_lesson``; writes ``exec.json``."""
    sys.path.insert(0, str(ROOT))
    from mgpu_helpers.tooling.runner import run_lesson

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        run = run_lesson(notebook, out, quick=quick, params=params, cell_timeout=int(timeout))
        report: dict[str, Any] = {
            "status": run.status,
            "error": run.error,
            "results": run.results,
            "checks": run.checks,
        }
    except BaseException as exc:  # noqa: B036 (nbclient's clean-up may raise something else)
        status = "timeout" if _STOPPED else "failed"
        report = {"status": status, "error": f"{type(exc).__name__}: {exc}"}
    executed = out / notebook.name
    if executed.exists():
        report.update(_read_executed(executed, out))
    _write_json(out / "exec.json", report)
    return 0 if report["status"] == "passed" else 1


def _read_executed(path: Path, out: Path) -> dict[str, Any]:
    """The failed cell (its index in the lesson) and the figures, from an executed notebook."""
    import base64

    found: dict[str, Any] = {"figures": [], "failed_cell": None}
    (out / "figures").mkdir(exist_ok=True)
    shift = 0
    for index, cell in enumerate(read_notebook(path)["cells"]):
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            shift = 1  # the runner's injected cell: indices after it are one too high
            continue
        counter = 0
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                counter += 1
                name = f"figures/cell{index - shift:03d}-{counter}.png"
                (out / name).write_bytes(base64.b64decode(_text(png)))
                found["figures"].append(name)
            if output.get("output_type") == "error" and found["failed_cell"] is None:
                found["failed_cell"] = index - shift
                tb = "\n".join(output.get("traceback", []))
                found["traceback"] = re.sub(r"\x1b\[[0-9;]*m", "", tb)
    return found


# --- run: every lesson, each in its own process ---------------------------------------------


@dataclass
class LessonResult:
    """What one lesson did, as summary.json and the lesson's lesson.json hold it."""

    name: str
    mode: str
    status: str  # "passed", "failed", "timeout" or "skipped"
    seconds: float = 0.0
    limit_s: float = 0.0
    error: str = ""
    failed_cell: int | None = None  # the failing cell's index in the notebook
    failed_line: int | None = None  # and the line in the exported script (script mode)
    results: dict[str, object] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    folder: str = ""


def _copy_output(stream: Any, log: Any) -> None:
    """Copy a child's output to its log as plain lines.

    A line redrawn after a carriage return (a progress bar) keeps only its last state, and
    terminal control sequences (colours, cursor moves) are dropped.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    line, carriage, escape = "", False, ""
    fd = stream.fileno()
    while True:
        chunk = os.read(fd, 65536)
        text = decoder.decode(chunk, final=not chunk)
        for char in text:
            if escape:  # inside ESC [ ... final-byte
                escape += char
                csi = escape.startswith("\x1b[")
                if (csi and len(escape) > 2 and "@" <= char <= "~") or (
                    not csi and len(escape) == 2
                ):
                    escape = ""
                continue
            if char == "\x1b":
                escape = char
            elif char == "\n":
                log.write(line + "\n")
                line, carriage = "", False
            elif char == "\r":
                carriage = True
            else:
                if carriage:  # a redraw (progress bar): the line starts over
                    line, carriage = "", False
                line += char
        log.flush()
        if not chunk:
            break
    if line:
        log.write(line + "\n")
    log.flush()


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _run_child(
    cmd: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, limit: float
) -> tuple[int, float, bool]:
    """Run ``cmd`` in its own process group, output to ``log_path``; (rc, seconds, timed out).

    Past ``limit`` seconds the lesson process gets SIGTERM (it reports where it was, and stops
    its ranks), then the whole group SIGKILL 15 s later.
    """
    start = time.perf_counter()
    timed_out = False
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,  # input() fails at once instead of waiting forever
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        copier = threading.Thread(target=_copy_output, args=(proc.stdout, log), daemon=True)
        copier.start()
        try:
            proc.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait()
        finally:  # also when the runner itself is stopped: no lesson outlives it
            _kill_group(proc.pid, signal.SIGKILL)  # ranks or helpers the lesson left behind
        copier.join(timeout=10)
    return proc.returncode, time.perf_counter() - start, timed_out


def _checks_from(log_text: str, displays: list[dict[str, Any]]) -> tuple[dict, dict]:
    """Recorded results and self-check verdicts, from the output and the displays."""
    results: dict[str, object] = {}
    checks: dict[str, bool] = {}
    for line in log_text.splitlines():
        if line.startswith(MARKER):
            verdict, _, name = line[len(MARKER) :].strip().partition(" ")
            checks[name] = verdict == "PASS"
    for item in displays:
        data = item.get("data")
        if not isinstance(data, dict):
            continue
        name = data.get("name", data.get("check"))
        if not isinstance(name, str):
            continue
        if item.get("mime") == RESULT_MIME or ("value" in data and "passed" not in data):
            results[name] = data.get("value")
            continue
        passed = data.get("passed", data.get("ok"))
        verdict = data.get("verdict", data.get("status"))
        if isinstance(passed, bool):
            checks[name] = passed
        elif isinstance(verdict, str):
            checks[name] = verdict.strip().upper() in ("PASS", "PASSED", "OK")
    return results, checks


def _load_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def run_one(
    notebook: Path,
    out_root: Path,
    *,
    mode: str,
    quick: bool,
    limit: float,
    params: dict[str, object],
) -> LessonResult:
    """Run one lesson in a fresh process and read back what it did."""
    name = notebook.stem
    out = out_root / name
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("exec.json", "displays.json", "lesson.json"):
        (out / stale).unlink(missing_ok=True)
    result = LessonResult(name, mode, "failed", limit_s=round(limit, 1), folder=str(out))
    env = lesson_environ(dict(os.environ), quick=quick, shim=mode == "script")
    this = str(Path(__file__).resolve())
    if mode == "script":
        script = out / f"{name}.py"
        try:
            export(notebook, script, params)
        except (OSError, ValueError) as exc:
            result.error = f"export failed: {type(exc).__name__}: {exc}"
            return result
        cmd = [sys.executable, this, "exec", str(script), "--out", str(out)]
    else:
        cmd = [sys.executable, this, "kernel", str(notebook.resolve()), "--out", str(out)]
        cmd += ["--timeout", str(limit), "--quick" if quick else "--full"]
        cmd += [f"--param={k}={v!r}" for k, v in params.items()]
    log = out / "output.log"
    rc, seconds, timed_out = _run_child(
        cmd, cwd=notebook.resolve().parent, env=env, log_path=log, limit=limit
    )
    result.seconds = round(seconds, 1)
    report = _load_json(out / "exec.json", {})
    if mode == "kernel" and report.get("traceback"):  # the log ends with it, in both modes
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"\n=== the failing cell {report.get('failed_cell')}:\n{report['traceback']}\n")
    displays = _load_json(out / "displays.json", [])
    results, checks = _checks_from(log.read_text(errors="replace"), displays)
    result.results = {**report.get("results", {}), **results}
    result.checks = {**report.get("checks", {}), **checks}
    result.figures = report.get("figures", [])
    result.failed_cell = report.get("failed_cell", report.get("current_cell"))
    result.failed_line = report.get("failed_line")
    result.error = report.get("error", "")
    if timed_out:
        result.status = "timeout"
        where = f" in cell {result.failed_cell}" if result.failed_cell is not None else ""
        result.error = f"ran past its limit of {limit:.0f} s{where}"
    elif rc == 0 and report.get("status") == "passed":
        result.status = "passed"
    elif not report:
        result.error = f"the lesson process exited with code {rc} before reporting"
    failed_checks = [k for k, ok in result.checks.items() if not ok]
    if failed_checks and result.status == "passed":
        result.status = "failed"
        result.error = f"self-check(s) failed: {', '.join(failed_checks)}"
    if not result.checks and result.status == "passed":
        result.warnings.append("no self-check verdict found in the output or the displays")
    entry = asdict(result)
    entry["cells"] = report.get("cells", [])
    entry["traceback"] = report.get("traceback", "")
    _write_json(out / "lesson.json", entry)
    return result


_DISTRIBUTIONS = {"sklearn": "scikit-learn", "IPython": "ipython"}


def environment_report() -> dict[str, dict[str, Any]]:
    """Which of the lessons' libraries this Python has, and their versions.

    Found on the path and in the installed metadata, without importing them (importing torch,
    scikit-learn and torchvision takes seconds); a library that is installed but broken shows
    up as the failing lesson's ImportError.
    """
    import importlib.metadata

    found: dict[str, dict[str, Any]] = {}
    for name in LIBRARIES:
        if not _importable(name):
            found[name] = {"ok": False, "error": "not installed"}
            continue
        try:
            version = importlib.metadata.version(_DISTRIBUTIONS.get(name, name))
        except importlib.metadata.PackageNotFoundError:
            version = "(version unknown)"
        found[name] = {"ok": True, "version": version}
    return found


def _print_environment(found: dict[str, dict[str, Any]]) -> None:
    print(f"Python {sys.version.split()[0]} ({sys.executable})")
    for name, why in LIBRARIES.items():
        info = found.get(name, {})
        if info.get("ok"):
            print(f"  {name:<15} {info.get('version')}")
        else:
            print(f"  {name:<15} MISSING ({info.get('error', '?')}); needed for: {why}")


def _parse_params(items: list[str]) -> dict[str, object]:
    params: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--param {item!r}: write NAME=VALUE")
        try:
            params[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            params[name] = text  # a bare word is a string, as `mgpu course --param` reads it
    return params


def run_lessons(
    notebooks: list[Path],
    out_root: Path,
    *,
    mode: str = "auto",
    quick: bool = True,
    timeout: float = 90.0,
    total: float = 300.0,
    params: dict[str, object] | None = None,
) -> list[LessonResult]:
    """Run every lesson in order (a failure does not stop the next) and write summary.json."""
    out_root.mkdir(parents=True, exist_ok=True)
    found = environment_report()
    _print_environment(found)
    have_jupyter = all(found.get(n, {}).get("ok") for n in JUPYTER_STACK)
    if mode == "auto":
        mode = "kernel" if have_jupyter else "script"
        why = "the Jupyter stack imports" if have_jupyter else "the Jupyter stack is missing"
        print(f"mode: {mode} ({why})")
    elif mode == "kernel" and not have_jupyter:
        raise RuntimeError(
            "--mode kernel needs nbformat, nbclient, jupyter_client and ipykernel;"
            " install them or use --mode script"
        )
    if not found.get("tqdm", {}).get("ok") and mode == "script":
        print(
            "note: tqdm is missing; the lessons get the plain text bar of "
            "scripts/kernel_shim_fallback/"
        )
    print(
        f"{len(notebooks)} lesson(s), {'quick' if quick else 'full'} mode, at most "
        f"{timeout:.0f} s each and {total:.0f} s in all; results in {out_root}",
        flush=True,
    )
    results: list[LessonResult] = []
    summary: dict[str, Any] = {"passed": 0}
    start = time.perf_counter()
    for number, notebook in enumerate(notebooks, start=1):
        left = total - (time.perf_counter() - start)
        if left < 5:
            result = LessonResult(
                notebook.stem,
                mode,
                "skipped",
                error=f"not run: the total cap of {total:.0f} s was spent",
            )
        else:
            print(f"[{number}/{len(notebooks)}] {notebook.stem} ...", flush=True)
            result = run_one(
                notebook,
                out_root,
                mode=mode,
                quick=quick,
                limit=min(timeout, left),
                params=params or {},
            )
        _print_result(result)
        results.append(result)
        summary = {  # written after every lesson: a runner stopped midway leaves what it did
            "mode": mode,
            "quick": quick,
            "timeout_per_lesson_s": timeout,
            "total_cap_s": total,
            "python": sys.version.split()[0],
            "environment": found,
            "passed": sum(r.status == "passed" for r in results),
            "lessons": [asdict(r) for r in results],
        }
        _write_json(out_root / "summary.json", summary)
    print(
        f"lessons: {summary['passed']} of {len(results)} passed ({mode} mode); "
        f"summary in {out_root / 'summary.json'}",
        flush=True,
    )
    return results


def _print_result(r: LessonResult) -> None:
    passed = sum(r.checks.values())
    what = (
        f"{len(r.results)} results, {passed}/{len(r.checks)} self-checks, {len(r.figures)} figures"
    )
    print(f"  {r.status.upper():<8} {r.seconds:6.1f} s  {what}", flush=True)
    for warning in r.warnings:
        print(f"  warning: {warning}")
    if r.status == "passed":
        return
    where = ""
    if r.failed_cell is not None:
        where = (
            f"cell {r.failed_cell}"
            + (f" (script line {r.failed_line})" if r.failed_line else "")
            + ": "
        )
    print(f"  {where}{r.error}")
    if r.folder:
        tail = _tail(Path(r.folder) / "output.log")
        print(
            "  last lines of output.log:\n"
            + "".join(f"    | {line}" for line in tail.splitlines(keepends=True))
        )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through _run_child, which stops the lesson


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run the lessons, each in its own process")
    p_run.add_argument("notebooks", nargs="*", type=Path)
    p_run.add_argument("--out", type=Path, required=True)
    p_run.add_argument("--mode", choices=("auto", "script", "kernel"), default="auto")
    p_run.add_argument("--quick", dest="quick", action="store_true", default=True)
    p_run.add_argument("--full", dest="quick", action="store_false")
    p_run.add_argument("--timeout", type=float, default=90.0, help="seconds per lesson")
    p_run.add_argument("--total", type=float, default=300.0, help="seconds for all lessons")
    p_run.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    p_export = sub.add_parser("export", help="write a notebook's code cells as a script")
    p_export.add_argument("notebook", type=Path)
    p_export.add_argument("script", type=Path)
    p_export.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    p_exec = sub.add_parser("exec", help="run an exported script cell by cell")
    p_exec.add_argument("script", type=Path)
    p_exec.add_argument("--out", type=Path)
    p_kernel = sub.add_parser("kernel", help="run one notebook in a Jupyter kernel")
    p_kernel.add_argument("notebook", type=Path)
    p_kernel.add_argument("--out", type=Path, required=True)
    p_kernel.add_argument("--timeout", type=float, default=90.0)
    p_kernel.add_argument("--quick", dest="quick", action="store_true", default=True)
    p_kernel.add_argument("--full", dest="quick", action="store_false")
    p_kernel.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    if args.command == "export":
        cells = export(args.notebook, args.script, _parse_params(args.param))
        print(f"wrote {args.script}: {len(cells)} code cells")
        return 0
    if args.command == "exec":
        return exec_script(args.script, args.out)
    if args.command == "kernel":
        return run_in_kernel(
            args.notebook,
            args.out,
            quick=args.quick,
            timeout=args.timeout,
            params=_parse_params(args.param),
        )
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    notebooks = args.notebooks or sorted(  # NN_name, or NNa_name for a lesson in parts
        p
        for p in (ROOT / "notebooks").glob("[0-9][0-9]*.ipynb")
        if re.match(r"\d\d[a-z]?_", p.name)
    )
    if not notebooks:
        raise SystemExit(f"no lesson notebooks (NN_name.ipynb) in {ROOT / 'notebooks'}")
    results = run_lessons(
        notebooks,
        args.out,
        mode=args.mode,
        quick=args.quick,
        timeout=args.timeout,
        total=args.total,
        params=_parse_params(args.param),
    )
    return 0 if all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    # Imported by name, so that what it defines belongs to the module `lesson_as_script` (which
    # the lesson's child processes can import) rather than to this run's __main__.
    sys.path.insert(0, str(SCRIPTS))
    from lesson_as_script import main as _main

    raise SystemExit(_main())
