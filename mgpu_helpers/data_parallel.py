"""Data parallelism from scratch, the way ``nn.DataParallel`` does it (lesson 03).

One step on a list of devices: split the batch (``torch.chunk``, as DataParallel's scatter does),
copy the model to each device, run forward and loss per shard, backward on each replica, bring
the gradients back to the model and average them, then step the optimizer once. The replicas are
thrown away and copied again next step, which is exactly what DataParallel does every forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "COMBINE_MODES",
    "combine_gradients",
    "data_parallel_step",
    "replicate",
    "scatter_batch",
    "shard_sizes",
]

COMBINE_MODES = ("weighted", "mean", "sum")


def shard_sizes(batch_size: int, n_devices: int) -> list[int]:
    """Per-device batch sizes when ``batch_size`` samples are split like ``torch.chunk``.

    Each shard gets ``ceil(batch_size / n_devices)`` samples and the last one the rest, so a
    batch can use fewer devices than given: 6 samples on 4 devices give [2, 2, 2].
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"n_devices must be a whole number >= 1, got {n_devices!r}")
    chunk = -(-batch_size // n_devices)  # ceiling division
    sizes = [chunk] * (batch_size // chunk)
    if batch_size % chunk:
        sizes.append(batch_size % chunk)
    return sizes


def scatter_batch(
    inputs: Tensor, targets: Tensor, devices: Sequence[torch.device | str]
) -> list[tuple[Tensor, Tensor, torch.device]]:
    """Split a batch along dim 0 and move each shard (inputs and targets) to its device."""
    if len(devices) < 1:
        raise ValueError("need at least one device to scatter to")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs have {inputs.shape[0]} samples but targets {targets.shape[0]}")
    n = len(devices)
    return [
        (x.to(dev), y.to(dev), torch.device(dev))
        for x, y, dev in zip(inputs.chunk(n), targets.chunk(n), devices, strict=False)
    ]


def replicate(model: nn.Module, devices: Sequence[torch.device | str]) -> list[nn.Module]:
    """An independent copy of ``model`` on each device (DataParallel does this every forward)."""
    replicas = []
    for dev in devices:
        replica = copy.deepcopy(model).to(dev)
        for p in replica.parameters():
            p.grad = None  # deepcopy would carry the model's old gradients along
        replicas.append(replica)
    return replicas


def combine_gradients(
    model: nn.Module, replicas: Sequence[nn.Module], weights: Sequence[float]
) -> None:
    """Set each parameter's ``.grad`` to the weighted sum of the replicas' gradients.

    The sum is taken on the model's own device (the "output device"); this is the all-reduce
    of data parallelism, done by hand.
    """
    if len(replicas) != len(weights):
        raise ValueError(f"{len(replicas)} replicas but {len(weights)} weights")
    own = list(model.parameters())
    for i, p in enumerate(own):
        total = torch.zeros_like(p)
        for replica, w in zip(replicas, weights, strict=True):
            g = list(replica.parameters())[i].grad
            if g is not None:
                total += w * g.to(p.device)
        p.grad = total


def data_parallel_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Tensor,
    targets: Tensor,
    devices: Sequence[torch.device | str],
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    combine: str = "weighted",
) -> Tensor:
    """One data-parallel training step by hand; returns the batch's mean loss.

    ``combine`` says how the replicas' gradients (each the gradient of its shard's mean loss)
    are brought together:

    - ``"weighted"``: weight each by its share of the batch. Equals the single-device step on
      the whole batch, even when the shards are uneven.
    - ``"mean"``: a plain average. Right only when every shard has the same size.
    - ``"sum"``: a plain sum. Wrong: the step is ``len(shards)`` times too large.
    """
    if combine not in COMBINE_MODES:
        raise ValueError(
            f"combine={combine!r} is unknown; choose one of {', '.join(COMBINE_MODES)}"
        )
    shards = scatter_batch(inputs, targets, devices)
    replicas = replicate(model, [dev for _, _, dev in shards])
    total = inputs.shape[0]
    losses = []
    for replica, (x, y, _) in zip(replicas, shards, strict=True):
        loss = loss_fn(replica(x), y)  # mean over this shard only
        loss.backward()  # gradients land in this replica's parameters, on its device
        losses.append(loss.detach().to(inputs.device) * (x.shape[0] / total))
    sizes = [x.shape[0] for x, _, _ in shards]
    if combine == "weighted":
        weights = [n / total for n in sizes]
    elif combine == "mean":
        weights = [1 / len(sizes)] * len(sizes)
    else:
        weights = [1.0] * len(sizes)
    combine_gradients(model, replicas, weights)
    optimizer.step()
    return torch.stack(losses).sum()
