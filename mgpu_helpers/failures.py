"""The harness around lesson 10's live failures: reports cut to a few lines, and stack dumps read.

Lessons 10b and 10c produce each failure for real, in real processes. What only *shows* a
failure lives here, so that each entry's cells hold the mistake and its fix: a launcher's report
in a few lines (:func:`report`), the lines of a long text that matter (:func:`key_lines`), the
exception an attempt raised (:func:`caught`) and its first lines (:func:`show`), ``mp.spawn``'s
two steps with the children's stderr kept (:func:`start_like_mp_spawn`), and the line each rank
was executing when ``faulthandler`` dumped its stack (:func:`where_ranks_waited`).
"""

from __future__ import annotations

import linecache
import multiprocessing
import os
import re
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher (and torch) only for the type: this module imports light
    from .launch import WorkerError

__all__ = [
    "caught",
    "first_failure",
    "key_lines",
    "report",
    "show",
    "start_like_mp_spawn",
    "tidy",
    "where_ranks_waited",
]

_SOURCE_PLACE = re.compile(r"\[/[^\]]*\] ?")  # C++ source locations: [/path/pair.cc:561]
_ENFORCE_PATH = re.compile(r"(\[enforce fail at )/[^\]]*/")  # gloo's [enforce fail at /path/x.cc:1]
_EMOJI = re.compile("[\U0001f000-\U0001faff\u2600-\u27bf\ufe0f]")  # gloo decorates some lines
_LOG_POINTERS = ("; its log", "; see its log", " Its log: ")


def tidy(line: str, width: int = 98) -> str:
    """One report line without C++ source places, emoji or log paths, cut to ``width`` (10b)."""
    line = _ENFORCE_PATH.sub(r"\1", line.strip())
    line = _EMOJI.sub("", _SOURCE_PLACE.sub("", line))
    for pointer in _LOG_POINTERS:
        line = line.split(pointer)[0]
    line = line.rstrip()
    return line if len(line) <= width else line[: width - 3] + "..."


def key_lines(text: str, *fragments: str, limit: int = 6) -> list[str]:
    """The first ``limit`` lines of ``text`` that hold one of ``fragments``, tidied (10b)."""
    return [tidy(line) for line in text.splitlines() if any(f in line for f in fragments)][:limit]


def report(exc: WorkerError) -> list[str]:
    """The launcher's report in a few lines: who failed first and how, the others, the error (10b).

    The summary's first line, each other rank's line, then the last line of the first failing
    rank's traceback, wrapped to fit a notebook's output.
    """
    text = str(exc)
    summary = text[: len(text) - len(exc.details)].splitlines()
    notes = [tidy(line) for line in summary[1:] if line.startswith("  rank")]
    last = [line for line in exc.details.strip().splitlines() if line.strip()][-1:]
    error = []
    if last:
        error = textwrap.wrap("its error: " + tidy(last[0], 280), 98, subsequent_indent="  ")[:3]
    head = textwrap.wrap(tidy(summary[0], 190), 98, subsequent_indent="  ")[:2] if summary else []
    return [*head, *notes, *error]


def first_failure(exc: WorkerError, width: int = 92) -> str:
    """Who failed first and how, then its error's last line, whole, wrapped to ``width`` (10b).

    What an exercise's check shows when a rank failed: nothing of the summary's first line or of
    the error is cut off, and the rank is named once.
    """
    text = str(exc)
    summary = text[: len(text) - len(exc.details)].splitlines()
    last = [line for line in exc.details.strip().splitlines() if line.strip()][-1:]
    parts = [tidy(summary[0], 10_000)] if summary else [f"rank {exc.rank} failed"]
    parts += ["its error: " + tidy(line, 10_000) for line in last]
    return "\n".join(textwrap.fill(part, width, subsequent_indent="  ") for part in parts)


def caught(attempt: Callable[[], object]) -> tuple[str, str] | None:
    """Run ``attempt``: its exception's type name and message, or None if it raised none (10c)."""
    try:
        attempt()
    except Exception as exc:  # each demonstration expects one particular error
        return type(exc).__name__, str(exc)
    return None


def show(label: str, error: tuple[str, str] | None, lines: int = 2) -> None:
    """Print ``label``, the error's type and the first ``lines`` lines of its message (10c).

    Each line is wrapped at 96 characters, at most three pieces of it, so a message fits the page.
    """
    if error is None:
        print(f"{label}: no error")
        return
    kind, message = error
    print(f"{label}: {kind}")
    for line in message.strip().splitlines()[:lines]:
        pieces = textwrap.wrap(line.strip(), 96) or [""]
        for piece in pieces[:3]:
            print("   ", piece)
        if len(pieces) > 3:
            print("    ...")


def start_like_mp_spawn(
    fn: Callable[[int, int], object], nprocs: int, timeout: float
) -> tuple[Exception | None, str]:
    """``mp.spawn``'s two steps with ``fn``: what the parent raised, and what the children wrote.

    Starts ``nprocs`` children with the spawn start method, each running ``fn(rank, nprocs)``,
    with their stderr (file descriptor 2, which they inherit) sent to a file; waits at most
    ``timeout`` seconds for each (then kills it), and lets ``mp.ProcessContext.join`` judge, as
    ``mp.spawn`` does (lesson 10b, entry 1).
    """
    import torch.multiprocessing as mp

    if nprocs < 1 or timeout <= 0:
        raise ValueError(f"nprocs={nprocs!r} and timeout={timeout!r} must be positive")
    context = multiprocessing.get_context("spawn")  # mp.spawn's start method
    children = [context.Process(target=fn, args=(rank, nprocs)) for rank in range(nprocs)]
    with tempfile.TemporaryFile(mode="w+") as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)  # children started now inherit the file as their stderr
        try:
            for child in children:
                child.start()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        for child in children:  # bounded: a child still running after `timeout` is killed
            child.join(timeout)
            if child.is_alive():
                child.kill()
                child.join()
        # a child that died before running fn left no error file: names that do not exist
        no_files = [os.path.join(tempfile.gettempdir(), f"none-{c.pid}") for c in children]
        try:
            mp.ProcessContext(children, no_files).join()
            raised = None
        except Exception as exc:  # the parent only learns that a child ended badly
            raised = exc
        err.seek(0)
        return raised, err.read()


def where_ranks_waited(log_dir: str | Path, function: str) -> dict[int, str]:
    """Per rank, the line of ``function`` its first ``faulthandler`` dump shows (lesson 10b).

    Reads ``rank<R>.log`` in ``log_dir`` (the launcher's logs) and looks the line up in the
    source file the dump names. A rank whose log holds no dump of ``function`` is left out.
    """
    found = {}
    for log in sorted(Path(log_dir).glob("rank*.log")):
        text = log.read_text(errors="replace")
        match = re.search(rf'File "(.+)", line (\d+) in {re.escape(function)}\n', text)
        if match:
            found[int(log.stem.removeprefix("rank"))] = linecache.getline(
                match[1], int(match[2])
            ).strip()
    return found
