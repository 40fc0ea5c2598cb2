"""torchrun jobs seen from a notebook: their plan, commands, output and results (lesson 07).

Lesson 07 runs ``scripts/train_ddp.py`` under ``torchrun`` from its cells. What it teaches
stays in its cells: the commands, the checks that prove a resumed run equal to an uninterrupted
one. The machinery is here: checking the parameters, planning the steps and kills, writing a
command as a learner would type it, printing a job's output within 100 characters, reading the
files the workers write, the run comparison, the attempts plot, and the drill of exercise 3.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from mgpu_helpers.jobs import stop_tree

__all__ = [
    "FAULT_WORKER",
    "RunPlan",
    "compare_runs",
    "describe",
    "kill_drill",
    "plan_runs",
    "job_output",
    "plot_attempts",
    "print_command",
    "read_result",
    "read_whoami",
    "require_seconds",
    "require_whole",
    "shell_line",
    "wait_for_files",
    "show_whoami",
    "wrapped",
]

FAULT_WORKER = Path(__file__).with_name("fault_worker.py")  # the worker the faults use
_TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
# gloo ends a lost peer's error with "GLHF!" and an emoji that some browsers draw as an empty box
_GREETING = re.compile(" ?GLHF! ?|[\U0001f000-\U0001faff\u2600-\u27bf\ufe0f]")


def require_whole(low: int, **values: object) -> None:
    """Refuse a parameter that is not a whole number >= ``low``, naming it."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r}: it must be a whole number >= {low}")


def require_seconds(**values: object) -> None:
    """Refuse a parameter that is not a number of seconds > 0, naming it."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}={value!r}: it must be a number of seconds > 0")


@dataclass(frozen=True)
class RunPlan:
    """What every training job of lesson 07 will do, worked out before any starts."""

    steps_per_epoch: int  # optimizer steps in one epoch
    total_steps: int  # optimizer steps in the whole run
    snapshot_steps: tuple[int, ...]  # the steps after which the script writes a snapshot
    first_kill: int  # a rank dies after this step (the stopped job)
    second_kill: int  # ... and after this one (the job torchrun restarts)


def plan_runs(
    steps_per_epoch: int, epochs: int, snapshot_every: int, kill_at_step: int | None
) -> RunPlan:
    """The steps, snapshots and kills of lesson 07's jobs; a clear error if they cannot fit."""
    total = steps_per_epoch * epochs
    ends = {steps_per_epoch * e for e in range(1, epochs + 1)}
    every = set(range(snapshot_every, total + 1, snapshot_every)) if snapshot_every else set()
    snapshots = tuple(sorted(ends | every))
    if snapshots[0] > total - 2:
        raise ValueError(
            f"EPOCHS={epochs}, SNAPSHOT_EVERY={snapshot_every}: the first snapshot comes after "
            f"step {snapshots[0]} of {total}, too late for two kills; set SNAPSHOT_EVERY to 1 .. "
            f"{total - 2}, or EPOCHS to 2 or more"
        )
    first = max(int(0.45 * total), snapshots[0]) if kill_at_step is None else kill_at_step
    if (
        isinstance(first, bool)
        or not isinstance(first, int)
        or not snapshots[0] <= first <= total - 2
    ):
        raise ValueError(
            f"KILL_AT_STEP={kill_at_step!r}: use None, or a step from {snapshots[0]} (the first "
            f"snapshot) to {total - 2} (the run has {total} steps, and a rank dies again later)"
        )
    second = first + (total - first) // 2  # half-way through the steps left
    return RunPlan(steps_per_epoch, total, snapshots, first, second)


def shell_line(cmd: Sequence[str | os.PathLike[str]], plain: bool = False) -> str:
    """``cmd`` as one shell line, every part quoted where it needs it (``shlex.quote``).

    ``plain=True``: as a learner types it in a terminal, ``torchrun`` for this kernel's
    ``python -m torch.distributed.run`` and ``python`` for its interpreter.
    """
    parts = [os.fspath(part) for part in cmd]
    if plain:
        if tuple(parts[:3]) == _TORCHRUN:
            parts = ["torchrun", *parts[3:]]
        if "torch.distributed.run" in parts and parts.index("torch.distributed.run") > 0:
            i = parts.index("torch.distributed.run")
            if parts[i - 1] == "-m" and parts[i - 2] == sys.executable:
                parts[i - 2 : i + 1] = ["torchrun"]
        parts = ["python" if p == sys.executable else p for p in parts]
    return shlex.join(parts)


def wrapped(text: object, end: str = "") -> str:
    """``text`` with lines over 100 characters broken at spaces (a notebook's output area
    would break them inside words), each piece but the last followed by ``end`` (`` \\``
    continues a shell line); site-packages paths shortened, gloo's greeting ("GLHF!" and an
    emoji) dropped."""
    site = str(Path(torch.__file__).parents[1])
    lines = _GREETING.sub("", str(text).replace(site, "site-packages")).splitlines()
    pieces = (
        textwrap.wrap(
            line.rstrip(),
            95,
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        or [""]
        for line in lines
    )
    return "\n".join((end + "\n").join(p) for p in pieces)


def print_command(cmd: Sequence[str | os.PathLike[str]], label: str = "$ ") -> None:
    """Print ``cmd`` as a learner types it in a terminal, continued over lines with ``\\``
    between quoted words (never inside one), within 100 characters where a word allows."""
    lines = [label.rstrip()] if label.strip() else []
    for word in shlex.split(shell_line(cmd, plain=True)):
        word = shlex.quote(word)
        if lines and len(lines[-1]) + 1 + len(word) <= 95:
            lines[-1] += " " + word
        else:
            lines.append(("    " if lines else "") + word)
    print(" \\\n".join(lines))


def job_output(output: str, tracebacks: bool = True) -> str:
    """A job's output for printing: within 100 characters a line, without the C++ stack
    frames of torch's warnings (counted instead) and without gloo's emoji. With
    ``tracebacks=False``, a rank's Python traceback keeps only its last line, the error
    (and the lines that chain one error to the next); its frames are counted instead."""
    keep, frames, tb_lines = [], 0, 0
    for line in output.splitlines():
        bare = re.sub(r"^\[node \d\] ", "", line)
        if bare.startswith(("frame #", "Exception raised from ")):
            frames += 1
            continue
        if not tracebacks and _traceback_frame(bare):
            tb_lines += 1
            continue
        keep.append(line)
    if frames:
        keep.append(f"({frames} lines of C++ stack frames left out)")
    if tb_lines:
        keep.append(f"({tb_lines} lines of the ranks' Python tracebacks left out)")
    return wrapped("\n".join(keep))


def _traceback_frame(line: str) -> bool:
    """True for a ``[rankN]:`` line of a Python traceback other than its error: the header,
    a frame, its source line or a ``^^^`` marker (all indented), or a blank."""
    found = re.match(r"\[rank\d+\]: ?(.*)", line)
    if found is None:
        return False
    text = found.group(1)
    return not text.strip() or text[0].isspace() or text.startswith("Traceback (most recent")


def read_whoami(folder: Path, pattern: str = "rank*.json") -> list[dict[str, Any]]:
    """Every file ``pattern`` a lesson 07 worker wrote in ``folder``, in global rank order."""
    seen = [json.loads(p.read_text()) for p in folder.glob(pattern)]
    return sorted(seen, key=lambda s: int(s["RANK"]))


def show_whoami(seen: list[dict[str, Any]], names: list[str]) -> None:
    """Print the variables ``names`` of every worker, one row each."""
    print("  ".join(f"{n:>{max(len(n), 6)}}" for n in names))
    for s in seen:
        print("  ".join(f"{s[n]!s:>{max(len(n), 6)}}" for n in names))


def wait_for_files(folder: Path, pattern: str, count: int, timeout: float = 30.0) -> list[Path]:
    """The files ``pattern`` in ``folder`` once there are ``count`` of them (processes that
    outlive their job write them late); a clear error after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while len(found := sorted(folder.glob(pattern))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(found)} of {count} files {pattern} in {folder} after {timeout:g} s"
            )
        time.sleep(0.05)
    return found


def read_result(folder: Path) -> dict[str, Any]:
    """The ``result.json`` that rank 0 of ``scripts/train_ddp.py`` left in ``folder``."""
    return json.loads((folder / "result.json").read_text())


def describe(value: object) -> str:
    """A one-line summary of a snapshot's entry (tensors by shape, long dicts by count)."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    if (
        isinstance(value, dict)
        and value
        and all(isinstance(v, torch.Tensor) for v in value.values())
    ):
        return f"{len(value)} tensors, {sum(v.numel() for v in value.values()):,} numbers"
    if isinstance(value, dict):
        inner = "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
        if len(inner) <= 85:
            return inner
        names = f": {', '.join(map(str, value))}" if len(value) < 6 else ""
        return f"{len(value)} entries{names}"
    if isinstance(value, list):
        return f"list of {len(value)}"
    return repr(value)


def compare_runs(folder: Path, reference_dir: Path) -> float:
    """Largest weight difference between two runs' ``model.pt``; fails if they differ more
    than allowed. On the CPU bit for bit (and the same history), with one exception: a resumed
    run of 3 or more ranks agrees to float32 rounding (lesson 07, section 5 says why). On GPUs
    to 1e-3 (kernels may add in another order from run to run)."""
    mine = torch.load(folder / "model.pt", weights_only=True)
    ref = torch.load(reference_dir / "model.pt", weights_only=True)
    gap = max((mine[k].double() - ref[k].double()).abs().max().item() for k in ref)
    result, reference = read_result(folder), read_result(reference_dir)
    on_cpu = result["device"] == reference["device"] == "cpu"
    if on_cpu and result["resumed_from"] is not None and result["world_size"] > 2:
        print(f"{result['world_size']} ranks: a resumed run agrees to float32 rounding")
        for k in ref:
            torch.testing.assert_close(mine[k], ref[k], rtol=1e-4, atol=1e-6, msg=f"{k} differs")
    elif on_cpu:
        assert all(torch.equal(mine[k], ref[k]) for k in ref), f"weights differ by {gap:.1e}"
        assert result["history"] == reference["history"], "the history differs"
    else:
        for k in ref:
            torch.testing.assert_close(mine[k], ref[k], rtol=1e-3, atol=1e-3, msg=f"{k} differs")
    return gap


def plot_attempts(
    total: int, kills: tuple[int, int], resumes: tuple[int, int], snapshots: Sequence[int]
) -> Figure:
    """The optimizer steps of each attempt of lesson 07, the snapshots and the steps redone."""
    rows = [
        ("uninterrupted", 0, total, None),
        ("stopped job", 0, kills[0], None),
        ("resubmitted, attempt 1", resumes[0], kills[1], kills[0]),
        ("attempt 2, by torchrun", resumes[1], total, kills[1]),
    ]
    fig = Figure(figsize=(10, 3.2), layout="constrained")
    ax = fig.subplots()
    for y, (_, first, last, redone_until) in enumerate(reversed(rows)):
        ax.barh(y, last - first, left=first, height=0.5, color="C0", edgecolor="black", lw=0.5)
        if redone_until is not None and redone_until > first:
            ax.barh(
                y,
                redone_until - first,
                left=first,
                height=0.5,
                color="C3",
                edgecolor="black",
                lw=0.5,
                label="computed twice" if y == 1 else None,
            )
        ticks = [s for s in snapshots if first < s <= last]
        ax.plot(ticks, [y] * len(ticks), "|", color="black", markersize=16)
    for kill in kills:
        ax.axvline(kill, color="C3", ls="--", lw=1)
        ax.text(kill, 3.45, f" kill after {kill}", color="C3", va="bottom")
    ax.set(
        yticks=range(4),
        yticklabels=[r[0] for r in reversed(rows)],
        xlim=(0, total),
        xlabel="optimizer steps done",
        ylim=(-0.5, 3.9),
        title="the optimizer steps of each attempt; | marks a snapshot written",
    )
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside lower right", fontsize="small")
    return fig


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended: it no longer exists, or is a zombie (ended, not yet
    reaped). Without ``/proc`` (macOS) a process that still answers counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:  # it ended between the two looks, or there is no /proc
        return Path("/proc").is_dir()


def node_gpus(node: int, gpus_per_node: int, visible: str | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for node ``node`` of a job split over this machine's
    GPUs, ``gpus_per_node`` each. ``visible`` (default: this process's ``CUDA_VISIBLE_DEVICES``)
    is the parent's list: a kernel started with ``2,3`` gives node 0 GPU 2 and node 1 GPU 3,
    not GPUs 0 and 1. Unset or empty, the indices count from 0."""
    require_whole(1, gpus_per_node=gpus_per_node)
    require_whole(0, node=node)
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = node * gpus_per_node
    wanted = range(first, first + gpus_per_node)
    if not visible or not visible.strip():
        return ",".join(map(str, wanted))
    parent = [d.strip() for d in visible.split(",") if d.strip()]
    if first + gpus_per_node > len(parent):
        raise ValueError(f"node {node} needs GPUs {first}..{first + gpus_per_node - 1} of "
                         f"CUDA_VISIBLE_DEVICES={visible!r}, which lists {len(parent)}")
    return ",".join(parent[i] for i in wanted)


def _kill_orphans(folder: Path) -> None:
    """SIGKILL to every first-attempt worker the drill started, and wait (3 s at most) for it."""
    pids = []
    for p in folder.glob("rank*-attempt0.json"):
        pid = json.loads(p.read_text())["pid"]
        try:
            os.kill(pid, signal.SIGKILL)
            pids.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 3.0
    while pids and time.monotonic() < deadline and not all(map(gone, pids)):
        time.sleep(0.02)


def kill_drill(kill: Callable[[str], int], folder: Path, timeout: float = 60.0) -> dict[str, Any]:
    """Exercise 3's stage: a real ``torchrun --max-restarts=1`` job of two waiting workers.

    First ``kill`` gets a pattern that matches no process: it must raise RuntimeError (before
    any job starts, so a stub's NotImplementedError costs nothing). Then, once both workers are
    up, ``kill(pattern)`` is called with a pattern for ``pgrep -f`` that matches the job's
    processes; it must kill one worker and return its process id. Returns
    the job's exit status, the agent's and the workers' process ids, the killed id and the
    restart count each rank saw last. The job is stopped whatever happens.
    """
    nothing = f"no-such-process-{time.time_ns()}"
    try:
        pid = kill(nothing)
    except NotImplementedError:  # a RuntimeError too, but a stub's: not the answer wanted
        raise
    except RuntimeError:
        pass
    else:
        raise ValueError(
            f"kill({nothing!r}) returned {pid!r}: with no process matching, raise RuntimeError"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("rank*.json"):
        old.unlink()
    tag = f"drill-{os.getpid()}-{time.time_ns()}"  # in the command line: pgrep finds this job
    cmd = [
        *_TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        str(FAULT_WORKER),
        str(folder),
        "wait",
        "30",
        tag,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agent = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while len(list(folder.glob("rank*-attempt0.json"))) < 2:
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the drill's job did not start its workers (status {agent.poll()})"
                )
            time.sleep(0.05)
        workers = [json.loads(p.read_text())["pid"] for p in folder.glob("rank*-attempt0.json")]
        killed = kill(tag)
        status = agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        stop_tree(agent)  # the agent and its workers
        _kill_orphans(folder)  # workers whose agent was killed: no tree leads to them
    attempts: dict[str, int] = {}
    for p in folder.glob("rank*-attempt*.json"):
        seen = json.loads(p.read_text())
        attempts[seen["RANK"]] = max(
            attempts.get(seen["RANK"], 0), int(seen["TORCHELASTIC_RESTART_COUNT"])
        )
    return {
        "status": status,
        "agent": agent.pid,
        "workers": sorted(workers),
        "killed": killed,
        "attempts": attempts,
    }
