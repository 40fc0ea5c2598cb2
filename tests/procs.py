"""Which child processes a launch left behind (the launcher tests' "no orphans" checks)."""

from __future__ import annotations

import psutil

__all__ = ["rank_children"]

# multiprocessing's own helpers live as long as the test process, by design: the resource
# tracker, and the fork server that the launcher forks its ranks from.
_KEEPERS = ("resource_tracker", "forkserver")


def rank_children() -> list[psutil.Process]:
    """Child processes still running, apart from multiprocessing's long-lived helpers."""
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.is_running() and not any(k in " ".join(p.cmdline()) for k in _KEEPERS):
                left.append(p)
        except psutil.NoSuchProcess:
            continue
    return left
