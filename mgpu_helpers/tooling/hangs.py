"""Where a lesson run stood when it ran out of time: the report of `make course` and the tests.

A kernel that never answers shows nothing from the outside: pytest's own timeout sees only its
process waiting on the kernel's channels. So the runner prepares every kernel to print its
stacks on a signal, and when a cell runs past its time it takes this report before the kernel is
shut down: the cell that was running, the kernel's Python stacks, the stacks of every launched
rank still alive (the launcher registers the same signal in each rank, whose stderr is its log)
and the tail of the kernel's log.

Only processes that catch the signal are sent it (Linux tells, in ``/proc/PID/status``), so no
process is ever killed by a signal it does not expect. Without ``/proc`` only the kernel is sent
it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "time_spent",
    "STACK_SIGNAL",
    "catches",
    "descendants",
    "dump_stacks",
    "hang_report",
    "kernel_environ",
    "tail",
]

# SIGUSR1: unused by Python, IPython, Jupyter and torch; faulthandler prints on it.
STACK_SIGNAL = signal.SIGUSR1
_STARTUP = Path(__file__).with_name("kernel_startup.py")
_LOG_LINES = 30  # lines of the kernel log in a report


def kernel_environ(stacks: Path) -> dict[str, str]:
    """Variables for a kernel that writes all its threads' stacks to ``stacks`` on the signal.

    IPython runs the file ``PYTHONSTARTUP`` names when the kernel starts; plain scripts and the
    processes the kernel starts ignore it (Python reads it only in an interactive session). A
    file of its own, since the kernel's stderr may be a pipe into the notebook (ipykernel
    captures it outside pytest).
    """
    return {"PYTHONSTARTUP": str(_STARTUP), "MGPU_KERNEL_STACKS": str(stacks)}


def catches(pid: int, signum: int = STACK_SIGNAL) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (False where Linux cannot tell)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, and theirs, oldest generation first (Linux only)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:  # the field after the command's closing parenthesis: state, then the parent's pid
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, level = [], [pid]
    while level:
        level = sorted(child for parent in level for child in children.get(parent, []))
        found += level
    return found


def _stderr_file(pid: int) -> Path | None:
    """The regular file a process's stderr writes to, if it is one."""
    try:
        path = Path(os.readlink(f"/proc/{pid}/fd/2"))
    except OSError:
        return None
    return path if path.is_file() else None


@dataclass
class Dump:
    """What one process printed on the signal: its stacks, and where its stderr goes."""

    pid: int
    command: str
    stderr: Path | None
    stacks: str


def _command(pid: int) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(w.decode(errors="replace") for w in words if w)
    return text if len(text) <= 90 else text[:87] + "..."


def dump_stacks(
    pids: Sequence[int], *, files: Mapping[int, Path] | None = None, settle: float = 2.0
) -> list[Dump]:
    """Send the signal to each of ``pids`` that catches it; what each wrote to its stderr file.

    ``files``: where a process writes its stacks instead of its stderr (the kernel's file).
    Waits until the files stop growing (at most ``settle`` seconds). Processes sharing one
    file (a rank and its DataLoader workers) share one dump.
    """
    targets = [pid for pid in pids if catches(pid)]
    files = {pid: (files or {}).get(pid) or _stderr_file(pid) for pid in targets}
    sizes = {path: path.stat().st_size for path in files.values() if path is not None}
    for pid in targets:
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            pass
    deadline, last = time.monotonic() + settle, None
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = {path: path.stat().st_size for path in sizes}
        if now == last and any(now[p] > sizes[p] for p in sizes):
            break
        last = now
    dumps, seen = [], set()
    for pid in targets:
        path = files[pid]
        if path is None:
            text = "(its stderr is not a file: the stacks went there)"
        elif path in seen:
            continue
        else:
            seen.add(path)
            with open(path, "rb") as f:
                f.seek(sizes[path])
                text = f.read().decode(errors="replace")
        dumps.append(Dump(pid, _command(pid), path, text.strip()))
    return dumps


def tail(path: Path, lines: int = _LOG_LINES) -> str:
    """The last ``lines`` lines of a text file ("" if it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-lines:])
    except OSError:
        return ""


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines()) or f"{prefix}(nothing)"


def hang_report(
    kernel_pid: int | None,
    cell_index: int | None,
    cell_source: str,
    kernel_log: Path,
    kernel_stacks: Path,
) -> str:
    """The report on a kernel that ran out of time, taken while it and its ranks still run.

    ``cell_index``: the running cell's position in the notebook (0-based, as nbformat counts);
    ``kernel_stacks``: the file :func:`kernel_environ` told the kernel to write its stacks to.
    """
    where = "a cell" if cell_index is None else f"cell {cell_index}"
    source = cell_source.strip().splitlines()
    shown = source[:12] + ([f"... ({len(source) - 12} more lines)"] if len(source) > 12 else [])
    parts = [f"{where} was running:", _indent("\n".join(shown), "    | ")]
    log_tail = tail(kernel_log)  # before the kernel's own stacks are appended to its log
    if kernel_pid is None:
        parts.append("the kernel's process is unknown: no stacks")
    else:
        others = descendants(kernel_pid) if Path("/proc").is_dir() else []
        dumps = dump_stacks([kernel_pid, *others], files={kernel_pid: kernel_stacks})
        kernel = [d.stacks for d in dumps if d.pid == kernel_pid]
        ranks = [d for d in dumps if d.pid != kernel_pid]
        parts += [
            "the kernel's Python stacks (faulthandler):",
            _indent(kernel[0] if kernel else "(the kernel has no stack dump handler)"),
        ]
        if ranks:
            folders = sorted({str(d.stderr.parent) for d in ranks if d.stderr is not None})
            parts.append(
                f"{len(ranks)} launched process(es) still alive; their logs are in "
                + (", ".join(folders) or "(unknown)")
            )
            for dump in ranks:
                log = dump.stderr.name if dump.stderr is not None else "no log file"
                parts += [f"  pid {dump.pid} ({log}):", _indent(dump.stacks)]
        else:
            parts.append("no launched process (rank) was alive")
    parts += [f"the kernel log's last lines ({kernel_log}):", _indent(log_tail)]
    return "\n".join(parts)


def time_spent(cells: Sequence[Mapping], top: int = 3) -> str:
    """Where a lesson's time went, from nbclient's timing metadata (issue 28).

    A cell that runs out of time may only have got what earlier cells left of the lesson's
    deadline, so the report lists the longest cells and the longest pauses *between* cells
    (from one cell's reply to the next cell's start: time the kernel or the client spent
    elsewhere), each with the cell's index.
    """
    from datetime import datetime

    spans: list[tuple[float, str]] = []
    last_end: tuple[int, datetime] | None = None
    for i, cell in enumerate(cells):
        timing = cell.get("metadata", {}).get("execution", {})
        started, ended = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if not started:
            continue
        start = datetime.fromisoformat(started.replace("Z", "+00:00"))
        if last_end is not None:
            gap = (start - last_end[1]).total_seconds()
            spans.append(
                (gap, f"{gap:.1f} s between cell {last_end[0]}'s reply and cell {i}'s start")
            )
        if ended:
            end = datetime.fromisoformat(ended.replace("Z", "+00:00"))
            spans.append(
                (
                    (end - start).total_seconds(),
                    f"{(end - start).total_seconds():.1f} s in cell {i}",
                )
            )
            last_end = (i, end)
    if not spans:
        return "    no cell had finished: no timings"
    longest = sorted(spans, key=lambda span: span[0], reverse=True)[:top]
    return _indent("\n".join(text for _, text in longest))
