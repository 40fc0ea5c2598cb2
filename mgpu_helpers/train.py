"""The training loop every lesson reuses (lesson 02).

Plain functions: :func:`train_epoch`, :func:`evaluate` and :func:`fit`. They never move the
model: put it on its device(s) yourself (one device, ``nn.DataParallel``, DDP or a model split
across devices all work). Inputs go to ``device``; targets go to wherever the outputs come out,
which is the last device of a split model. Loss and accuracy are summed on the device and read
once per epoch, so the loop adds no synchronisation per step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

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
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
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


def _run(
    model: nn.Module,
    batches: Iterable,
    device: torch.device,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
) -> EpochResult:
    """One pass; trains when an optimizer is given. Sums stay on the output device."""
    total_loss: Tensor | None = None
    correct: Tensor | None = None
    samples = 0
    synchronize(device)
    start = time.perf_counter()
    for inputs, targets in batches:
        outputs = model(inputs.to(device, non_blocking=True))
        targets = targets.to(outputs.device, non_blocking=True)
        loss = loss_fn(outputs, targets)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        n = targets.shape[0]
        batch_loss = loss.detach() * n
        batch_correct = (outputs.detach().argmax(dim=1) == targets).sum()
        total_loss = batch_loss if total_loss is None else total_loss + batch_loss
        correct = batch_correct if correct is None else correct + batch_correct
        samples += n
    if total_loss is None or correct is None:
        raise ValueError("the loader yielded no batches; is the data set empty?")
    synchronize(total_loss.device)
    seconds = time.perf_counter() - start
    return EpochResult(total_loss.item() / samples, correct.item() / samples, samples, seconds)


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
    model.train()
    # The bar only counts batches; it must not wrap the loader: tqdm.auto's bar calls iter() on
    # what it wraps as soon as it is created (tqdm issue #1598), which would start the
    # DataLoader twice per epoch: a different shuffle than a plain loop, and, with worker
    # processes, a second set of workers (tqdm issue #1467).
    try:
        total = len(loader)  # type: ignore[arg-type]
    except TypeError:  # streamed data: a DataLoader over an IterableDataset has no length
        total = None
    with tqdm(total=total, desc=desc, leave=False, disable=not progress, unit="batch") as bar:
        return _run(model, _counted(loader, bar), torch.device(device), loss_fn, optimizer)


def _counted(loader: Iterable, bar: tqdm) -> Iterator:
    """Yield the batches of ``loader`` and advance ``bar`` after each one."""
    for batch in loader:
        yield batch
        bar.update()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable,
    device: torch.device | str,
    *,
    loss_fn: LossFn = F.cross_entropy,
) -> EpochResult:
    """Mean loss and accuracy of ``model`` on ``loader``, without updating it."""
    model.eval()
    return _run(model, loader, torch.device(device), loss_fn, None)


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

    ``on_epoch_start(epoch)`` runs before each epoch (lesson 04 passes the sampler's
    ``set_epoch`` here, so each epoch is shuffled differently).
    """
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a whole number >= 1, got {epochs!r}")
    history = History()
    bar = tqdm(range(epochs), desc="epochs", disable=not progress, unit="epoch")
    for epoch in bar:
        if on_epoch_start is not None:
            on_epoch_start(epoch)
        train = train_epoch(
            model,
            train_loader,
            optimizer,
            device,
            loss_fn=loss_fn,
            progress=progress,
            desc=f"epoch {epoch + 1}/{epochs}",
        )
        test = (
            evaluate(model, test_loader, device, loss_fn=loss_fn)
            if test_loader is not None  # not truthiness: a loader over streamed data has no len()
            else None
        )
        history.append(epoch + 1, train, test)
        bar.set_postfix(
            loss=f"{train.loss:.3f}",
            test_acc=f"{test.accuracy:.3f}" if test else "-",
            samples_s=f"{train.samples_per_sec:,.0f}",
        )
    return history
