"""Evaluation of a data-parallel run that counts every sample once (lesson 04; reused by 06-08).

Lesson 04 writes its DDP worker in the notebook (sampler, ``set_epoch``, the wrap, the reduced
metrics, the rank-0 checkpoint). What stays here is the one piece every later distributed
lesson needs again and that is easy to get subtly wrong: evaluating on every rank through a
``DistributedSampler``, whose padding repeats up to ``world_size - 1`` samples, without counting
those repeats. :func:`real_samples` says how many of a rank's samples are real;
:func:`evaluate_distributed` adds up the real ones only and all-reduces the sums once.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from .timing import synchronize
from .train import EpochResult

__all__ = ["evaluate_distributed", "real_samples"]


def real_samples(sampler: DistributedSampler) -> int:
    """How many of this rank's samples are real; the rest repeat other samples as padding.

    With ``drop_last=False`` the sampler pads its list of indices to a multiple of the world
    size by repeating its first indices at the end, and rank ``r`` reads the positions ``r``,
    ``r + W``, ``r + 2W``, ... of that list: its real samples are its first
    ``len(range(r, n, W))``, the padding comes last.
    """
    if sampler.drop_last:
        return len(sampler)  # nothing repeated: the tail is dropped instead
    return len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))


@torch.no_grad()
def evaluate_distributed(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
) -> EpochResult:
    """Loss and accuracy on the whole data set behind ``loader``, every sample counted once.

    ``loader`` reads through a ``DistributedSampler`` with ``drop_last=False``. Every rank runs
    the model on all its batches (padding included, so the ranks take the same number of steps
    and collectives inside the forward stay in step) but adds up the loss and the correct
    answers of its real samples only; one all-reduce over ``group`` (default: every rank) then
    adds the sums and counts of all ranks. The result equals one process's evaluation of the
    whole data set, for any data set size and world size. Every rank must call it (it is a
    collective); every rank gets the same answer, and the slowest rank's time.
    """
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler):
        raise ValueError(
            "evaluate_distributed needs a loader with a DistributedSampler; build it with "
            "DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset, shuffle=False))"
        )
    if sampler.drop_last:
        raise ValueError(
            "a DistributedSampler with drop_last=True leaves samples out; evaluate with "
            "drop_last=False (the padding it adds instead is left out of the sums here)"
        )
    device = torch.device(device)
    real = real_samples(sampler)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, samples
    seen = 0
    synchronize(device)
    start = time.perf_counter()
    for inputs, targets in loader:
        outputs = model(inputs.to(device, non_blocking=True))
        keep = max(0, min(len(targets), real - seen))  # this batch's real samples come first
        seen += len(targets)
        outputs, targets = outputs[:keep], targets[:keep].to(outputs.device)
        sums[0] += F.cross_entropy(outputs, targets, reduction="sum")
        sums[1] += (outputs.argmax(dim=1) == targets).sum()
        sums[2] += keep
    synchronize(device)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    loss, correct, total = sums.tolist()
    if total == 0:
        raise ValueError("the data set to evaluate is empty")
    return EpochResult(loss / total, correct / total, int(total), seconds.item())
