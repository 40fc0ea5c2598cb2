"""The training loop several lessons reuse (02 to 05).

Lesson 02 checks :func:`fit` against its own loop. The model is never moved (one device,
DataParallel, DDP or a split model all work): inputs go to ``device``, targets to where the
outputs come out. Metrics stay on the device until the epoch ends: no synchronisation per step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from operator import length_hint

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from .progress import progress_bar
from .timing import synchronize

__all__ = [
    "EpochResult",
    "History",
    "evaluate",
    "fit",
    "pick_device",
    "seed_everything",
    "train_epoch",
]

LossFn = Callable[[Tensor, Tensor], Tensor]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) so a run repeats exactly on the same hardware."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def pick_device() -> torch.device:
    """The best single device here: ``cuda:0``, else Apple's ``mps``, else ``cpu`` (lesson 01)."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@dataclass(frozen=True)
class EpochResult:
    """Mean loss, accuracy and speed of one pass."""

    loss: float
    accuracy: float
    samples: int
    seconds: float

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class History:
    """Per-epoch metrics of :func:`fit`, one list per metric (ready for plotting)."""

    epoch: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    train_acc: list[float] = field(default_factory=list)
    test_loss: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)
    samples_per_sec: list[float] = field(default_factory=list)  # training throughput

    def append(self, epoch: int, train: EpochResult, test: EpochResult | None) -> None:
        self.epoch.append(epoch)
        self.train_loss.append(train.loss)
        self.train_acc.append(train.accuracy)
        self.test_loss.append(test.loss if test else float("nan"))
        self.test_acc.append(test.accuracy if test else float("nan"))
        self.samples_per_sec.append(train.samples_per_sec)

    def as_dict(self) -> dict[str, list]:
        return asdict(self)


_FOLD_EVERY = 32  # batches whose metrics are kept before they are added up on the device


class _Metrics:
    """Loss and accuracy sums of one pass, added up on the device every ``_FOLD_EVERY`` batches.

    Summing every step costs kernel launches (10% or more for a small model on a GPU); keeping
    every batch's outputs to the end would hold a whole epoch in device memory.
    """

    def __init__(self) -> None:
        self.kept: list[tuple[Tensor, Tensor, Tensor]] = []  # (mean loss, outputs, targets)
        self.loss_sum: Tensor | float = 0.0
        self.correct: Tensor | int = 0
        self.samples = 0

    def add(self, loss: Tensor, outputs: Tensor, targets: Tensor) -> None:
        self.kept.append((loss.detach(), outputs.detach(), targets))
        if len(self.kept) >= _FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        if not self.kept:
            return
        losses, outputs, targets = zip(*self.kept, strict=True)
        sizes = [t.shape[0] for t in targets]
        if len(set(sizes)) == 1:
            self.loss_sum += torch.stack(losses).sum() * sizes[0]
        else:  # a smaller last batch
            self.loss_sum += torch.stack([x * n for x, n in zip(losses, sizes, strict=True)]).sum()
        self.correct += (torch.cat(outputs).argmax(dim=1) == torch.cat(targets)).sum()
        self.samples += sum(sizes)
        self.kept = []


def _run(
    model: nn.Module,
    loader: Iterable,
    device: torch.device | str,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    bar: tqdm | None = None,
) -> EpochResult:
    """One pass: trains when an optimizer is given, counts the batches on ``bar``."""
    model.train(optimizer is not None)
    metrics = _Metrics()
    synchronize(device)
    start = time.perf_counter()
    for inputs, targets in loader:
        outputs = model(inputs.to(device, non_blocking=True))
        targets = targets.to(outputs.device, non_blocking=True)
        loss = loss_fn(outputs, targets)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        metrics.add(loss, outputs, targets)
        if bar is not None:
            bar.update()
    metrics.fold()
    if not metrics.samples:
        raise ValueError("the loader yielded no batches; is the data set empty?")
    synchronize(metrics.correct.device)  # type: ignore[union-attr]
    seconds = time.perf_counter() - start
    n = metrics.samples
    return EpochResult(float(metrics.loss_sum) / n, int(metrics.correct) / n, n, seconds)


def _batch_bar(loader: Iterable, desc: str, progress: bool) -> tqdm:
    # Not wrapping the loader: tqdm.auto calls iter() on what it wraps (tqdm issues #1598, #1467),
    # which would start the DataLoader twice per epoch: another shuffle, a second set of workers.
    total = length_hint(loader) or None  # None: streamed data (an IterableDataset) has no len
    return progress_bar(total=total, desc=desc, leave=False, disable=not progress, unit="batch")


def train_epoch(
    model: nn.Module,
    loader: Iterable,
    optimizer: torch.optim.Optimizer,
    device: torch.device | str,
    *,
    loss_fn: LossFn = F.cross_entropy,
    progress: bool = True,
    desc: str = "train",
) -> EpochResult:
    """One pass over ``loader`` that updates ``model``; returns mean loss, accuracy, speed."""
    with _batch_bar(loader, desc, progress) as bar:
        return _run(model, loader, device, loss_fn, optimizer, bar)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable,
    device: torch.device | str,
    *,
    loss_fn: LossFn = F.cross_entropy,
) -> EpochResult:
    """Mean loss and accuracy of ``model`` on ``loader``, without updating it."""
    return _run(model, loader, device, loss_fn, None)


def fit(
    model: nn.Module,
    train_loader: Iterable,
    test_loader: Iterable | None,
    optimizer: torch.optim.Optimizer,
    device: torch.device | str,
    epochs: int,
    *,
    loss_fn: LossFn = F.cross_entropy,
    progress: bool = True,
    on_epoch_start: Callable[[int], None] | None = None,
) -> History:
    """Train for ``epochs`` and evaluate after each; returns the :class:`History`.

    ``on_epoch_start(epoch)`` runs before each epoch (lesson 04b passes its sampler's
    ``set_epoch``).
    """
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a whole number >= 1, got {epochs!r}")
    history = History()
    bar = progress_bar(range(epochs), desc="epochs", disable=not progress, unit="epoch")
    # One batch bar for the whole run, reset every epoch: a notebook bar is a widget that costs
    # milliseconds to create, a lot next to an epoch that takes a few (small data on a GPU).
    with _batch_bar(train_loader, f"epoch 1/{epochs}", progress) as batches:
        for epoch in bar:
            if on_epoch_start is not None:
                on_epoch_start(epoch)
            if epoch > 0:
                batches.reset()  # same total: the loader keeps its length
                batches.set_description(f"epoch {epoch + 1}/{epochs}", refresh=False)
            train = _run(model, train_loader, device, loss_fn, optimizer, batches)
            test = None
            if test_loader is not None:  # not truthiness: a streamed loader has no len()
                test = evaluate(model, test_loader, device, loss_fn=loss_fn)
            history.append(epoch + 1, train, test)
            test_acc = f"{test.accuracy:.3f}" if test else "-"
            speed = f"{train.samples_per_sec:,.0f} samples/s"  # a keyword would show name=value
            bar.set_postfix_str(f"loss={train.loss:.3f}, test_acc={test_acc}, {speed}")
    return history
