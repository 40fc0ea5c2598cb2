"""Lesson 04a, sections 5.1-5.2: BatchNorm breaks "N ranks x b = one process x N*b";
SyncBatchNorm restores it, on GPU modules only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ddp_workers import ddp_step_worker, has_batch_norm, reference_steps, step_model

from mgpu_helpers.devices import gpu_count
from mgpu_helpers.launch import WorkerError, launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_step_models_with_and_without_batch_norm() -> None:
    assert not has_batch_norm(step_model("cnn"))
    assert has_batch_norm(step_model("resnet"))
    with pytest.raises(ValueError, match="choose 'cnn' or 'resnet'"):
        step_model("vit")


def test_batch_norm_under_ddp_is_not_one_process_on_the_whole_batch() -> None:
    world_size, per_rank, steps = 2, 16, 2
    results = launch(
        ddp_step_worker, world_size, steps, per_rank, 0, "resnet", device="cpu", echo=False
    )
    reference = reference_steps(steps, per_rank * world_size, 0, "resnet")
    pairs = zip(results[0]["first_grads"], reference["first_grads"], strict=True)
    gap = max((g - g_ref).abs().max().item() for g, g_ref in pairs)
    assert gap > 1e-3, f"BatchNorm's gradients should differ from the full batch's, gap {gap:.1e}"
    # statistics per rank: after step 1 each rank's running mean is 0.1 x its own batch mean,
    # and the ranks' average is the full batch's
    own = [r["bn_leaving"][0] for r in results]
    torch.testing.assert_close(torch.stack(own).mean(dim=0), reference["bn_leaving"][0])
    assert not torch.allclose(own[0], reference["bn_leaving"][0])
    assert not torch.equal(own[0], own[1])
    # DDP broadcasts rank 0's buffers as each training forward starts
    assert all(torch.equal(r["bn_entering"][1], own[0]) for r in results)


def test_sync_batch_norm_is_refused_on_the_cpu() -> None:
    with pytest.raises(WorkerError, match="SyncBatchNorm") as caught:
        launch(ddp_step_worker, 2, 1, 4, 0, "resnet", True, device="cpu", echo=False, timeout=30)
    assert "GPU" in caught.value.details.strip().splitlines()[-1]


@pytest.mark.gpu
def test_sync_batch_norm_under_ddp_equals_one_device_on_the_whole_batch() -> None:
    world_size, per_rank, steps = 2, 16, 3
    sharing = gpu_count() < world_size  # one GPU: both ranks on cuda:0, over gloo
    results = launch(
        ddp_step_worker,
        world_size,
        steps,
        per_rank,
        0,
        "resnet",
        True,
        device="cuda",
        share_gpus=sharing,
        echo=False,
    )
    reference = reference_steps(steps, per_rank * world_size, 0, "resnet")  # CPU, float32
    tol = {"rtol": 1e-3, "atol": 1e-4}  # TF32 off in the ranks; GPU kernels sum in another order
    for r in results:
        for g, g_ref in zip(r["first_grads"], reference["first_grads"], strict=True):
            torch.testing.assert_close(g, g_ref, **tol)
        for name, value in reference["params"].items():  # running statistics included
            torch.testing.assert_close(r["params"][name].float(), value.float(), **tol, msg=name)
    # and plain BatchNorm on the same GPUs does differ: the test can tell the two apart
    plain = launch(
        ddp_step_worker,
        world_size,
        steps,
        per_rank,
        0,
        "resnet",
        device="cuda",
        share_gpus=sharing,
        echo=False,
    )
    pairs = zip(plain[0]["first_grads"], reference["first_grads"], strict=True)
    assert max((g - g_ref).abs().max().item() for g, g_ref in pairs) > 1e-3


def test_the_lesson_shows_ddp_broadcasting_buffers_at_the_very_first_forward() -> None:
    """Issue 23, item 3: DDP broadcasts rank 0's buffers at the first forward too, not only at
    a forward that follows a training forward. The lesson's own ddp_steps gives each rank its
    own running mean after the wrap; as the first forward starts, every rank holds rank 0's."""
    names = ["fixed_batches", "step_model", "first_batch_norm", "ddp_steps"]
    lesson = load_lesson_code("04a", names, lesson_imports("04a", NOTEBOOKS), NOTEBOOKS)
    results = launch(lesson.ddp_steps, 2, 2, 4, 0, "resnet", device="cpu", echo=False)
    own = [r["bn_own_start"] for r in results]
    assert not torch.equal(own[0], own[1]), "the ranks should start the run with their own buffers"
    for r in results:
        torch.testing.assert_close(r["bn_entering"][0], own[0], rtol=0, atol=0)
        torch.testing.assert_close(r["bn_entering"][1], results[0]["bn_leaving"][0], rtol=0, atol=0)
