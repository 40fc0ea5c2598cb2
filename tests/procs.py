"""Child processes in tests: what a launch left behind (the "no orphans" checks), and a torchrun
stopped by SIGTERM once it has written a file (lessons 07 and 11's clean stop)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from mgpu_helpers.jobs import stop_tree

__all__ = ["rank_children", "sigterm_once_written"]

# multiprocessing's own helpers live as long as the test process, by design: the resource
# tracker, and the fork server that the launcher forks its ranks from. Only these direct children
# are kept: the ranks are the fork server's children and carry its command line too.
_KEEPERS = ("resource_tracker", "forkserver")


def rank_children() -> list[psutil.Process]:
    """Processes below this one still running, apart from multiprocessing's long-lived helpers."""
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            helper = p.ppid() == os.getpid() and any(k in " ".join(p.cmdline()) for k in _KEEPERS)
            if p.is_running() and not helper:
                left.append(p)
        except psutil.NoSuchProcess:
            continue
    return left


def sigterm_once_written(
    cmd: Sequence[str], written: Path, log: Path, cwd: Path, env: Mapping[str, str], timeout: float
) -> str:
    """Start ``cmd`` (a torchrun), send its agent SIGTERM once ``written`` exists, return the log.

    As scancel or SLURM's time limit would: torchrun passes the signal to every worker. The
    agent must still be running when the file appears, within ``timeout`` seconds; its process
    tree is stopped whatever happens.
    """
    with open(log, "wb") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                 env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                                 start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + timeout
            while not written.exists():
                assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=60)  # torchrun gives its workers 30 s before SIGKILL
        finally:
            stop_tree(agent)
    return log.read_text()
