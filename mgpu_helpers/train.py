"""The training loop several lessons reuse (02 to 05).

Lesson 02 writes its single-device loop in its own cells and checks that :func:`fit` trains
exactly like it (same weights, same metrics); lesson 04's DDP worker is a diff of that loop.
Plain functions: :func:`train_epoch`, :func:`evaluate` and :func:`fit`. They never move the
model: put it on its device(s) yourself (one device, ``nn.DataParallel``, DDP or a model split
across devices all work). Inputs go to ``device``; targets go to wherever the outputs come out,
which is the last device of a split model. Each step's loss and outputs stay on the device and
are reduced once per epoch, so the loop adds no synchronisation and no extra kernel per step.
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


_FOLD_EVERY = 32  # batches whose metrics are kept before they are added up on the device


class _Metrics:
    """Loss and accuracy sums of one pass, added up on the device every few batches.

    Summing every step costs several extra kernel launches per step, which slows a small model
    on a GPU by 10% or more; keeping every batch's outputs until the end would hold a whole
    epoch in device memory. Folding every ``_FOLD_EVERY`` batches does neither.
    """

    def __init__(self) -> None:
        self.losses: list[Tensor] = []  # each kept batch's mean loss
        self.outputs: list[Tensor] = []
        self.targets: list[Tensor] = []
        self.loss_sum: Tensor | None = None
        self.correct: Tensor | None = None
        self.samples = 0

    def add(self, loss: Tensor, outputs: Tensor, targets: Tensor) -> None:
        self.losses.append(loss.detach())
        self.outputs.append(outputs.detach())
        self.targets.append(targets)
        if len(self.losses) >= _FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        if not self.losses:
            return
        sizes = [t.shape[0] for t in self.targets]
        if len(set(sizes)) == 1:
            loss_sum = torch.stack(self.losses).sum() * sizes[0]
        else:  # a smaller last batch
            loss_sum = torch.stack([loss * n for loss, n in zip(self.losses, sizes, strict=True)])
            loss_sum = loss_sum.sum()
        correct = (torch.cat(self.outputs).argmax(dim=1) == torch.cat(self.targets)).sum()
        self.loss_sum = loss_sum if self.loss_sum is None else self.loss_sum + loss_sum
        self.correct = correct if self.correct is None else self.correct + correct
        self.samples += sum(sizes)
        self.losses, self.outputs, self.targets = [], [], []


def _run(
    model: nn.Module,
    batches: Iterable,
    device: torch.device,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
) -> EpochResult:
    """One pass; trains when an optimizer is given. Metrics stay on the output device."""
    metrics = _Metrics()
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
        metrics.add(loss, outputs, targets)
    metrics.fold()
    if metrics.loss_sum is None or metrics.correct is None:
        raise ValueError("the loader yielded no batches; is the data set empty?")
    synchronize(metrics.correct.device)
    seconds = time.perf_counter() - start
    n = metrics.samples
    return EpochResult(metrics.loss_sum.item() / n, metrics.correct.item() / n, n, seconds)


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
        return _train_pass(model, loader, optimizer, device, loss_fn, bar)


def _train_pass(
    model: nn.Module,
    loader: Iterable,
    optimizer: torch.optim.Optimizer,
    device: torch.device | str,
    loss_fn: LossFn,
    bar: tqdm,
) -> EpochResult:
    """One training pass over ``loader``, counting its batches on ``bar``."""
    model.train()
    return _run(model, _counted(loader, bar), torch.device(device), loss_fn, optimizer)


def _length(loader: Iterable) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:  # streamed data: a DataLoader over an IterableDataset has no length
        return None


def _batch_bar(loader: Iterable, desc: str, progress: bool) -> tqdm:
    # The bar only counts batches; it must not wrap the loader: tqdm.auto's bar calls iter() on
    # what it wraps as soon as it is created (tqdm issue #1598), which would start the
    # DataLoader twice per epoch: a different shuffle than a plain loop, and, with worker
    # processes, a second set of workers (tqdm issue #1467).
    # In a notebook, progress_bar ends as a line of text, which a saved notebook keeps.
    return progress_bar(
        total=_length(loader), desc=desc, leave=False, disable=not progress, unit="batch"
    )


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
    bar = progress_bar(range(epochs), desc="epochs", disable=not progress, unit="epoch")
    # One batch bar for the whole run, reset every epoch: a notebook bar is a widget that costs
    # milliseconds to create, a lot next to an epoch that takes a few (small data on a GPU).
    with _batch_bar(train_loader, f"epoch 1/{epochs}", progress) as batches:
        for epoch in bar:
            if on_epoch_start is not None:
                on_epoch_start(epoch)
            if epoch > 0:
                batches.reset(total=_length(train_loader))
                batches.set_description(f"epoch {epoch + 1}/{epochs}", refresh=False)
            train = _train_pass(model, train_loader, optimizer, device, loss_fn, batches)
            test = (
                evaluate(model, test_loader, device, loss_fn=loss_fn)
                if test_loader is not None  # not truthiness: a streamed loader has no len()
                else None
            )
            history.append(epoch + 1, train, test)
            test_acc = f"{test.accuracy:.3f}" if test else "-"
            bar.set_postfix_str(  # a string: tqdm would write keyword postfixes as name=value
                f"loss={train.loss:.3f}, test_acc={test_acc}, "
                f"{train.samples_per_sec:,.0f} samples/s"
            )
    return history
