"""Lesson 06, section 3 (scaling): the lesson's own worker and bounds, read from its notebook.

One launch measures every world size 1 .. N on process groups of the first n ranks. These tests
run it on 2 and 3 real gloo processes, with a small MLP and one round, and check what the lesson
claims of it: strong scaling gives the one-rank gradient at every world size that splits the
global batch evenly, weak scaling does not (a larger global batch), the sample counts, and that
every world size got its timings. Speed is never asserted here.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

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
from mgpu_helpers.models import mlp
from mgpu_helpers.placement import place
from mgpu_helpers.progress import progress_bar
from mgpu_helpers.timing import synchronize

NAMES = [
    "make_model",
    "make_batch",
    "scaling_groups",
    "scaling_batches",
    "slowest",
    "step_seconds",
    "allreduce_seconds",
    "SCALING_KINDS",
    "scaling_worker",
    "predicted_efficiency",
]
# The head's parameters, made small (the lesson's names, so its code reads them unchanged).
PARAMETERS = {"WIDTH": 64, "DEPTH": 2, "BATCH_SIZE": 4, "SEED": 0, "IN_FEATURES": 16, "CLASSES": 10}
LESSON = load_lesson_code(
    "06",
    NAMES,
    {
        **PARAMETERS,
        "DDP": DDP,
        "DistEnv": DistEnv,
        "F": F,
        "dist": dist,
        "full_float32": full_float32,
        "mlp": mlp,
        "nn": nn,
        "progress_bar": progress_bar,
        "contextlib": contextlib,
        "synchronize": synchronize,
        "time": time,
        "torch": torch,
    },
    folder=Path(__file__).resolve().parents[1] / "notebooks",
)


def run(placement, per_rank: int, rounds: int = 1) -> dict:
    results = launch(LESSON.scaling_worker, placement, per_rank, 2, rounds, echo=False, timeout=60)
    assert all(r is None for r in results[1:]), "only rank 0 returns the measurements"
    return results[0]


def check_scaling(result: dict, world: int, per_rank: int, rounds: int = 1) -> None:
    global_batch = per_rank * world
    assert result["global_batch"] == global_batch
    for n in range(1, world + 1):
        assert result["samples"]["weak", n] == n * per_rank, f"weak, {n} ranks"
        assert result["samples"]["strong", n] == n * (global_batch // n), f"strong, {n} ranks"
        if global_batch % n == 0:  # the same global batch, split: the one-rank gradient
            assert result["errors"]["strong", n] < 1e-5, f"strong, {n} ranks: {result['errors']}"
        if n > 1:  # more samples averaged: a different gradient
            assert result["errors"]["weak", n] > 1e-3, f"weak, {n} ranks: {result['errors']}"
        for kind in LESSON.SCALING_KINDS:
            times = result["times"][kind, n]
            assert len(times) == rounds and all(t > 0 for t in times), f"{kind}, {n} ranks: {times}"


@pytest.mark.parametrize(("world", "per_rank"), [(2, 4), (3, 3)])
def test_one_launch_measures_every_world_size(world: int, per_rank: int) -> None:
    # (3, 3): a global batch of 9 does not split over 2 ranks; each takes 4, 8 samples in all
    check_scaling(run(place(world, "cpu"), per_rank), world, per_rank)


@pytest.mark.gpu
def test_ranks_sharing_one_gpu() -> None:
    check_scaling(run(place(2, "cuda", share_gpus=True), 4), 2, 4)


@pytest.mark.multigpu
def test_one_gpu_per_rank_nccl() -> None:
    check_scaling(run(place(2, "cuda"), 4), 2, 4)  # NCCL where torch has it


def test_predicted_efficiency() -> None:
    # weak: 2 ranks do twice the samples; compute 10 ms, all-reduce 5 ms
    assert LESSON.predicted_efficiency(2, 2, 10.0, 10.0, 5.0) == pytest.approx((10 / 15, 1.0))
    # compute slowed to 20 ms by sharing the hardware: at most half the ideal
    assert LESSON.predicted_efficiency(2, 2, 10.0, 20.0, 5.0) == pytest.approx((0.4, 0.5))
    # strong: the same 64 samples on 4 ranks, each computing 4 ms, all-reduce 5 ms
    assert LESSON.predicted_efficiency(4, 1, 16.0, 4.0, 5.0) == pytest.approx((16 / 36, 16 / 20))
