"""Run the lessons headless (`make course`, and the notebook tests).

Each notebook runs in a real Jupyter kernel (nbclient). Quick mode reaches it through
``MGPU_QUICK``; other parameters go in a cell after the ``parameters`` cell, as papermill does.
The runner collects what lessons ``record`` and their self-check verdicts; a failing lesson
does not stop the others.
"""

from __future__ import annotations

import ast
import difflib
import keyword
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from mgpu_helpers.exercises import VERDICT_MIME
from mgpu_helpers.record import RESULT_MIME
from mgpu_helpers.tooling.hangs import hang_report, kernel_environ, tail, time_spent
from mgpu_helpers.tooling.notebooks import (
    is_self_check_cell,
    parameter_names,
    parameters_cell_index,
)
from mgpu_helpers.util import temporary_environ

__all__ = ["LessonRun", "inject_parameters", "plan_parameters", "run_course", "run_lesson"]


@dataclass
class LessonRun:
    """What happened when one lesson ran."""

    name: str
    status: str  # "passed" or "failed"
    seconds: float
    results: dict[str, object] = field(default_factory=dict)  # from record(...)
    checks: dict[str, bool] = field(default_factory=dict)  # self-check name -> passed
    error: str = ""  # the failing cell's exception, when status is "failed"
    output_path: str = ""  # the executed notebook
    params: dict[str, object] = field(default_factory=dict)  # injected after the parameters cell


def inject_parameters(nb: nbformat.NotebookNode, params: Mapping[str, object]) -> None:
    """Insert ``NAME = value`` lines after the parameters cell (papermill's convention)."""
    if not params:
        return
    for name, value in params.items():
        if not name.isidentifier() or keyword.iskeyword(name):  # `class = 1` cannot run
            raise ValueError(f"parameter name {name!r} is not a Python identifier")
        try:  # the cell must run: only values that read back as Python literals
            ok = ast.literal_eval(repr(value)) == value
        except (ValueError, SyntaxError):
            ok = False
        if not ok:
            raise ValueError(
                f"parameter {name}={value!r} is not a plain Python literal (number, string, "
                "bool, None, or a list/tuple/dict of those)"
            )
    lines = "".join(f"{k} = {v!r}\n" for k, v in params.items())
    source = "# Parameters injected by the course runner\n" + lines
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(parameters_cell_index(nb) + 1, cell)


def plan_parameters(
    notebooks: list[Path], params: Mapping[str, object]
) -> tuple[dict[str, dict[str, object]], dict[str, list[str]]]:
    """Which lessons get which of ``params``: only lessons whose parameters cell has the name.

    Returns (lesson name -> its parameters, parameter -> lessons that do not have it, so ignore
    it). A name that no lesson has (a typo such as ``EPOCH``) raises ValueError naming the
    closest valid names, before any lesson runs.
    """
    known = {}
    for path in notebooks:
        try:
            known[path.stem] = parameter_names(nbformat.read(path, as_version=4))
        except Exception:  # unreadable, or no parameters cell: its run reports why
            known[path.stem] = []
    every = sorted({name for names in known.values() for name in names})
    lines = []
    for name in (name for name in params if name not in every):
        close = difflib.get_close_matches(name.upper(), every, n=3, cutoff=0.6)
        near = f"; did you mean {' or '.join(close)}?" if close else ""
        lines.append(f"--param {name}: no lesson run here has a parameter {name}{near}")
    if lines:
        raise ValueError("\n".join(lines) + f"\nparameters of these lessons: {', '.join(every)}")
    per_lesson = {
        stem: {k: params[k] for k in params if k in names} for stem, names in known.items()
    }
    ignored = {
        name: [stem for stem, names in known.items() if name not in names] for name in params
    }
    return per_lesson, {name: stems for name, stems in ignored.items() if stems}


def _collect(nb: nbformat.NotebookNode, run: LessonRun, *, grading: bool) -> None:
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if RESULT_MIME in data:  # +json MIME types: the kernel sends them as objects
                run.results[data[RESULT_MIME]["name"]] = data[RESULT_MIME]["value"]
            if VERDICT_MIME in data:
                run.checks[data[VERDICT_MIME]["name"]] = data[VERDICT_MIME]["passed"]
            # A self-check cell may raise without stopping the run (it is tagged so); outside
            # grading it never should: an error there is a crash of the check cell itself.
            crashed = out.get("output_type") == "error" and is_self_check_cell(cell)
            if crashed and not grading and run.status == "passed":
                run.status = "failed"
                run.error = f"{out.get('ename', 'Error')}: {out.get('evalue', '')}"


POLL_SLICE = 1.0  # seconds: the longest a message that has arrived can wait unnoticed


def _in_slices(get_msg):
    """``get_msg(timeout)`` that polls the socket afresh every ``POLL_SLICE`` seconds.

    Issue 28: after a cell that opens ipywidgets comms, a reply that had already arrived
    sometimes stayed unnoticed by one long ``socket.poll`` until its timeout ran out (a slider
    cell's reply, then 120 s, or the rest of the lesson's deadline, before the next cell; the
    same as nbclient issue 312). A fresh poll sees a waiting message at once, so a missed wake-up
    costs at most one slice.
    """
    from queue import Empty

    async def sliced(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_SLICE if deadline is None else deadline - time.monotonic()
            try:
                return await get_msg(timeout=max(0.0, min(POLL_SLICE, left)))
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    return sliced


def _client(
    nb: nbformat.NotebookNode, *, timeout_for, kernel_log: Path, kernel_stacks: Path, **kwargs
):
    """nbclient's client, with a report taken when a cell times out, before the kernel stops.

    nbclient shuts the kernel down as soon as a cell times out; the report (``hangs``) must be
    taken while the kernel and its ranks still run, so it is taken in nbclient's timeout
    handler, which this overrides.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    class _Client(NotebookClient):
        hang: str = ""

        async def async_start_new_kernel_client(self):  # type: ignore[override]
            kc = await super().async_start_new_kernel_client()
            for channel in (kc.shell_channel, kc.iopub_channel):
                channel.get_msg = _in_slices(channel.get_msg)
            return kc

        async def _async_handle_timeout(self, timeout, cell=None):  # type: ignore[override]
            index = next((i for i, c in enumerate(self.nb.cells) if c is cell), None)
            pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
            self.hang = f"it ran past its time ({timeout} s)\n" + hang_report(
                pid, index, cell.source if cell is not None else "", kernel_log, kernel_stacks
            )
            self.hang += "\nwhere the lesson's time went (the longest spans):\n"
            self.hang += time_spent(self.nb.cells)
            if cell is None:  # a wait outside any cell (the kernel's first answer)
                raise CellTimeoutError(f"the kernel did not answer within {timeout} s")
            return await super()._async_handle_timeout(timeout, cell)

    # ``timeout`` bounds the waits outside cells (the kernel's first answer); nbclient's own
    # default is to wait for ever.
    return _Client(nb, timeout_func=timeout_for, timeout=60, **kwargs)


def run_lesson(
    path: str | Path,
    out_dir: str | Path,
    *,
    quick: bool,
    params: Mapping[str, object] | None = None,
    cell_timeout: int = 1800,
    deadline: float | None = None,
    grading: bool = False,
) -> LessonRun:
    """Execute one notebook in a fresh kernel and write the executed copy to ``out_dir``.

    ``params`` are injected as given (:func:`run_course` first checks their names);
    ``grading=True`` runs it as an autograder would (``MGPU_GRADING=1``: failed checks raise).
    A cell may run ``cell_timeout`` seconds, and the whole lesson ``deadline`` seconds (kernel
    start included). A cell that runs out of time fails the lesson with a report of where it
    stood (the cell, the kernel's and every live rank's stacks, the kernel log's tail), also
    written to ``<lesson>.hang.txt``.
    """
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    path = Path(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(path, as_version=4)
    inject_parameters(nb, params or {})
    run = LessonRun(name=path.stem, status="passed", seconds=0.0, params=dict(params or {}))
    start = time.perf_counter()

    def timeout_for(cell: nbformat.NotebookNode) -> int:
        if deadline is None:
            return cell_timeout
        left = deadline - (time.perf_counter() - start)
        return max(1, min(cell_timeout, math.ceil(left)))

    # What the kernel and its child processes print outside the notebook (their own warnings,
    # the tracebacks of lesson 04a's deliberate mp.spawn failure) goes to a log, not the console.
    kernel_log = out_dir / f"{path.stem}.kernel.log"
    kernel_stacks = out_dir / f"{path.stem}.kernel-stacks.txt"  # written only on a hang
    client = _client(
        nb,
        timeout_for=timeout_for,
        kernel_log=kernel_log,
        kernel_stacks=kernel_stacks,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    env = {
        "MGPU_QUICK": "1" if quick else "0",
        "MGPU_GRADING": "1" if grading else "0",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        **kernel_environ(kernel_stacks),  # its stacks on a signal: the report on a hang
    }
    try:
        with temporary_environ(env), open(kernel_log, "w") as log:
            client.execute(stdout=log, stderr=log)
    except CellExecutionError as exc:
        run.status = "failed"
        run.error = f"{exc.ename}: {exc.evalue}"
    except CellTimeoutError as exc:
        run.status = "failed"
        run.error = f"CellTimeoutError: {client.hang or str(exc).strip().splitlines()[0]}"
        if client.hang:
            (out_dir / f"{path.stem}.hang.txt").write_text(client.hang + "\n")
    except DeadKernelError as exc:
        run.status = "failed"
        first = str(exc).strip().splitlines()[0]
        run.error = (
            f"DeadKernelError: {first}\nthe kernel log's last lines ({kernel_log}):\n"
            + tail(kernel_log)
        )
    run.seconds = time.perf_counter() - start
    _collect(nb, run, grading=grading)
    out_path = out_dir / path.name
    nbformat.write(nb, out_path)
    run.output_path = str(out_path)
    return run


def run_course(
    notebooks: list[Path],
    out_dir: str | Path = "build/course",
    *,
    quick: bool,
    params: Mapping[str, object] | None = None,
    echo: bool = True,
) -> list[LessonRun]:
    """Run every lesson in order (a failure does not stop the others) and write the report.

    Each parameter goes to the lessons that have it (:func:`plan_parameters`, which raises
    ValueError for a name that none has); the others ignore it, and ``echo`` says which.
    """
    per_lesson, ignored = plan_parameters(notebooks, params or {}) if params else ({}, {})
    if echo:
        for name, stems in ignored.items():
            print(f"note: {name} is not a parameter of {', '.join(stems)}: ignored there")
    from mgpu_helpers.tooling.report import write_report  # the report reads LessonRun

    runs = []
    for path in notebooks:
        if echo:
            print(f"running {path.name} ({'quick' if quick else 'full'} mode) ...", flush=True)
        start = time.perf_counter()
        try:
            run = run_lesson(path, out_dir, quick=quick, params=per_lesson.get(path.stem))
        except Exception as exc:  # unreadable notebook, kernel that never starts, ...
            error = f"{type(exc).__name__}: {exc}"
            run = LessonRun(path.stem, "failed", time.perf_counter() - start, error=error)
        if echo:
            mark = "ok " if run.status == "passed" else "FAILED"
            print(f"  {mark} {run.seconds:6.1f} s  {run.error}", flush=True)
        runs.append(run)
    write_report(runs, out_dir, quick=quick)
    return runs
