"""DistributedDataParallel building blocks and ready-made workers (lesson 04).

Each function is named after the step it performs, so a notebook that calls it still shows the
step: :func:`distributed_loader` (a ``DistributedSampler``), :func:`wrap_ddp` (the DDP wrap),
:func:`reduce_epoch` (metrics all-reduced before they are printed), :func:`evaluate_distributed`
(every test sample counted once, whatever the world size), :func:`save_checkpoint` /
:func:`load_checkpoint` (rank 0 writes, everyone waits, everyone reads). The workers at the end
put them together and are what the launcher runs in the lesson's proofs and measurements.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

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
from .models import build_model, resnet_cifar, small_cnn
from .timing import synchronize
from .train import EpochResult, History, seed_everything, train_epoch

__all__ = [
    "ddp_step_worker",
    "distributed_loader",
    "evaluate_distributed",
    "has_batch_norm",
    "load_checkpoint",
    "per_rank_batch_size",
    "real_samples",
    "reduce_epoch",
    "reference_steps",
    "sampler_indices_worker",
    "save_checkpoint",
    "step_model",
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


def wrap_ddp(model: nn.Module, env: DistEnv, process_group: dist.ProcessGroup | None = None) -> DDP:
    """Move ``model`` to this rank's device and wrap it in DistributedDataParallel.

    On a GPU DDP gets ``device_ids=[that GPU]``; on the CPU (and for a model that spans several
    devices) it gets none. ``process_group``: the ranks that train together (default: all).
    """
    model = model.to(env.device)
    if env.device.type == "cuda":
        return DDP(model, device_ids=[env.device.index], process_group=process_group)
    return DDP(model, process_group=process_group)


def has_batch_norm(model: nn.Module) -> bool:
    """True when ``model`` normalises with batch statistics (lesson 04, section 5.1)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def reduce_epoch(result: EpochResult, device: torch.device | str) -> EpochResult:
    """Combine one epoch's metrics over all ranks: sample-weighted means, slowest rank's time.

    Every rank must call it (it is a collective); every rank gets the same answer. It counts
    every sample a rank processed, including those a ``DistributedSampler`` repeats to pad the
    data (right for training, where they were trained on; use :func:`evaluate_distributed` to
    evaluate).
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
def evaluate_distributed(model: nn.Module, loader: DataLoader, env: DistEnv) -> EpochResult:
    """Loss and accuracy on the whole data set behind ``loader``, every sample counted once.

    ``loader`` reads through a ``DistributedSampler`` with ``drop_last=False``. Every rank runs
    the model on all its batches (padding included, so the ranks take the same number of steps
    and collectives inside the forward stay in step) but adds up the loss and the correct
    answers of its real samples only; one all-reduce then adds the sums and counts of all
    ranks. The result equals one process's evaluation of the whole data set, for any data set
    size and world size. Every rank must call it (it is a collective).
    """
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler):
        raise ValueError(
            "evaluate_distributed needs a loader with a DistributedSampler; build it with "
            "distributed_loader(dataset, batch_size, env, shuffle=False)"
        )
    if sampler.drop_last:
        raise ValueError(
            "a DistributedSampler with drop_last=True leaves samples out; evaluate with "
            "drop_last=False (the padding it adds instead is left out of the sums here)"
        )
    real = real_samples(sampler)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=env.device)  # loss, correct, samples
    seen = 0
    synchronize(env.device)
    start = time.perf_counter()
    for inputs, targets in loader:
        outputs = model(inputs.to(env.device, non_blocking=True))
        keep = max(0, min(len(targets), real - seen))  # this batch's real samples come first
        seen += len(targets)
        outputs, targets = outputs[:keep], targets[:keep].to(outputs.device)
        sums[0] += F.cross_entropy(outputs, targets, reduction="sum")
        sums[1] += (outputs.argmax(dim=1) == targets).sum()
        sums[2] += keep
    synchronize(env.device)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=env.device)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    loss, correct, total = sums.tolist()
    if total == 0:
        raise ValueError("the data set to evaluate is empty")
    return EpochResult(loss / total, correct / total, int(total), seconds.item())


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
    epoch: int = 0,
) -> None:
    """Rank 0 writes the unwrapped model's and the optimizer's state; then all ranks wait.

    The barrier is outside the ``if``: a collective inside a rank-0-only branch would leave
    the ranks waiting for each other until the process group's timeout, then fail.
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


def train_worker(env: DistEnv, cfg: LessonConfig, sync_bn: bool = False) -> dict:
    """Train ``cfg``'s model with DDP on every rank; rank 0's history is the global one.

    The global batch ``cfg.batch_size`` is split evenly over the ranks, the training metrics of
    every epoch are all-reduced and the whole test set is evaluated once over all ranks, so the
    history reads like a single-device run's. ``sync_bn=True`` turns every BatchNorm into a
    SyncBatchNorm, which normalises with the statistics of the whole global batch (it needs
    GPU ranks in current PyTorch; lesson 04, section 5.2).
    """
    seed_everything(cfg.seed)  # rank 0's initial weights; DDP's wrap copies them to every rank
    train_set, test_set, info = build_datasets(cfg)
    batch = per_rank_batch_size(cfg.batch_size, env.world_size)
    train_loader, sampler = distributed_loader(train_set, batch, env, seed=cfg.seed)
    test_loader, _ = distributed_loader(test_set, 256, env, shuffle=False)
    model = build_model(cfg.model, info)
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # before the wrap
    model = wrap_ddp(model, env)
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
        train = reduce_epoch(train, env.device)
        test = evaluate_distributed(model, test_loader, env)  # each test sample counted once
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


def step_model(name: str = "cnn") -> nn.Sequential:
    """The model of lesson 04's step-by-step proofs, for 1x8x8 inputs.

    "cnn": the small CNN (no layer looks at other samples). "resnet": the course's ResNet,
    narrowed to width 8, whose BatchNorm layers normalise with the statistics of the batch.
    """
    if name == "cnn":
        return small_cnn()
    if name == "resnet":
        return resnet_cifar(in_channels=1, width=8)
    raise ValueError(f"model={name!r} is unknown here; choose 'cnn' or 'resnet'")


def _first_batch_norm(model: nn.Module) -> nn.Module | None:
    norms = (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    return next(norms, None)


def ddp_step_worker(
    env: DistEnv,
    steps: int,
    per_rank_batch: int,
    seed: int = 0,
    model: str = "cnn",
    sync_bn: bool = False,
) -> dict[str, Any]:
    """``steps`` DDP steps, each rank on its own slice of a fixed global batch.

    Every rank seeds with ``seed + rank``, so the ranks build *different* initial weights: the
    replicas start equal only because DDP broadcasts rank 0's parameters and buffers when it
    wraps the model. Returns this rank's first parameter before and after the wrap, its loss
    and gradients after the first backward, its final parameters and buffers (all on the CPU),
    and, for a model with BatchNorm, the first BatchNorm's running mean as the model's forward
    starts and ends in each step. ``sync_bn=True`` converts BatchNorm to SyncBatchNorm first.
    cuDNN's TF32 convolutions (on by default on GPUs) are switched off in this process: they
    round the inputs to 10 mantissa bits, which alone would put a GPU run far outside float32
    agreement with the CPU reference.
    """
    full_float32()  # this rank's process only; it ends with the run
    torch.manual_seed(seed + env.rank)  # a different start on every rank, on purpose
    net = step_model(model)
    before_wrap = next(net.parameters()).detach().cpu().clone()
    if sync_bn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    ddp = wrap_ddp(net, env)  # broadcasts rank 0's parameters and buffers
    after_wrap = next(ddp.module.parameters()).detach().cpu().clone()
    bn = _first_batch_norm(ddp.module)
    entering: list[torch.Tensor] = []
    leaving: list[torch.Tensor] = []
    if bn is not None:  # the hooks run inside DDP's forward, after its buffer broadcast
        ddp.module.register_forward_pre_hook(
            lambda m, args: entering.append(bn.running_mean.detach().cpu().clone())
        )
        ddp.module.register_forward_hook(
            lambda m, args, out: leaving.append(bn.running_mean.detach().cpu().clone())
        )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    x, y = _fixed_batches(steps, per_rank_batch * env.world_size, seed + 1)
    mine = slice(env.rank * per_rank_batch, (env.rank + 1) * per_rank_batch)
    first_grads, first_loss = None, None
    for s in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x[s, mine].to(env.device)), y[s, mine].to(env.device))
        loss.backward()  # DDP all-reduces (averages) the gradients during this call
        if s == 0:
            first_loss = loss.item()
            first_grads = [p.grad.detach().cpu().clone() for p in ddp.parameters()]
        optimizer.step()
    params = {k: v.detach().cpu() for k, v in ddp.module.state_dict().items()}
    return {
        "params": params,
        "first_grads": first_grads,
        "first_loss": first_loss,
        "before_wrap": before_wrap,
        "after_wrap": after_wrap,
        "bn_entering": entering,
        "bn_leaving": leaving,
    }


def reference_steps(steps: int, global_batch: int, seed: int = 0, model: str = "cnn") -> dict:
    """The same steps in one process on the whole batch: what DDP must reproduce."""
    torch.manual_seed(seed)
    net = step_model(model)
    bn = _first_batch_norm(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = _fixed_batches(steps, global_batch, seed + 1)
    first_grads = None
    leaving = []
    for s in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(net(x[s]), y[s]).backward()
        if bn is not None:
            leaving.append(bn.running_mean.detach().clone())
        if s == 0:
            first_grads = [p.grad.detach().clone() for p in net.parameters()]
        optimizer.step()
    return {
        "params": {k: v.detach() for k, v in net.state_dict().items()},
        "first_grads": first_grads,
        "bn_leaving": leaving,
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


def throughput_worker(
    env: DistEnv,
    cfg: LessonConfig,
    steps: int,
    warmup: int = 2,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Samples per second of DDP training over the ranks of ``group``, timed on the slowest.

    ``group`` (default: every rank) lets some ranks measure while the others wait, so that
    one launch can measure 1 rank and N ranks in turn, with the same processes and the same
    CPU threads per process (lesson 04, section 8). Only members of ``group`` call it.
    """
    if group is not None:  # who am I within the group that trains together
        env = replace(env, rank=dist.get_rank(group), world_size=dist.get_world_size(group))
    seed_everything(cfg.seed)
    cfg = replace(cfg, dataset="synthetic")
    train_set, _, info = build_datasets(cfg)
    batch = per_rank_batch_size(cfg.batch_size, env.world_size)
    loader, sampler = distributed_loader(train_set, batch, env, drop_last=True)
    model = wrap_ddp(build_model(cfg.model, info), env, process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    batches = [b for _, b in zip(range(steps + warmup), _forever(loader, sampler), strict=False)]
    for s, (x, y) in enumerate(batches):
        if s == warmup:
            synchronize(env.device)
            dist.barrier(group=group)
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x.to(env.device)), y.to(env.device)).backward()
        optimizer.step()
    synchronize(env.device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=env.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return steps * batch * env.world_size / elapsed.item()


def _forever(loader: DataLoader, sampler: DistributedSampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
