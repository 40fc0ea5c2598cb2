"""Which child processes a launch left behind (the launcher tests' "no orphans" checks)."""

from __future__ import annotations

import os

import psutil

__all__ = ["rank_children"]

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
