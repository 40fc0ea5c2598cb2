"""Small shared plumbing (no lesson of its own): the course runner's and the benchmarks'."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

__all__ = ["temporary_environ", "write_json"]


@contextmanager
def temporary_environ(changes: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables (seen by processes started inside), then restore them."""
    old = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_json(path: str | Path, data: object) -> Path:
    """Write ``data`` as indented JSON, creating the folder (benchmark results, reports)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path
