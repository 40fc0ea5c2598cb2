"""Lesson 04b, section 1: reduced evaluation counts every test sample exactly once, whatever
the test-set size and the world size (the sampler's padding is left out).

``real_samples`` and ``evaluate_distributed`` are the lesson's own, read from its notebook
(``load_lesson_code``) and sent to the launched ranks by value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_workers import LESSON_04, wrap
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mgpu_helpers.config import LessonConfig, apply_quick
from mgpu_helpers.data import build_datasets
from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.models import small_cnn
from mgpu_helpers.train import evaluate

real_samples, evaluate_distributed = LESSON_04.real_samples, LESSON_04.evaluate_distributed


def _test_set(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=g))


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return small_cnn()


def eval_worker(env: DistEnv, n: int, batch: int) -> dict:
    model = wrap(_model(), env)
    data = _test_set(n)
    sampler = DistributedSampler(data, env.world_size, env.rank, shuffle=False)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    exact = evaluate_distributed(model, loader, env.device)
    mine = evaluate(model, loader, env.device)  # this rank's samples, padding included
    counted = torch.tensor([mine.samples])
    dist.all_reduce(counted)  # what adding up the ranks' plain results would count
    return {"exact": exact, "naive_samples": int(counted.item())}


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduced_evaluation_equals_one_process_on_a_test_set_that_does_not_divide(
    world_size: int,
) -> None:
    n, batch = 3 * world_size + 1, 2  # padding of world_size - 1, inside a smaller last batch
    results = launch(eval_worker, world_size, n, batch, device="cpu", echo=False)
    one = evaluate(_model(), DataLoader(_test_set(n), batch_size=5), "cpu")
    assert one.samples == n
    for r in results:
        assert r["exact"].samples == n
        assert r["exact"].loss == pytest.approx(one.loss, rel=1e-5)
        assert r["exact"].accuracy == pytest.approx(one.accuracy)
    # the plain reduction of per-rank means counts the padding: world_size - 1 samples twice
    assert results[0]["naive_samples"] == n + world_size - 1


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("n", "world_size"), [(10, 4), (7, 3), (8, 2), (1, 3), (100, 8)])
def test_real_samples_of_the_ranks_cover_the_data_set_once(
    n: int, world_size: int, shuffle: bool
) -> None:
    kept = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), world_size, rank, shuffle=shuffle, seed=1)
        kept += list(sampler)[: real_samples(sampler)]
    assert sorted(kept) == list(range(n))


def test_evaluate_distributed_refuses_loaders_it_cannot_make_exact() -> None:
    data = _test_set(5)  # refused before any collective, so no process group is needed
    with pytest.raises(ValueError, match="DistributedSampler"):
        evaluate_distributed(_model(), DataLoader(data, batch_size=2), "cpu")
    dropping = DistributedSampler(data, 2, 0, shuffle=False, drop_last=True)
    with pytest.raises(ValueError, match="drop_last=False"):
        evaluate_distributed(_model(), DataLoader(data, batch_size=2, sampler=dropping), "cpu")


def lesson_test_set_worker(env: DistEnv, cfg: LessonConfig) -> dict:
    """Exact evaluation of the small CNN on the test set of the lesson's comparison."""
    _, test_set, _ = build_datasets(cfg)
    sampler = DistributedSampler(test_set, env.world_size, env.rank, shuffle=False)
    loader = DataLoader(test_set, batch_size=256, sampler=sampler)
    exact = evaluate_distributed(wrap(_model(), env), loader, env.device)
    return {"read": len(sampler), "real": real_samples(sampler), "counted": exact.samples}


def test_the_lessons_comparison_never_has_a_test_set_that_divides_by_the_world_size() -> None:
    """Issue 23, item 2: the quick test set (256) divided by 2 ranks, so the lesson's own run
    never took the padding path it teaches. The comparison's test set now never divides."""
    for base in (apply_quick(LessonConfig(), True), LessonConfig()):  # quick and full mode
        for world_size in (2, 3, 4, 8):
            run_cfg = LESSON_04.comparison_config(base, world_size)
            train_set, test_set, _ = build_datasets(run_cfg)
            assert len(test_set) % world_size != 0, f"{world_size} ranks: evaluation would not pad"
            assert len(train_set) % world_size == 0, "the sampler would repeat training samples"


@pytest.mark.slow  # make test-long (CI): lesson 04b's quick run, which make test runs as a notebook
def test_the_lessons_quick_run_pads_its_test_set_and_counts_each_sample_once() -> None:
    run_cfg = LESSON_04.comparison_config(apply_quick(LessonConfig(), True), 2)
    n = len(build_datasets(run_cfg)[1])
    ranks = launch(lesson_test_set_worker, 2, run_cfg, device="cpu", echo=False)
    assert sum(r["read"] for r in ranks) > n, "no rank read padding"
    assert sum(r["real"] for r in ranks) == n
    assert all(r["counted"] == n for r in ranks)
