"""Lesson 04, section 6: reduced evaluation counts every test sample exactly once, whatever
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
