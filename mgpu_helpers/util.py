"""Small shared plumbing (no lesson of its own)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = ["temporary_environ"]


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
