"""Lesson 06, section 4: gradient accumulation with ``no_sync``, with real processes over gloo.

The lesson's own ``counting_allreduce_hook``, ``split_micro_batches`` and
``accumulate_gradients``, read from its notebook, run on 2 and 3 ranks and are checked against
one process computing the whole batch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_helpers.devices import full_float32
from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import load_lesson_code

NAMES = ["counting_allreduce_hook", "split_micro_batches", "accumulate_gradients"]
LESSON = load_lesson_code(
    "06", NAMES, {"contextlib": contextlib, "dist": dist, "F": F, "nn": nn, "torch": torch}
)
K, PER_MICRO, FEATURES = 3, 4, 16


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)
    )


def global_batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = world_size * K * PER_MICRO
    return torch.randn(n, FEATURES, generator=g), torch.randint(0, 5, (n,), generator=g)


def accumulation_worker(env: DistEnv) -> dict:
    full_float32()  # GPUs: no TF32, the comparison is with a float32 CPU computation
    ids = [env.device.index] if env.device.type == "cuda" else None
    # 10 kB buckets: several of them
    model = DDP(small_model().to(env.device), device_ids=ids, bucket_cap_mb=0.01)
    counter = {"all_reduces": 0, "bytes": 0}
    model.register_comm_hook(counter, LESSON.counting_allreduce_hook)
    x, y = global_batch(env.world_size)
    per_rank = K * PER_MICRO
    mine = slice(env.rank * per_rank, (env.rank + 1) * per_rank)
    micro = LESSON.split_micro_batches(x[mine], y[mine], K)
    model.zero_grad(set_to_none=True)
    # a first step: DDP then settles its buckets
    F.cross_entropy(model(x[mine].to(env.device)), y[mine].to(env.device)).backward()
    out = {}
    for name, options in {
        "no_sync": {},
        "every": {"use_no_sync": False},
        "unscaled": {"scale": False},
    }.items():
        model.zero_grad(set_to_none=True)
        counter["all_reduces"] = 0
        LESSON.accumulate_gradients(model, micro, **options)
        out[name] = ([p.grad.cpu() for p in model.parameters()], counter["all_reduces"])
    return out


def check_against_one_process(results: list[dict], world_size: int) -> None:
    model = small_model()
    x, y = global_batch(world_size)
    F.cross_entropy(model(x), y).backward()
    reference = [p.grad for p in model.parameters()]
    buckets = results[0]["no_sync"][1]
    assert buckets >= 2, "the test needs several buckets"
    for rank, r in enumerate(results):
        for name in ("no_sync", "every"):
            for g, ref in zip(r[name][0], reference, strict=True):
                torch.testing.assert_close(g, ref, msg=f"rank {rank}, {name}")
        assert r["no_sync"][1] == buckets, "with no_sync: one all-reduce per bucket"
        assert r["every"][1] == K * buckets, "without no_sync: one per bucket per micro-batch"
        for g, ref in zip(r["unscaled"][0], reference, strict=True):
            torch.testing.assert_close(g, K * ref, msg="without 1/K the gradient is K times larger")


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_sync_accumulation_equals_the_large_batch(world_size: int) -> None:
    results = launch(accumulation_worker, world_size, device="cpu", echo=False, timeout=60)
    check_against_one_process(results, world_size)


@pytest.mark.gpu
def test_no_sync_accumulation_on_gpus() -> None:
    """One GPU: 2 ranks share it over gloo; two or more: one per GPU over NCCL (the hook's
    future holds a list there too)."""
    world_size = max(2, torch.cuda.device_count())
    results = launch(
        accumulation_worker, world_size, device="cuda", share_gpus=True, echo=False, timeout=120
    )
    check_against_one_process(results, world_size)


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_accumulation_steps_must_be_a_whole_number_of_at_least_one(steps: object) -> None:
    x, y = torch.randn(8, FEATURES), torch.zeros(8, dtype=torch.long)
    with pytest.raises(ValueError, match="whole number >= 1"):
        LESSON.split_micro_batches(x, y, steps)


def test_a_batch_that_does_not_split_evenly_is_refused() -> None:
    x, y = torch.randn(10, FEATURES), torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of accum_steps"):
        LESSON.split_micro_batches(x, y, 4)
    assert [len(m[0]) for m in LESSON.split_micro_batches(x, y, 5)] == [2] * 5


def test_no_micro_batches_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        LESSON.accumulate_gradients(small_model(), [], use_no_sync=False)


def test_without_ddp_accumulation_equals_the_large_batch() -> None:
    x, y = global_batch(1)
    model = small_model()
    LESSON.accumulate_gradients(model, LESSON.split_micro_batches(x, y, K), use_no_sync=False)
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    for g, p in zip(accumulated, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)


def test_the_hook_keeps_the_annotations_ddp_checks() -> None:
    # lesson code is compiled as in the notebook: real annotations, not strings
    hints = LESSON.counting_allreduce_hook.__annotations__
    assert hints["bucket"] is dist.GradBucket
    assert hints["return"] == torch.futures.Future[torch.Tensor]
