"""Lesson 03: its from-scratch data-parallel step and nn.DataParallel, against one device.

The step is written in the lesson's cells (``scatter``, ``replicate``, ``combine_gradients``,
``data_parallel_step``); these tests run those very functions, read from the notebook, on more
models, device counts and (when present) GPUs than the lesson itself does.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mgpu_helpers.data_parallel import shard_sizes
from mgpu_helpers.lesson_code import load_lesson_code
from mgpu_helpers.models import mlp, small_cnn
from mgpu_helpers.plots import plot_batch_split

STEP_FUNCTIONS = ("scatter", "replicate", "combine_gradients", "data_parallel_step")
LESSON_CODE = load_lesson_code(
    "03",
    STEP_FUNCTIONS,
    {"copy": copy, "torch": torch, "F": F, "nn": nn},
    folder=Path(__file__).resolve().parents[1] / "notebooks",
)
data_parallel_step = LESSON_CODE.data_parallel_step
replicate = LESSON_CODE.replicate
scatter = LESSON_CODE.scatter


def single_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def parallel_step(model: nn.Module, x, y, devices, combine="weighted", lr: float = 0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return data_parallel_step(model, opt, x, y, devices, combine=combine)


def batch(n: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


@pytest.mark.parametrize(("b", "n"), [(10, 2), (10, 3), (5, 4), (6, 4), (1, 3), (64, 8), (7, 1)])
def test_shard_sizes_follow_torch_chunk(b: int, n: int) -> None:
    expected = [len(c) for c in torch.arange(b).chunk(n)]
    assert shard_sizes(b, n) == expected
    assert sum(shard_sizes(b, n)) == b


def test_shard_sizes_can_leave_devices_idle() -> None:
    assert shard_sizes(6, 4) == [2, 2, 2]  # the fourth device gets nothing


@pytest.mark.parametrize(("b", "n"), [(0, 2), (-3, 2), (4, 0)])
def test_shard_sizes_rejects_bad_input(b: int, n: int) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        shard_sizes(b, n)


@pytest.mark.parametrize("n_devices", [2, 3])
@pytest.mark.parametrize("make", [small_cnn, lambda: mlp(64)])
def test_from_scratch_step_equals_single_device_step(n_devices: int, make) -> None:
    torch.manual_seed(0)
    reference = make()
    parallel = copy.deepcopy(reference)
    x, y = batch(10)  # 10 on 3 devices: uneven shards [4, 4, 2]
    single_step(reference, x, y)
    parallel_step(parallel, x, y, ["cpu"] * n_devices)
    for p_ref, p_par in zip(reference.parameters(), parallel.parameters(), strict=True):
        torch.testing.assert_close(p_par, p_ref)


def test_returned_loss_is_the_full_batch_mean() -> None:
    torch.manual_seed(0)
    model = small_cnn()
    x, y = batch(10)
    expected = F.cross_entropy(model(x), y).detach()
    loss = parallel_step(copy.deepcopy(model), x, y, ["cpu"] * 3)
    torch.testing.assert_close(loss, expected)


def test_plain_mean_is_right_only_for_even_shards() -> None:
    torch.manual_seed(0)
    reference = small_cnn()
    x, y = batch(10)
    even, uneven = copy.deepcopy(reference), copy.deepcopy(reference)
    single_step(reference, x, y)
    parallel_step(even, x, y, ["cpu"] * 2, combine="mean")  # [5, 5]
    parallel_step(uneven, x, y, ["cpu"] * 3, combine="mean")  # [4, 4, 2]
    for p_ref, p_even in zip(reference.parameters(), even.parameters(), strict=True):
        torch.testing.assert_close(p_even, p_ref)
    pairs = zip(reference.parameters(), uneven.parameters(), strict=True)
    gaps = [(a - b).abs().max() for a, b in pairs]
    assert max(gaps) > 1e-4


def test_summing_gradients_scales_them_by_the_device_count() -> None:
    torch.manual_seed(0)
    model = small_cnn()
    x, y = batch(12)
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    summed = copy.deepcopy(model)
    parallel_step(summed, x, y, ["cpu"] * 3, combine="sum", lr=0.0)  # lr 0: keep the weights
    for p_ref, p_sum in zip(reference.parameters(), summed.parameters(), strict=True):
        torch.testing.assert_close(p_sum.grad, 3 * p_ref.grad)


def test_replicas_are_independent_copies_without_old_gradients() -> None:
    model = small_cnn()
    x, y = batch(4)
    F.cross_entropy(model(x), y).backward()
    replicas = replicate(model, ["cpu", "cpu"])
    assert all(p.grad is None for r in replicas for p in r.parameters())
    with torch.no_grad():
        next(replicas[0].parameters()).add_(1.0)
    assert not torch.equal(next(replicas[0].parameters()), next(replicas[1].parameters()))
    assert not torch.equal(next(replicas[0].parameters()), next(model.parameters()))


def test_scatter_splits_in_order_and_leaves_devices_idle() -> None:
    x, y = torch.arange(7).float().unsqueeze(1), torch.arange(7)
    shards = scatter(x, y, ["cpu"] * 3)
    assert [s[1].tolist() for s in shards] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [s[0].squeeze(1).tolist() for s in shards] == [[0, 1, 2], [3, 4, 5], [6]]
    assert len(scatter(x[:6], y[:6], ["cpu"] * 4)) == 3  # shards [2, 2, 2]: one device idle


def test_data_parallel_on_available_devices_equals_plain_model() -> None:
    torch.manual_seed(0)
    plain = small_cnn()
    wrapped = nn.DataParallel(copy.deepcopy(plain))  # on CPU it simply calls the module
    x, y = batch(10)
    out_plain, out_dp = plain(x), wrapped(x)
    torch.testing.assert_close(out_dp, out_plain)
    F.cross_entropy(out_plain, y).backward()
    F.cross_entropy(out_dp, y).backward()
    for p, q in zip(plain.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)
    # the state dict of .module loads into a plain model
    fresh = small_cnn()
    fresh.load_state_dict(wrapped.module.state_dict())


def test_plot_batch_split_marks_idle_devices() -> None:
    fig = plot_batch_split(6, 4)
    title = fig.axes[0].get_title()
    assert "[2, 2, 2]" in title and "1 idle" in title


@pytest.fixture
def fp32_convolutions(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN convolutions in full float32 for this test (CUDA only; nothing changes on the CPU).

    PyTorch lets cuDNN run float32 convolutions in TF32 by default, which rounds their inputs
    to 10 mantissa bits: differently split batches (or another algorithm picked for another
    batch size) then differ by about 1e-3 relative, far above assert_close's float32 tolerance.
    These tests check the method (same arithmetic as one device), not the GPU's TF32 rounding.
    """
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.gpu
@pytest.mark.usefixtures("fp32_convolutions")
def test_from_scratch_step_on_virtual_gpu_devices() -> None:
    torch.manual_seed(0)
    reference = small_cnn().cuda()
    parallel = copy.deepcopy(reference)
    x, y = (t.cuda() for t in batch(10))
    single_step(reference, x, y)
    parallel_step(parallel, x, y, ["cuda:0"] * 3)
    for p_ref, p_par in zip(reference.parameters(), parallel.parameters(), strict=True):
        torch.testing.assert_close(p_par, p_ref)


@pytest.mark.multigpu
@pytest.mark.usefixtures("fp32_convolutions")
def test_from_scratch_step_and_data_parallel_on_two_gpus() -> None:
    torch.manual_seed(0)
    reference = small_cnn().to("cuda:0")
    parallel = copy.deepcopy(reference)
    x, y = (t.to("cuda:0") for t in batch(10))
    single_step(reference, x, y)
    parallel_step(parallel, x, y, ["cuda:0", "cuda:1"])
    for p_ref, p_par in zip(reference.parameters(), parallel.parameters(), strict=True):
        torch.testing.assert_close(p_par, p_ref)
    plain = small_cnn().to("cuda:0")
    wrapped = nn.DataParallel(copy.deepcopy(plain), device_ids=[0, 1])
    torch.testing.assert_close(wrapped(x), plain(x))
    F.cross_entropy(plain(x), y).backward()
    F.cross_entropy(wrapped(x), y).backward()
    for p, q in zip(plain.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)


@pytest.mark.multigpu
def test_data_parallel_keeps_batch_norm_statistics_of_device_0_only() -> None:
    """Lesson 03, section 3.6: the other replicas' running statistics are lost."""
    n = torch.cuda.device_count()
    norm = nn.BatchNorm1d(1).to("cuda:0")  # running_mean starts at 0
    values = torch.arange(4.0 * n).reshape(-1, 1)  # shard i holds 4i .. 4i+3
    nn.DataParallel(norm, device_ids=list(range(n)))(values)
    shard_0 = values.chunk(n)[0]
    torch.testing.assert_close(norm.running_mean.cpu(), norm.momentum * shard_0.mean().reshape(1))
    assert not torch.allclose(norm.running_mean.cpu(), norm.momentum * values.mean().reshape(1))
    assert norm.num_batches_tracked.item() == 1  # one update, device 0's
