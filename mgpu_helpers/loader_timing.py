"""How long a training step waits for its ``DataLoader`` (lesson 02, section 9).

The lesson writes its loader and the epoch that clocks the wait inside ``next()``. This module
times them like every other comparison in the course: :func:`~mgpu_helpers.timing.
measure_alternating` runs an untimed warm-up, then rounds in a balanced order, and
:func:`~mgpu_helpers.timing.compare` quotes a ratio only where the rounds agree.
"""

from __future__ import annotations

import functools
import multiprocessing
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.utils.data import DataLoader

from .progress import progress_bar
from .timing import Timing, compare, measure_alternating

__all__ = [
    "EpochFn",
    "FirstBatches",
    "LoaderTiming",
    "first_batch_table",
    "loader_table",
    "time_first_batches",
    "time_loaders",
    "worker_start_method",
]

T = TypeVar("T")

# One epoch over a loader; returns the seconds the step spent waiting for batches.
EpochFn = Callable[[DataLoader], float]


@dataclass(frozen=True)
class LoaderTiming:
    """One loader's timed epochs (lesson 02): each round's epoch and its wait for data."""

    samples: int  # samples in one epoch
    timing: Timing  # each round's epoch, start to end (device synchronised)
    waited: tuple[float, ...]  # each round's seconds inside next(), waiting for a batch

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.timing.median

    @property
    def waiting_share(self) -> float:
        """The median share of an epoch the step spent waiting for data."""
        pairs = zip(self.waited, self.timing.times, strict=True)
        return statistics.median(w / s for w, s in pairs)


def _whole(name: str, value: int, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(
            f"{name}={value!r}: use a whole number >= {least} (5 rounds for a verdict)"
        )
    return value


def _rounds_of(
    fns: Mapping[str, Callable[[], T]],
    device: torch.device | str,
    rounds: int,
    progress: bool,
    desc: str,
) -> dict[str, tuple[Timing, tuple[T, ...]]]:
    """:func:`measure_alternating` of ``fns`` after one untimed round: each Timing, and what
    each timed call returned, round by round."""
    rounds = _whole("rounds", rounds)
    returned: dict[str, list[T]] = {name: [] for name in fns}
    with progress_bar(total=(rounds + 1) * len(fns), desc=desc, disable=not progress) as bar:

        def timed(name: str) -> Callable[[], None]:
            def run() -> None:
                returned[name].append(fns[name]())
                bar.update()

            return run

        timings = measure_alternating(
            {name: timed(name) for name in fns}, device, warmup=1, repeats=rounds
        )
    # returned[name][0] came from the untimed round
    return {name: (timings[name], tuple(returned[name][1:])) for name in fns}


def time_loaders(
    loaders: Mapping[str, DataLoader],
    epoch: EpochFn,
    device: torch.device | str = "cpu",
    rounds: int = 5,
    *,
    progress: bool = True,
) -> dict[str, LoaderTiming]:
    """Time ``epoch(loader)`` for each loader in alternating rounds (lesson 02).

    One untimed epoch each comes first: it starts persistent workers and fills caches.
    """
    if not loaders:
        raise ValueError("nothing to time: pass a dict of name -> DataLoader")
    fns = {name: functools.partial(epoch, loader) for name, loader in loaders.items()}
    results = _rounds_of(fns, device, rounds, progress, "epochs")
    return {
        name: LoaderTiming(len(loader.dataset), *results[name])  # type: ignore[arg-type]
        for name, loader in loaders.items()
    }


def loader_table(timings: Mapping[str, LoaderTiming], baseline: str | None = None) -> str:
    """Samples/s, share of time waiting for data, and speed against ``baseline`` (lesson 02).

    The last column is :meth:`~mgpu_helpers.timing.Comparison.brief`: a ratio only where the
    rounds agree, else "no verdict" and the rounds' range.
    """
    if baseline is not None and baseline not in timings:
        raise ValueError(f"baseline {baseline!r} is not one of {', '.join(timings)}")
    width = max(len(name) for name in timings)
    against = f"   speed vs {baseline}" if baseline else ""
    lines = [f"{'':<{width}} {'samples/s':>9}  {'waiting for data':>16}{against}"]
    for name, t in timings.items():
        versus = ""
        if baseline and name != baseline:
            versus = "   " + compare(t.timing, timings[baseline].timing).brief()
        lines.append(f"{name:<{width}} {t.samples_per_sec:9,.0f}  {t.waiting_share:16.0%}{versus}")
    return "\n".join(lines)


@dataclass(frozen=True)
class FirstBatches:
    """Fresh loaders run for a few epochs each round (lesson 02): the wait for each first batch."""

    timing: Timing  # each round: build the loader, then run its epochs
    waits: tuple[tuple[float, ...], ...]  # waits[r][e]: round r, epoch e, the first batch's wait

    @property
    def median_waits(self) -> list[float]:
        """One median over the rounds per epoch."""
        return [statistics.median(column) for column in zip(*self.waits, strict=True)]


def _first_batch_waits(new_loader: Callable[[], DataLoader], epochs: int) -> tuple[float, ...]:
    """Build a loader, run ``epochs`` epochs, return each one's wait for its first batch."""
    loader = new_loader()
    waits = []
    for _ in range(epochs):
        start = time.perf_counter()
        batches = iter(loader)  # starts the workers unless they persist
        next(batches)
        waits.append(time.perf_counter() - start)
        for _ in batches:  # the rest of the epoch
            pass
    return tuple(waits)


def time_first_batches(
    new_loaders: Mapping[str, Callable[[], DataLoader]],
    epochs: int = 3,
    rounds: int = 5,
    *,
    progress: bool = True,
) -> dict[str, FirstBatches]:
    """The wait for each epoch's first batch, per loader, in alternating rounds (lesson 02).

    ``new_loaders`` maps a name to a function that builds a fresh loader, so that every round
    starts without workers. One untimed round comes first.
    """
    if not new_loaders:
        raise ValueError("nothing to time: pass a dict of name -> function that builds a loader")
    epochs = _whole("epochs", epochs)
    fns = {
        name: functools.partial(_first_batch_waits, new, epochs)
        for name, new in new_loaders.items()
    }
    results = _rounds_of(fns, "cpu", rounds, progress, "fresh loaders")
    return {name: FirstBatches(*results[name]) for name in new_loaders}


def first_batch_table(results: Mapping[str, FirstBatches]) -> str:
    """One line per loader: the median wait for each epoch's first batch, in ms (lesson 02)."""
    width = max(len(name) for name in results)
    epochs = max(len(r.median_waits) for r in results.values())
    head = "".join(f"{f'epoch {e + 1}':>10}" for e in range(epochs))
    lines = [f"{'':<{width}}{head}"]
    for name, r in results.items():
        lines.append(f"{name:<{width}}" + "".join(f"{m * 1e3:7.1f} ms" for m in r.median_waits))
    return "\n".join(lines)


def worker_start_method() -> str:
    """How ``DataLoader`` workers start in this Python: its default start method (lesson 02).

    "fork" copies the running process; "spawn" and "forkserver" start a fresh interpreter,
    which must import the dataset's class by name. Asking does not set the method.
    """
    chosen = multiprocessing.get_start_method(allow_none=True)
    return chosen or multiprocessing.get_all_start_methods()[0]
