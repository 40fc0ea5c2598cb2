"""Lesson 06a: each hand-built step gives DDP's gradients, and DDP's own buckets and timeline
are what the lesson says (real processes over gloo).

The steps are the lesson's own code, read from its notebook (``load_lesson_code``), run on a
narrower MLP (WIDTH=64) so that the tests stay fast. The bucket cap used below puts a bucket
boundary inside a layer (between layer 5's bias and its weight) and gives buckets of different
sizes; the MaybeSkip model leaves a layer out of the forward pass on some ranks or on all.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import WorkerError, launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code
from mgpu_helpers.overlap import assert_same_gradients
from mgpu_helpers.placement import place

ROOT = Path(__file__).resolve().parents[1]
NAMES = (
    "WIDTH", "DEPTH", "SEED", "BATCH_SIZE", "BUCKET_CAP_MB",
    "make_model", "make_batch", "device_ids", "MaybeSkip", "DDP_METHODS", "gradients_used_anywhere",
    "allreduce_each", "make_buckets", "allreduce_buckets", "OverlapBuckets", "overlapped",
    "gradients_worker", "gradients_runs", "layouts_worker", "timeline_worker", "phases_alone",
)  # fmt: skip
NAMESPACE = {
    **lesson_imports("06a", folder=ROOT / "notebooks"),
    "IN_FEATURES": 256, "CLASSES": 10,  # the head's `IN_FEATURES, CLASSES = 256, 10`
}  # fmt: skip
lesson = load_lesson_code("06a", NAMES, NAMESPACE, folder=ROOT / "notebooks")
NAMESPACE["WIDTH"] = 64  # small layers: fast steps; the code reads WIDTH when it runs
# the notebook registers each step in DDP_METHODS in the cell that defines it
lesson.DDP_METHODS["step 1"] = lesson.allreduce_each
lesson.DDP_METHODS["step 2"] = lesson.allreduce_buckets
lesson.DDP_METHODS["step 3"] = lesson.overlapped
# bytes, in parameter order (WIDTH=64, DEPTH=3): 65536, 256, 16384, 256, 16384, 256, 2560, 40
CAP_MB = 2700 / 2**20  # closes [b7, w7, b5] (2856 B), then [w5], [b3, w3], [b1, w1]
UNEVEN = [[7, 6, 5], [4], [3, 2], [1, 0]]
# DDP's default (bucket_cap_mb=None) for this model: its first bucket would close at 1 MiB,
# more than all these gradients (about 100 KiB), so one bucket holds them all
DEFAULT_LAYOUT = [[7, 6, 5, 4, 3, 2, 1, 0]]
STEPS = ["ddp", "step 1", "step 2", "step 3"]


def test_the_cap_gives_uneven_buckets_with_a_boundary_inside_a_layer() -> None:
    params = list(lesson.make_model().parameters())
    assert lesson.make_buckets(params, CAP_MB) == UNEVEN
    sizes = {sum(params[i].numel() for i in b) for b in lesson.make_buckets(params, CAP_MB)}
    assert len(sizes) == len(UNEVEN)  # every bucket has its own size


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_step_equals_ddp(world_size: int) -> None:
    """Plain model; a layer skipped on some ranks; a layer skipped on every rank."""
    per_rank = launch(
        lesson.gradients_runs,
        world_size,
        skip_runs(world_size),
        device="cpu",
        echo=False,
        timeout=60,
    )
    plain, some, every = ([mine[k] for mine in per_rank] for k in range(3))
    for results in (plain, some, every):
        for method in ("step 1", "step 2", "step 3"):
            assert_same_gradients(results, method)  # raises if a gradient differs
    assert plain[0]["step 1"]["calls"] == 8  # one all-reduce per parameter tensor
    assert plain[0]["step 2"]["calls"] == plain[0]["step 3"]["calls"] == len(UNEVEN)
    # the extra layer (the last two parameters): used by some ranks -> averaged over all ranks;
    # used by none -> no gradient anywhere, as DDP(find_unused_parameters=True) leaves it
    for rank in range(world_size):
        assert some[rank]["step 3"]["grads"][-1] is not None
        assert every[rank]["ddp"]["grads"][-1] is None
        assert all(every[rank][m]["grads"][-2] is None for m in STEPS)
    assert every[0]["step 1"]["calls"] == 8  # the unused layer's two tensors are skipped
    assert every[0]["step 2"]["calls"] == len(UNEVEN)  # its bucket ([9, 8]) holds nothing used


def skip_runs(world_size: int) -> list[dict]:
    return [
        {"methods": STEPS, "cap_mb": CAP_MB},
        {"methods": STEPS, "cap_mb": CAP_MB, "skip_on": (1,)},
        {"methods": STEPS, "cap_mb": CAP_MB, "skip_on": tuple(range(world_size))},
    ]


@pytest.mark.gpu
def test_every_step_equals_ddp_on_ranks_sharing_a_gpu() -> None:
    """Gloo with CUDA tensors (one GPU, two ranks): the lesson's row for a single GPU."""
    per_rank = launch(lesson.gradients_runs, place(2, "cuda", share_gpus=True), skip_runs(2),
                      echo=False, timeout=120)  # fmt: skip
    for k in range(3):
        for method in ("step 1", "step 2", "step 3"):
            assert_same_gradients([mine[k] for mine in per_rank], method)


@pytest.mark.multigpu
def test_every_step_equals_ddp_over_nccl() -> None:
    """One GPU per rank: NCCL's asynchronous all-reduces on their own stream, waited on."""
    per_rank = launch(lesson.gradients_runs, place(2, "cuda"), skip_runs(2), echo=False,
                      timeout=120)  # fmt: skip
    for k in range(3):
        for method in ("step 1", "step 2", "step 3"):
            assert_same_gradients([mine[k] for mine in per_rank], method)


def timeline_worker(env: DistEnv) -> dict:
    NAMESPACE["BUCKET_CAP_MB"] = (
        CAP_MB  # this rank's copy: the lesson's worker reads it when it runs
    )
    return lesson.timeline_worker(env, 2)


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(("cpu", False), id="cpu"),
        pytest.param(("cuda", True), id="shared-gpu", marks=pytest.mark.gpu),
        pytest.param(("cuda", False), id="nccl", marks=pytest.mark.multigpu),
    ],
)
def test_real_ddps_timeline_shows_buckets_launched_during_backward(where: tuple[str, bool]) -> None:
    """Section 4.1's picture of real DDP: every bucket but the last leaves before the backward
    pass ends, and the compute pieces run forward, the layers from the last, optimizer.

    On GPUs this checks the CUDA-event clock of the compute and of the all-reduces' ends (an
    event recorded in a callback chained on each all-reduce's future)."""
    device, share = where
    for line in launch(
        timeline_worker, place(2, device, share_gpus=share), echo=False, timeout=120
    ):
        phases, comm = line["phases"], line["comm"]
        assert sorted(label for label, _, _ in comm) == [f"bucket {b}" for b in range(len(UNEVEN))]
        assert [label for label, _, _ in phases] == [
            "forward", "Linear 4", "Linear 3", "Linear 2", "Linear 1", "optimizer"
        ]  # fmt: skip
        assert all(start <= end for _, start, end in phases + comm)
        backward_end = phases[-2][2]
        assert all(start >= phases[0][2] for _, start, _ in comm)  # none before the forward ends
        assert all(start < backward_end for _, start, _ in comm[:-1]), (phases, comm)
        assert max(end for _, _, end in comm) <= phases[-1][1] + 1e-4  # DDP waited before the step
        assert set(line["alone"]) == {"forward", "backward", "optimizer"}


def layouts(env: DistEnv, **ddp_args) -> dict:
    return lesson.layouts_worker(env, [CAP_MB, None], **ddp_args)


def test_ddps_rebuilt_buckets_are_make_buckets_and_the_default_has_a_small_first_bucket() -> None:
    got = launch(layouts, 2, device="cpu", echo=False, timeout=60)[0]
    assert got[CAP_MB][0] == [list(range(8))]  # the first step: one bucket, the order unknown
    assert got[CAP_MB][1] == got[CAP_MB][2] == UNEVEN
    assert got[None][1] == DEFAULT_LAYOUT  # the lesson's own run (WIDTH=1024) checks the 1 MiB


def test_with_find_unused_parameters_ddp_never_rebuilds() -> None:
    got = launch(layouts, 2, device="cpu", echo=False, timeout=60, find_unused_parameters=True)[0]
    assert got[CAP_MB][0] == got[CAP_MB][1] == got[CAP_MB][2] != UNEVEN


def test_a_bucket_cap_that_is_not_positive_is_refused() -> None:
    params = list(lesson.make_model().parameters())
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="pass a positive size"):
            lesson.make_buckets(params, bad)
        with pytest.raises(ValueError, match="more than 0 MiB"):
            lesson.OverlapBuckets(lesson.make_model(), 2, bad)


def skipping_worker(env: DistEnv) -> None:
    """Step 3 without find_unused while rank 0 skips a layer: rank 0 must raise, not hang."""
    model = lesson.MaybeSkip(skip=env.rank == 0)
    reducer = lesson.OverlapBuckets(model, env.world_size, CAP_MB)  # find_unused=False
    x, y = lesson.make_batch(env.rank, 0)
    F.cross_entropy(model(x), y).backward()
    reducer.finish()


def test_a_missing_gradient_fails_with_the_fix_instead_of_hanging() -> None:
    start = time.perf_counter()
    with pytest.raises(WorkerError) as failed:
        launch(skipping_worker, 2, device="cpu", echo=False, timeout=60)
    assert time.perf_counter() - start < 30  # far below the 60 s collective timeout
    assert failed.value.rank == 0
    assert "pass find_unused=True" in failed.value.details


def test_exercise_1s_check_passes_the_solution_and_fails_wrong_plans() -> None:
    names = ("ddp_bucket_plan", "test_ddp_bucket_plan")
    namespace = {**NAMESPACE, "make_model": lesson.make_model, "make_buckets": lesson.make_buckets}
    namespace |= {"params": list(lesson.make_model().parameters())}
    namespace |= {"layouts": {None: [None, DEFAULT_LAYOUT]}}  # DDP's, as section 2.1 records it
    exercise = load_lesson_code("06a", names, namespace, folder=ROOT / "notebooks")
    exercise.test_ddp_bucket_plan()  # the solution passes

    def forward_order(sizes: list[int], cap: int, first_cap: int) -> list[list[int]]:
        reverse = exercise.ddp_bucket_plan(sizes[::-1], cap, first_cap)
        return [[len(sizes) - 1 - i for i in b] for b in reverse]

    def one_cap(sizes: list[int], cap: int, first_cap: int) -> list[list[int]]:
        return exercise.ddp_bucket_plan(sizes, cap, cap)  # ignores the first bucket's cap

    for wrong in (forward_order, one_cap):
        namespace["ddp_bucket_plan"] = wrong
        with pytest.raises(AssertionError):
            exercise.test_ddp_bucket_plan()


def test_exercise_2s_check_passes_the_solution_and_fails_wrong_answers() -> None:
    names = ("unused_parameters", "test_unused_parameters")
    namespace = {**NAMESPACE, "make_batch": lesson.make_batch, "MaybeSkip": lesson.MaybeSkip}
    exercise = load_lesson_code("06a", names, namespace, folder=ROOT / "notebooks")
    exercise.test_unused_parameters()  # the solution passes
    solution = exercise.unused_parameters

    def frozen_too(model: nn.Module, output: torch.Tensor) -> list[str]:
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        return solution(model, output) + frozen

    def nothing(model: nn.Module, output: torch.Tensor) -> list[str]:
        return []

    for wrong in (frozen_too, nothing):
        namespace["unused_parameters"] = wrong
        with pytest.raises(AssertionError):
            exercise.test_unused_parameters()
