"""DistributedDataParallel building blocks and ready-made workers (lesson 04).

Each function is named after the step it performs, so a notebook that calls it still shows the
step: :func:`distributed_loader` (a ``DistributedSampler``), :func:`wrap_ddp` (the DDP wrap),
:func:`reduce_epoch` (metrics all-reduced before they are printed), :func:`save_checkpoint` /
:func:`load_checkpoint` (rank 0 writes, everyone waits, everyone reads). The workers at the end
put them together and are what the launcher runs in the lesson's proofs and measurements.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .config import LessonConfig
from .data import build_datasets, loader_settings
from .devices import full_float32
from .launch import DistEnv
from .models import build_model, small_cnn
from .train import EpochResult, History, evaluate, seed_everything, train_epoch

__all__ = [
    "ddp_step_worker",
    "distributed_loader",
    "load_checkpoint",
    "per_rank_batch_size",
    "reduce_epoch",
    "reference_steps",
    "sampler_indices_worker",
    "save_checkpoint",
    "throughput_worker",
    "train_worker",
    "wrap_ddp",
]


def per_rank_batch_size(global_batch: int, world_size: int) -> int:
    """The batch each rank loads so that all ranks together make ``global_batch``."""
    if global_batch < 1 or world_size < 1:
        raise ValueError(f"need batch >= 1 and world_size >= 1, got {global_batch}, {world_size}")
    if global_batch % world_size:
        nearest = global_batch - global_batch % world_size or world_size
        raise ValueError(
            f"batch_size={global_batch} does not split evenly over {world_size} ranks; "
            f"use a multiple of {world_size}, e.g. {nearest}"
        )
    return global_batch // world_size


def distributed_loader(
    dataset: Dataset,
    batch_size: int,
    env: DistEnv,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> tuple[DataLoader, DistributedSampler]:
    """A loader that gives this rank its own share of ``dataset`` each epoch.

    Returns the sampler too: call ``sampler.set_epoch(epoch)`` before every epoch, or every
    epoch repeats the first epoch's order.
    """
    sampler = DistributedSampler(
        dataset,
        num_replicas=env.world_size,
        rank=env.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, **loader_settings(env.device, dataset)
    )
    return loader, sampler


def wrap_ddp(model: nn.Module, env: DistEnv) -> DDP:
    """Move ``model`` to this rank's device and wrap it in DistributedDataParallel.

    On a GPU DDP gets ``device_ids=[that GPU]``; on the CPU (and for a model that spans several
    devices) it gets none.
    """
    model = model.to(env.device)
    if env.device.type == "cuda":
        return DDP(model, device_ids=[env.device.index])
    return DDP(model)


def reduce_epoch(result: EpochResult, device: torch.device | str) -> EpochResult:
    """Combine one epoch's metrics over all ranks: sample-weighted means, slowest rank's time.

    Every rank must call it (it is a collective); every rank gets the same answer.
    """
    sums = torch.tensor(
        [result.loss * result.samples, result.accuracy * result.samples, float(result.samples)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    seconds = torch.tensor([result.seconds], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    total = sums[2].item()
    return EpochResult(sums[0].item() / total, sums[1].item() / total, int(total), seconds.item())


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
    epoch: int = 0,
) -> None:
    """Rank 0 writes the unwrapped model's and the optimizer's state; then all ranks wait.

    The barrier is outside the ``if``: a collective inside a rank-0-only branch would leave
    the other ranks waiting for it forever.
    """
    plain = model.module if isinstance(model, DDP) else model
    if env.is_main:
        torch.save(
            {"model": plain.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
            path,
        )
    dist.barrier()  # nobody reads the file before rank 0 has finished writing it


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device | str,
) -> int:
    """Load a checkpoint onto ``device`` (``map_location``); returns the saved epoch."""
    state = torch.load(path, map_location=torch.device(device), weights_only=True)
    plain = model.module if isinstance(model, DDP) else model
    plain.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return int(state["epoch"])


def train_worker(env: DistEnv, cfg: LessonConfig) -> dict:
    """Train ``cfg``'s model with DDP on every rank; rank 0's history is the global one.

    The global batch ``cfg.batch_size`` is split evenly over the ranks, and the metrics of
    every epoch are all-reduced, so the history reads like a single-device run's.
    """
    seed_everything(cfg.seed)  # same seed on every rank: identical initial weights
    train_set, test_set, info = build_datasets(cfg)
    batch = per_rank_batch_size(cfg.batch_size, env.world_size)
    train_loader, sampler = distributed_loader(train_set, batch, env, seed=cfg.seed)
    test_loader, _ = distributed_loader(test_set, 256, env, shuffle=False)
    model = wrap_ddp(build_model(cfg.model, info), env)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    history = History()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        train = train_epoch(
            model,
            train_loader,
            optimizer,
            env.device,
            progress=cfg.progress and env.is_main,
            desc=f"epoch {epoch + 1}",
        )
        test = evaluate(model, test_loader, env.device)
        train, test = reduce_epoch(train, env.device), reduce_epoch(test, env.device)
        history.append(epoch + 1, train, test)
        if env.is_main:
            print(
                f"epoch {epoch + 1}: loss {train.loss:.4f}, test accuracy {test.accuracy:.3f}, "
                f"{train.samples_per_sec:,.0f} samples/s over {env.world_size} ranks"
            )
    return {"history": history, "rank": env.rank}


def _fixed_batches(steps: int, global_batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, global_batch, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (steps, global_batch), generator=g)
    return x, y


def ddp_step_worker(env: DistEnv, steps: int, per_rank_batch: int, seed: int = 0) -> dict:
    """``steps`` DDP steps, each rank on its own slice of a fixed global batch.

    Returns the final parameters (on the CPU) and this rank's gradients after the first
    backward, for comparison with :func:`reference_steps`. cuDNN's TF32 convolutions (on by
    default on GPUs) are switched off in this process: they round the inputs to 10 mantissa
    bits, which alone would put a GPU run far outside float32 agreement with the CPU reference.
    """
    full_float32()  # this rank's process only; it ends with the run
    torch.manual_seed(seed)
    model = wrap_ddp(small_cnn(), env)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _fixed_batches(steps, per_rank_batch * env.world_size, seed + 1)
    mine = slice(env.rank * per_rank_batch, (env.rank + 1) * per_rank_batch)
    first_grads, first_loss = None, None
    for s in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[s, mine].to(env.device)), y[s, mine].to(env.device))
        loss.backward()  # DDP all-reduces (averages) the gradients during this call
        if s == 0:
            first_loss = loss.item()
            first_grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
        optimizer.step()
    params = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
    return {"params": params, "first_grads": first_grads, "first_loss": first_loss}


def reference_steps(steps: int, global_batch: int, seed: int = 0) -> dict:
    """The same steps in one process on the whole batch: what DDP must reproduce."""
    torch.manual_seed(seed)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _fixed_batches(steps, global_batch, seed + 1)
    first_grads = None
    for s in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x[s]), y[s]).backward()
        if s == 0:
            first_grads = [p.grad.detach().clone() for p in model.parameters()]
        optimizer.step()
    return {
        "params": {k: v.detach() for k, v in model.state_dict().items()},
        "first_grads": first_grads,
    }


def sampler_indices_worker(
    env: DistEnv, n: int, epochs: int, set_epoch: bool = True, shuffle: bool = True
) -> list[list[int]]:
    """The sample indices this rank sees in each epoch (lesson 04's sampler demonstrations)."""
    dataset = torch.utils.data.TensorDataset(torch.arange(n))
    loader, sampler = distributed_loader(dataset, 4, env, shuffle=shuffle)
    seen = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        seen.append([int(i) for (batch,) in loader for i in batch])
    return seen


def throughput_worker(env: DistEnv, cfg: LessonConfig, steps: int, warmup: int = 2) -> float:
    """Samples per second of DDP training over all ranks, timed on the slowest rank."""
    seed_everything(cfg.seed)
    cfg = replace(cfg, dataset="synthetic")
    train_set, _, info = build_datasets(cfg)
    batch = per_rank_batch_size(cfg.batch_size, env.world_size)
    loader, sampler = distributed_loader(train_set, batch, env, drop_last=True)
    model = wrap_ddp(build_model(cfg.model, info), env)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    batches = [b for _, b in zip(range(steps + warmup), _forever(loader, sampler), strict=False)]
    for s, (x, y) in enumerate(batches):
        if s == warmup:
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            dist.barrier()
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x.to(env.device)), y.to(env.device)).backward()
        optimizer.step()
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=env.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return steps * batch * env.world_size / elapsed.item()


def _forever(loader: DataLoader, sampler: DistributedSampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
