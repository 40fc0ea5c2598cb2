"""A text progress bar for machines without tqdm (scripts/lesson_as_script.py adds this folder
to the path only when ``import tqdm`` fails, and says so).

It takes tqdm's common arguments and methods, and draws ``desc: 40%|####      | 4/10 [1.2 s]``
on stderr, redrawn in place at most every ``mininterval`` seconds; closed with ``leave=True`` it
stays as one line. Not a full tqdm: unknown keyword arguments are accepted and ignored.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["TqdmWarning", "tqdm", "trange"]


class TqdmWarning(Warning):
    """tqdm's warning category, for code that filters it."""


class tqdm:  # noqa: N801 (tqdm's name)
    """tqdm's text bar, reduced to what the course uses."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        desc: str | None = None,
        total: float | None = None,
        leave: bool | None = True,
        file: Any = None,
        mininterval: float = 0.5,
        disable: bool | None = False,
        unit: str = "it",
        initial: float = 0,
        postfix: Any = None,
        **kwargs: Any,
    ) -> None:
        self.iterable = iterable
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except (TypeError, AttributeError):
                total = None
        self.desc, self.total, self.leave = desc or "", total, leave
        self.file = file if file is not None else sys.stderr
        self.mininterval, self.disable, self.unit = mininterval, bool(disable), unit
        self.n = initial
        self.postfix = ""
        self.start = time.perf_counter()
        self.last_draw = 0.0
        self.closed = False
        if postfix:
            self.set_postfix(postfix, refresh=False)
        self.refresh()

    def __iter__(self) -> Iterator:
        if self.iterable is None:
            raise TypeError("this bar has no iterable; call update() instead")
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def __enter__(self) -> tqdm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        if time.perf_counter() - self.last_draw >= self.mininterval:
            self.refresh()

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""
        if refresh:
            self.refresh()

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**dict(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items.items()
        )
        if refresh:
            self.refresh()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s
        if refresh:
            self.refresh()

    def __str__(self) -> str:
        elapsed = time.perf_counter() - self.start
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            share = min(1.0, self.n / self.total)
            bar = "#" * int(20 * share)
            body = f"{share:4.0%}|{bar:<20}| {self.n:g}/{self.total:g}"
        else:
            body = f"{self.n:g} {self.unit}"
        tail = f", {self.postfix}" if self.postfix else ""
        return f"{head}{body} [{elapsed:.1f} s{tail}]"

    def refresh(self) -> None:
        if self.disable or self.closed:
            return
        self.file.write(f"\r{self}")
        self.file.flush()
        self.last_draw = time.perf_counter()

    def close(self) -> None:
        if self.disable or self.closed:
            return
        if self.leave:
            self.file.write(f"\r{self}\n")
        else:
            self.file.write("\r")
        self.file.flush()
        self.closed = True

    def clear(self) -> None:
        pass

    @classmethod
    def write(cls, s: str, file: Any = None, end: str = "\n") -> None:
        (file or sys.stdout).write(f"{s}{end}")


def trange(*args: int, **kwargs: Any) -> tqdm:
    """``tqdm(range(*args), **kwargs)``."""
    return tqdm(range(*args), **kwargs)
