"""Lesson 06b, sections 3 and 4: ``no_sync`` and communication hooks, with real gloo processes.

The lesson's own ``counting_allreduce_hook`` and ``accumulate_gradients``, and the solutions of
its exercises 2 (``accumulate_weighted``) and 3 (``bf16_hook``), read from its notebook, run on
2 and 3 ranks and are checked against one process computing the whole batch, or against
``bf16_compress_hook``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_helpers.devices import full_float32
from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["counting_allreduce_hook", "accumulate_gradients", "accumulate_weighted", "bf16_hook"]
LESSON = load_lesson_code(
    "06b", NAMES, lesson_imports("06b", ROOT / "notebooks"), folder=ROOT / "notebooks"
)
# Section 4's worker and its renamed hooks, with the head's parameters made small (the lesson's
# names, so its code reads them unchanged): 10 kB buckets, several of them.
SMALL = {"WIDTH": 64, "DEPTH": 2, "BATCH_SIZE": 4, "SEED": 0, "IN_FEATURES": 16, "CLASSES": 5}
SECTION_4 = load_lesson_code(
    "06b",
    ["make_model", "make_batch", "U_BF16", "bf16_compress", "bf16_counting", "bf16_worker"],
    {
        **lesson_imports("06b", ROOT / "notebooks"),
        **SMALL,
        "BUCKET_CAP_MB": 0.01,
        "counting_allreduce_hook": LESSON.counting_allreduce_hook,
    },
    folder=ROOT / "notebooks",
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
    micro = list(zip(x[mine].chunk(K), y[mine].chunk(K), strict=True))
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


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
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


def test_no_micro_batches_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        LESSON.accumulate_gradients(small_model(), [], use_no_sync=False)


def test_without_ddp_accumulation_equals_the_large_batch() -> None:
    x, y = global_batch(1)
    model = small_model()
    micro = list(zip(x.chunk(K), y.chunk(K), strict=True))
    LESSON.accumulate_gradients(model, micro, use_no_sync=False)
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


# --- the exercises' solutions ------------------------------------------------------------------

SIZES = [5, 1, 3, 3]  # unequal micro-batches, 12 samples per rank


def weighted_worker(env: DistEnv) -> dict:
    full_float32()
    model = DDP(small_model(), bucket_cap_mb=0.01)  # several buckets
    counter = {"all_reduces": 0, "bytes": 0}
    model.register_comm_hook(counter, LESSON.counting_allreduce_hook)
    x, y = global_batch(env.world_size)
    mine = slice(env.rank * K * PER_MICRO, (env.rank + 1) * K * PER_MICRO)
    for _ in range(2):  # the large batch, the reference; DDP settles its buckets after the first
        model.zero_grad(set_to_none=True)
        counter["all_reduces"] = 0
        F.cross_entropy(model(x[mine]), y[mine]).backward()
    large = [p.grad.clone() for p in model.parameters()]
    buckets = counter["all_reduces"]
    model.zero_grad(set_to_none=True)
    counter["all_reduces"] = 0
    micro = list(zip(x[mine].split(SIZES), y[mine].split(SIZES), strict=True))
    LESSON.accumulate_weighted(model, micro)
    return {
        "large": large,
        "weighted": [p.grad.clone() for p in model.parameters()],
        "buckets": buckets,
        "all_reduces": counter["all_reduces"],
    }


def test_exercise_2_solution_equals_the_large_batch_over_unequal_micro_batches() -> None:
    assert sum(SIZES) == K * PER_MICRO
    for r in launch(weighted_worker, 2, device="cpu", echo=False, timeout=60):
        assert r["buckets"] >= 2, "the test needs several buckets"
        assert r["all_reduces"] == r["buckets"], "one all-reduce per bucket, after the last"
        for g, ref in zip(r["weighted"], r["large"], strict=True):
            torch.testing.assert_close(g, ref)


def hooks_worker(env: DistEnv, cuda_build: bool = True) -> dict:
    full_float32()
    if not cuda_build:
        torch.version.cuda = None  # this rank's torch now reads as a macOS or CPU-only wheel
    x, y = global_batch(env.world_size)
    grads = {}
    for name, hook in {
        "float32": default_hooks.allreduce_hook,
        "bf16_compress": SECTION_4.bf16_compress,  # exercise 3's reference: the renamed hook
        "bf16_hook": LESSON.bf16_hook,
    }.items():
        model = DDP(small_model())
        model.register_comm_hook(None, hook)
        F.cross_entropy(
            model(x[env.rank :: env.world_size]), y[env.rank :: env.world_size]
        ).backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    return grads


# 3 ranks in make test-long: each launch costs about 10 s on a 2-core machine
@pytest.mark.parametrize(
    ("world_size", "cuda_build"),
    [(2, True), pytest.param(3, True, marks=pytest.mark.slow), (2, False)],
)
def test_exercise_3_solution_is_bf16_compress_hook_bit_for_bit(
    world_size: int, cuda_build: bool
) -> None:
    results = launch(hooks_worker, world_size, cuda_build, device="cpu", echo=False, timeout=60)
    for g in results:
        assert torch.equal(g["bf16_hook"], g["bf16_compress"])
        assert g["bf16_hook"].dtype == torch.float32
        assert not torch.equal(g["bf16_hook"], g["float32"]), "bf16 rounds: not float32's sums"
        torch.testing.assert_close(g["bf16_hook"], g["float32"], rtol=0.05, atol=1e-3)


# --- section 4 where DDP refuses the bf16 hooks' names ------------------------------------------
# DDP._check_comm_hook refuses hooks named bf16_compress_hook or bf16_compress_wrapper_hook unless
# torch.version.cuda (or hip) is set and NCCL >= 2.10: a check of how torch was built, whatever
# the backend. macOS and Linux CPU-only wheels fail it; setting torch.version.cuda to None in a
# rank makes this (CUDA) build read as one of them.


def bf16_section_worker(env: DistEnv, cuda_build: bool) -> dict:
    if not cuda_build:
        torch.version.cuda = None
    return SECTION_4.bf16_worker(env)


def real_hooks_allowed() -> bool:
    return (
        (torch.version.cuda is not None or torch.version.hip is not None)
        and dist.is_nccl_available()
        and torch.cuda.nccl.version() >= (2, 10)
    )


@pytest.mark.parametrize("cuda_build", [False, True])
def test_section_4_runs_where_ddp_refuses_the_bf16_hook_names(cuda_build: bool) -> None:
    if cuda_build and not real_hooks_allowed():
        pytest.skip("this torch refuses the bf16 hooks' names: the real hooks cannot be compared")
    for r in launch(bf16_section_worker, 2, cuda_build, device="cpu", echo=False, timeout=60):
        refused = [] if cuda_build else ["bf16_compress_hook", "bf16_compress_wrapper_hook"]
        assert r["refused"] == refused
        # with the real hooks registered, the renamed one gives their gradients bit for bit
        assert r["renamed"] and r["same"]
        float32, _, bf16 = r["sent"].values()
        assert 2 * bf16 == float32, "the renamed wrapper sends 2 bytes per gradient"
        assert r["worst"] <= 1, "the bf16 gradients within the lesson's bound"
