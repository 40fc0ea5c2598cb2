"""Lesson 04 (parts 04a and 04b): DDP with real processes over gloo, checked against one process.

The training worker is the lesson's own ``train_ddp``, read from its notebook and run here
(``load_lesson_code``); the step-by-step workers are the tests' own, in ``ddp_workers.py``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ddp_workers import (
    LESSON_04,
    ddp_step_worker,
    reference_steps,
    sampler_indices_worker,
    throughput_worker,
    wrap,
)

from mgpu_helpers.config import LessonConfig, apply_quick
from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.models import small_cnn

ROOT = Path(__file__).resolve().parents[1]

train_ddp = LESSON_04.train_ddp


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_on_n_ranks_equals_one_process_on_the_whole_batch(world_size: int) -> None:
    per_rank = 4
    results = launch(ddp_step_worker, world_size, 3, per_rank, device="cpu", echo=False)
    reference = reference_steps(3, per_rank * world_size)
    # every rank seeded differently (seed + rank): DDP's wrap made rank 0's weights everyone's
    assert not torch.equal(results[1]["before_wrap"], results[0]["before_wrap"])
    assert all(torch.equal(r["after_wrap"], results[0]["before_wrap"]) for r in results)
    for r in results:
        for name, value in reference["params"].items():
            torch.testing.assert_close(r["params"][name], value, msg=f"parameter {name}")
        # after backward every rank holds the same, averaged gradient ...
        for g, g_ref in zip(r["first_grads"], reference["first_grads"], strict=True):
            torch.testing.assert_close(g, g_ref)
    # ... although each rank computed a different loss on its own shard
    assert len({round(r["first_loss"], 6) for r in results}) == world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_sampler_covers_every_sample_once_per_epoch(world_size: int) -> None:
    n = 12 * world_size
    seen = launch(sampler_indices_worker, world_size, n, 2, device="cpu", echo=False)
    for epoch in range(2):
        together = sorted(i for rank in seen for i in rank[epoch])
        assert together == list(range(n))
    assert seen[0][0] != seen[0][1], "set_epoch should reshuffle between epochs"


def test_forgetting_set_epoch_repeats_the_order() -> None:
    seen = launch(sampler_indices_worker, 2, 24, 2, False, device="cpu", echo=False)
    assert seen[0][0] == seen[0][1], "without set_epoch every epoch has the same order"


def checkpoint_worker(env: DistEnv, path: str) -> list[float]:
    """Lesson 04b, section 4: rank 0 writes, every rank waits, then reads onto its device."""
    torch.manual_seed(env.rank)  # different weights per rank, on purpose
    model = wrap(small_cnn(), env)  # DDP broadcasts rank 0's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if env.is_main:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(state, path)
    dist.barrier()
    fresh = small_cnn()
    fresh.load_state_dict(torch.load(path, map_location=env.device, weights_only=True)["model"])
    return next(fresh.parameters()).flatten()[:3].tolist()


def test_checkpoint_is_written_by_rank_zero_and_read_by_all(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.pt")
    firsts = launch(checkpoint_worker, 2, path, device="cpu", echo=False)
    torch.manual_seed(0)
    expected = next(small_cnn().parameters()).flatten()[:3].tolist()
    assert firsts == [pytest.approx(expected), pytest.approx(expected)]
    assert not any(k.startswith("module.") for k in torch.load(path, weights_only=True)["model"])


def test_the_lessons_worker_learns_reports_global_metrics_and_checkpoints(tmp_path: Path) -> None:
    cfg = LessonConfig(epochs=3, batch_size=64, progress=False)  # all the digits
    path = str(tmp_path / "trained.pt")
    assert train_ddp.__code__.co_filename.startswith(str(ROOT / "notebooks" / "04b_ddp_training"))
    h0, h1 = launch(train_ddp, 2, cfg, path, device="cpu", echo=False)  # sent by value
    for metric in ("train_loss", "train_acc", "test_loss", "test_acc"):
        assert getattr(h0, metric) == getattr(h1, metric), f"{metric} not reduced"
    assert h0.test_acc[-1] > 0.85
    assert h0.train_loss[-1] < h0.train_loss[0]
    assert h0.samples_per_sec[0] > 0
    state = torch.load(path, weights_only=True)
    assert set(state) == {"model", "optimizer"}
    assert not any(k.startswith("module.") for k in state["model"])


def test_the_lessons_equality_check_holds_at_eight_epochs_on_digits(tmp_path: Path) -> None:
    """Issue 23, item 1: the lesson once asserted one tolerance on whole runs, and at 8 epochs
    of digits the test-loss gap reached 1.4e-2. Its check now compares after CHECK_STEPS steps,
    so it means the same at any EPOCHS; here it runs as the lesson runs it, with EPOCHS=8."""
    cfg = LessonConfig(epochs=8, batch_size=64, progress=False)  # digits, full size
    run_cfg = LESSON_04.comparison_config(cfg, 2)
    steps = LESSON_04.CHECK_STEPS
    short = replace(run_cfg, epochs=1, train_samples=steps * run_cfg.batch_size)
    path = str(tmp_path / "short.pt")
    ddp = launch(LESSON_04.train_ddp_exactly, 2, short, path, device="cpu", echo=False)[0]
    single, model = LESSON_04.one_device_run(short, torch.device("cpu"))
    state = torch.load(path, weights_only=True)["model"]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, **LESSON_04.EXACT, msg=name)
    torch.testing.assert_close(ddp.test_loss[0], single.test_loss[0], **LESSON_04.EXACT)
    # the check can fail: one more step on one side is far outside the tolerance
    longer = replace(short, train_samples=(steps + 1) * run_cfg.batch_size)
    _, other = LESSON_04.one_device_run(longer, torch.device("cpu"))
    first = next(iter(state))
    assert not torch.allclose(state[first], other.state_dict()[first], **LESSON_04.EXACT)


def test_throughput_worker_returns_a_rate() -> None:
    cfg = apply_quick(LessonConfig(batch_size=16, model="mlp", progress=False), True)
    rates = launch(throughput_worker, 2, cfg, 3, device="cpu", echo=False)
    assert rates[0] == rates[1] > 0


def alone_then_together(env: DistEnv, cfg_1: LessonConfig, cfg_n: LessonConfig) -> dict:
    """Lesson 04b, section 5: rank 0 alone in its own group, then every rank; same processes."""
    alone = dist.new_group([0])
    threads = torch.get_num_threads()
    solo = throughput_worker(env, cfg_1, 2, group=alone) if env.rank == 0 else None
    dist.barrier()
    together = throughput_worker(env, cfg_n, 2)
    return {"solo": solo, "together": together, "threads": (threads, torch.get_num_threads())}


def test_throughput_of_one_rank_and_of_all_in_one_launch() -> None:
    cfg = apply_quick(LessonConfig(model="mlp", progress=False), True)
    results = launch(
        alone_then_together,
        2,
        replace(cfg, batch_size=8),
        replace(cfg, batch_size=16),
        device="cpu",
        echo=False,
    )
    assert results[0]["solo"] > 0 and results[1]["solo"] is None
    assert results[0]["together"] == results[1]["together"] > 0
    assert all(r["threads"][0] == r["threads"][1] for r in results)  # like for like


@pytest.mark.multigpu
def test_ddp_equivalence_on_two_gpus() -> None:
    results = launch(ddp_step_worker, 2, 2, 4, device="cuda", echo=False)  # TF32 off inside
    reference = reference_steps(2, 8)
    for name, value in reference["params"].items():
        torch.testing.assert_close(results[0]["params"][name], value, rtol=1e-4, atol=1e-5)
