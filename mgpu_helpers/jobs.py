"""Run command lines from a notebook or a test, bounded in time (lesson 07).

Lesson 07 starts ``torchrun`` from its cells, sometimes two agents at once (two "nodes" on one
machine), and reads what they print as they print it. IPython's ``!cmd`` does the simple case;
what it does not do, and this module adds: several commands at once with their lines prefixed
(``[node 0] ...``), a time limit after which the command's whole process tree is stopped
(``torchrun`` starts each worker in a session of its own, so killing the agent alone would leave
the workers running), and the output kept for checks. The tests of ``scripts/train_ddp.py`` use
it the same way.
"""

from __future__ import annotations

import codecs
import math
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["JobResult", "free_port", "run_job", "run_jobs", "stop_tree"]

_GRACE = 3.0  # seconds a timed-out job gets to stop on SIGTERM before SIGKILL
_TAIL = 40  # lines of output quoted in an error message


@dataclass(frozen=True)
class JobResult:
    """What one command did: its exit status, everything it printed, and how long it ran."""

    cmd: tuple[str, ...]  # the command line as run
    returncode: int  # 0: success; negative: killed by that signal (POSIX)
    output: str  # stdout and stderr together, in the order printed, without prefixes
    seconds: float  # wall time from start to exit

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, lines: int = _TAIL) -> str:
        """The last ``lines`` lines of the output (what error messages quote)."""
        return "\n".join(self.output.splitlines()[-lines:])

    def check(self) -> JobResult:
        """This result if the command succeeded, else a RuntimeError quoting its last lines."""
        if not self.ok:
            raise RuntimeError(
                f"{' '.join(self.cmd)} exited with status {self.returncode} after "
                f"{self.seconds:.1f} s; its last lines:\n{self.tail()}"
            )
        return self


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for ``--rdzv-endpoint``/``--master-port``).

    The operating system picks it; another program could take it before the job binds it,
    which is rare enough for a notebook or a test (``torchrun --standalone`` avoids even that).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_job(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    prefix: str = "",
    echo: bool = True,
    check: bool = False,
) -> JobResult:
    """Run ``cmd``, print each output line (after ``prefix``) as it comes, return a JobResult.

    ``env``: variables set on top of this process's environment (``PYTHONUNBUFFERED=1`` is
    added so that Python children print line by line). After ``timeout`` seconds the whole
    process tree is stopped and TimeoutError raised with the output's last lines; ``check=True``
    raises RuntimeError on a non-zero exit status.
    """
    return run_jobs(
        [cmd], timeout=timeout, env=env, cwd=cwd, prefixes=[prefix], echo=echo, check=check
    )[0]


def run_jobs(
    cmds: Sequence[Sequence[str | os.PathLike[str]]],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    prefixes: Sequence[str] | None = None,
    echo: bool = True,
    check: bool = False,
) -> list[JobResult]:
    """Run several commands at once (two torchrun agents: two "nodes"); one result each.

    Lines are printed as they come with the prefixes (default ``[node 0] ``, ``[node 1] ``, ...).
    ``timeout`` bounds all of them together: past it every command still running is stopped
    with its process tree and TimeoutError is raised. See :func:`run_job` for the rest.
    """
    if not cmds:
        raise ValueError("run_jobs needs at least one command")
    if not timeout or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if prefixes is None:
        prefixes = [f"[node {i}] " for i in range(len(cmds))] if len(cmds) > 1 else [""]
    if len(prefixes) != len(cmds):
        raise ValueError(f"{len(prefixes)} prefixes for {len(cmds)} commands: give one each")
    lines: list[tuple[str, ...]] = [tuple(str(part) for part in cmd) for cmd in cmds]
    for cmd in lines:
        if not cmd:
            raise ValueError("an empty command line: give the program and its arguments")
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.perf_counter()
    procs = []
    try:
        for cmd in lines:
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=child_env,
                    cwd=cwd,
                    start_new_session=True,  # its own process group: killed as a whole
                )
            )
    except OSError as exc:
        for proc in procs:
            _stop(proc)
        raise RuntimeError(f"could not start {' '.join(cmd)}: {exc}") from None
    try:
        outputs, ended = _stream(procs, list(prefixes), start + timeout, echo)
    except BaseException:  # the notebook's stop button (KeyboardInterrupt) stops the jobs too
        for proc in procs:
            _stop(proc)
        raise
    results = []
    late = [i for i, proc in enumerate(procs) if i not in ended]
    for proc in procs:
        if proc.poll() is None:
            _stop(proc)
        try:  # bounded: a process stuck in the kernel (a hung file system) outlives SIGKILL
            proc.wait(timeout=_GRACE)
        except subprocess.TimeoutExpired:
            pass
    for i, proc in enumerate(procs):
        seconds = ended.get(i, time.perf_counter()) - start
        code = -signal.SIGKILL if proc.returncode is None else proc.returncode  # still dying
        results.append(JobResult(lines[i], code, "".join(outputs[i]), seconds))
    if late:
        which = "; ".join(f"{' '.join(lines[i])}:\n{results[i].tail()}" for i in late)
        raise TimeoutError(
            f"stopped after the {timeout:g} s timeout (process tree killed); raise timeout= if "
            f"the job needs longer, or look for a hang. Last lines of {which}"
        )
    if check:
        for result in results:
            result.check()
    return results


def _stream(
    procs: list[subprocess.Popen], prefixes: list[str], deadline: float, echo: bool
) -> tuple[list[list[str]], dict[int, float]]:
    """Read every process's output until all exit or ``deadline``; echo each whole line.

    Read in the calling thread (a notebook shows a background thread's prints in whichever
    cell runs then), by ``select`` on the pipes, so one quiet job never blocks another.
    Returns each process's lines and the time each one exited.
    """
    outputs: list[list[str]] = [[] for _ in procs]
    partial = ["" for _ in procs]
    decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in procs]
    ended: dict[int, float] = {}
    drain_until = None  # all exited but a pipe is still open (a leftover grandchild holds it)
    selector = selectors.DefaultSelector()
    for i, proc in enumerate(procs):
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        selector.register(proc.stdout, selectors.EVENT_READ, i)
    try:
        while (left := deadline - time.perf_counter()) > 0:
            for i, proc in enumerate(procs):
                if i not in ended and proc.poll() is not None:
                    ended[i] = time.perf_counter()
            if len(ended) == len(procs):
                if not selector.get_map():
                    break
                drain_until = drain_until or time.perf_counter() + 1.0
                if time.perf_counter() > drain_until:
                    break
            for key, _ in selector.select(timeout=min(left, 0.2)):
                i = key.data
                chunk = os.read(key.fd, 65536)
                text = decoders[i].decode(chunk, final=not chunk)
                *whole, partial[i] = (partial[i] + text).split("\n")
                if not chunk:  # end of file: every process holding the pipe has exited
                    if partial[i]:
                        whole.append(partial[i])
                    partial[i] = ""
                    selector.unregister(key.fileobj)
                for line in whole:
                    outputs[i].append(line + "\n")
                    if echo:
                        print(f"{prefixes[i]}{line}", flush=True)
    finally:
        selector.close()
        for i, rest in enumerate(partial):
            if rest:
                outputs[i].append(rest)
    return outputs, ended


def stop_tree(proc: subprocess.Popen) -> None:
    """Stop ``proc`` and its process tree (lesson 07's exercise drill starts one itself)."""
    _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Stop ``proc`` and everything it started: SIGTERM to its process group (torchrun then
    stops its workers), SIGKILL to every process of the tree after a short grace (the tree is
    read from /proc on Linux; elsewhere only the process group is killed)."""
    if proc.poll() is not None:
        return
    tree = _descendants(proc.pid)  # before anything exits: torchrun's workers have own sessions
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=_GRACE)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *tree, *_descendants(proc.pid)]:
        _signal_group(pid, signal.SIGKILL)
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group that ``pid`` leads (no error if it is gone)."""
    if sys.platform == "win32":  # no process groups: the process alone
        try:
            os.kill(pid, sig)
        except OSError:
            pass
        return
    try:
        if os.getpgid(pid) == pid:  # only groups the tree's own leaders lead, never ours
            os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (Linux); empty where there is no /proc."""
    children: dict[int, list[int]] = {}
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return []
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name (2nd field) is in parentheses and may hold spaces: split after it
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
