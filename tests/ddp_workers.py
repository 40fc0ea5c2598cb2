"""The tests' own DDP workers for lesson 04's mechanisms (the lesson writes its own in its cells).

The step-by-step proofs (part 04a, sections 3-5) and the throughput measurement (part 04b,
section 5). Part 04b's evaluation, training worker and comparison are not copied here:
:data:`LESSON_04` holds the lesson's own, read from the notebook with ``load_lesson_code``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mgpu_helpers.config import LessonConfig
from mgpu_helpers.data import build_datasets, make_loader
from mgpu_helpers.devices import full_float32
from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code
from mgpu_helpers.models import build_model, resnet_cifar, small_cnn
from mgpu_helpers.timing import synchronize
from mgpu_helpers.train import seed_everything

# Lesson 04b's evaluation, worker and comparison, as its cells write them, with the lesson's own
# imports (train_ddp reads the lesson's evaluate_distributed, loaded with it).
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LESSON_04 = load_lesson_code(
    "04b",
    [
        "real_samples",
        "evaluate_distributed",
        "train_ddp",
        "train_ddp_exactly",
        "comparison_config",
        "one_device_run",
        "CHECK_STEPS",
        "EXACT",
    ],
    {**lesson_imports("04b", NOTEBOOKS), "on_gpu": False},  # EXACT: the CPU's tolerance
    folder=NOTEBOOKS,
)


def wrap(model: nn.Module, env: DistEnv, group: dist.ProcessGroup | None = None) -> DDP:
    """The lesson's DDP wrap: on this rank's device, ``device_ids`` on a GPU only."""
    ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(model.to(env.device), device_ids=ids, process_group=group)


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in model.modules())


# --- sections 4 and 5 --------------------------------------------------------------------------
def fixed_batches(steps: int, global_batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, global_batch, 1, 8, 8, generator=g)
    return x, torch.randint(0, 10, (steps, global_batch), generator=g)


def step_model(name: str = "cnn") -> nn.Module:
    """The small CNN, or the course's ResNet (BatchNorm) narrowed to width 8 for 8x8 inputs."""
    if name == "cnn":
        return small_cnn()
    if name == "resnet":
        return resnet_cifar(in_channels=1, width=8)
    raise ValueError(f"model={name!r} is unknown here; choose 'cnn' or 'resnet'")


def _first_batch_norm(model: nn.Module) -> _BatchNorm | None:
    return next((m for m in model.modules() if isinstance(m, _BatchNorm)), None)


def ddp_step_worker(
    env: DistEnv,
    steps: int,
    per_rank: int,
    seed: int = 0,
    model: str = "cnn",
    sync_bn: bool = False,
) -> dict[str, Any]:
    """``steps`` DDP steps, each rank on its own slice of fixed global batches (TF32 off)."""
    full_float32()
    torch.manual_seed(seed + env.rank)  # a different start on every rank, on purpose
    net = step_model(model)
    before_wrap = next(net.parameters()).detach().clone()
    if sync_bn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    ddp = wrap(net, env)  # broadcasts rank 0's parameters and buffers
    after_wrap = next(net.parameters()).detach().cpu().clone()
    bn = _first_batch_norm(net)
    entering: list[torch.Tensor] = []
    leaving: list[torch.Tensor] = []
    if bn is not None:  # inside DDP's forward, after its buffer broadcast
        net.register_forward_pre_hook(lambda m, a: entering.append(bn.running_mean.cpu().clone()))
        net.register_forward_hook(lambda m, a, o: leaving.append(bn.running_mean.cpu().clone()))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    x, y = fixed_batches(steps, per_rank * env.world_size, seed + 1)
    mine = slice(env.rank * per_rank, (env.rank + 1) * per_rank)
    first_grads, first_loss = None, None
    for s in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x[s, mine].to(env.device)), y[s, mine].to(env.device))
        loss.backward()
        if s == 0:
            first_loss = loss.item()
            first_grads = [p.grad.detach().cpu().clone() for p in ddp.parameters()]
        optimizer.step()
    return {
        "params": {k: v.detach().cpu() for k, v in net.state_dict().items()},
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
    x, y = fixed_batches(steps, global_batch, seed + 1)
    first_grads, leaving = None, []
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


# --- section 3 ---------------------------------------------------------------------------------
def sampler_indices_worker(
    env: DistEnv, n: int, epochs: int, set_epoch: bool = True
) -> list[list[int]]:
    """The sample indices this rank reads in each epoch through a DistributedSampler."""
    dataset = TensorDataset(torch.arange(n))
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    seen = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        seen.append([int(i) for (batch,) in loader for i in batch])
    return seen


# --- section 8 ---------------------------------------------------------------------------------
def throughput_worker(
    env: DistEnv,
    cfg: LessonConfig,
    steps: int,
    group: dist.ProcessGroup | None = None,
    warmup: int = 2,
) -> float:
    """Samples/s of DDP training over the ranks of ``group`` (default: all), on the slowest."""
    if group is not None:
        env = replace(env, rank=dist.get_rank(group), world_size=dist.get_world_size(group))
    seed_everything(cfg.seed)
    train_set, _, info = build_datasets(replace(cfg, dataset="synthetic"))
    batch = cfg.batch_size // env.world_size
    sampler = DistributedSampler(train_set, env.world_size, env.rank, drop_last=True)
    loader = make_loader(train_set, batch, env.device, sampler=sampler, drop_last=True)
    model = wrap(build_model(cfg.model, info), env, group)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    batches = list(itertools.islice(itertools.cycle(loader), warmup + steps))
    for step, (x, y) in enumerate(batches):
        if step == warmup:
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
