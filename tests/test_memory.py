"""The memory accounting of lessons 05 and 08 (mgpu_helpers.memory), against known sizes.

Lesson 05a's per-device and per-stage counts are tested in test_model_parallel.py; here the
per-rank counts lesson 08 uses: parameters, Adam's two moments, shared storage, DTensor shards.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.memory import cuda_memory, local_tensor, optimizer_state_bytes, tensor_bytes


def test_a_linear_layers_parameters_and_gradients() -> None:
    layer = nn.Linear(10, 7)
    assert tensor_bytes(layer.parameters()) == (10 * 7 + 7) * 4
    assert tensor_bytes(p.grad for p in layer.parameters()) == 0  # no backward yet: None
    layer(torch.randn(3, 10)).sum().backward()
    assert tensor_bytes(p.grad for p in layer.parameters()) == (10 * 7 + 7) * 4
    assert tensor_bytes(layer.to(torch.bfloat16).parameters()) == (10 * 7 + 7) * 2


def test_adam_holds_two_moments_after_its_first_step() -> None:
    layer = nn.Linear(10, 7)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    assert optimizer_state_bytes(opt) == 0  # the state is created by the first step
    layer(torch.randn(3, 10)).sum().backward()
    opt.step()
    n = 10 * 7 + 7
    assert optimizer_state_bytes(opt) == 2 * n * 4  # exp_avg and exp_avg_sq, float32
    assert optimizer_state_bytes(opt, steps=True) == 2 * n * 4 + 2 * 4  # + a step per tensor
    sgd = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer(torch.randn(3, 10)).sum().backward()
    sgd.step()
    assert optimizer_state_bytes(sgd) == n * 4  # one momentum buffer


def test_a_storage_counts_once() -> None:
    flat = torch.zeros(100)
    views = [flat[:40], flat[40:].view(6, 10)]
    assert tensor_bytes(views) == 400  # two views of one buffer
    assert tensor_bytes([flat[:10]]) == 400  # a slice keeps its whole buffer alive
    tied = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(tied, nn.ReLU(), tied)  # a weight used twice
    assert tensor_bytes([tied.weight, tied.weight, None]) == 64
    assert tensor_bytes(model.parameters()) == 64
    assert tensor_bytes([torch.zeros(3), torch.zeros(3)]) == 24  # equal values, two storages
    assert tensor_bytes([]) == 0


def test_cuda_memory_is_none_off_the_gpu() -> None:
    assert cuda_memory("cpu") is None
    assert cuda_memory(torch.device("cpu")) is None


@pytest.mark.gpu
def test_cuda_memory_sees_a_new_tensor() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.synchronize(device)
    before = cuda_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    x = torch.empty(2**20, device=device)  # 4 MiB, a multiple of the 512-byte blocks
    after = cuda_memory(device)
    assert after.allocated - before.allocated == x.nbytes
    assert after.peak >= after.allocated and after.reserved >= after.allocated
    assert tensor_bytes([x]) == x.nbytes
    temporary = torch.empty(2**21, device=device)  # 8 MiB, freed at once: the peak remembers it
    del temporary
    gone = cuda_memory(device)
    assert gone.allocated == after.allocated
    assert gone.peak - after.allocated >= 8 * 2**20
    torch.cuda.reset_peak_memory_stats(device)  # the peak starts again from what is allocated now
    reset = cuda_memory(device)
    assert reset.peak == reset.allocated == after.allocated


def _dtensor_worker(env: DistEnv) -> tuple[int, int, int, int, dict[str, int]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    full = torch.randn(10, 6)  # 10 rows over 2 ranks: 5 each
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    layer = nn.Linear(6, 10)
    sharded_param = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    opt = torch.optim.Adam([sharded_param], lr=1e-3)
    sharded_param.grad = distribute_tensor(torch.ones(10, 6), mesh, [Shard(0)])
    opt.step()
    # an uneven shard: FSDP2 cuts 5 and 3 rows over 2 ranks as 3 + 2 and 2 + 1, padding rank 1's
    uneven = fully_shard(nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)), mesh=mesh)
    adam = torch.optim.Adam(uneven.parameters(), lr=1e-3)
    uneven(torch.randn(4, 6)).sum().backward()
    adam.step()
    params = list(uneven.parameters())
    fsdp = {
        "local": sum(local_tensor(p).numel() * 4 for p in params),
        "parameters": tensor_bytes(params),
        "gradients": tensor_bytes(p.grad for p in params),
        "optimizer": optimizer_state_bytes(adam),
    }
    return (
        tensor_bytes([sharded]),
        local_tensor(sharded).numel(),
        tensor_bytes([sharded_param.grad]),
        optimizer_state_bytes(opt),
        fsdp,
    )


def test_a_dtensor_counts_its_local_shard_on_each_rank() -> None:
    """Two real gloo ranks: a (10, 6) float32 DTensor sharded by rows holds 5 x 6 per rank,
    and so do its gradient and Adam's two moments.

    FSDP2 on Linear(6, 5) + Linear(5, 3): rank 1's shard is 2 + 2 rows and 1 + 1 rows, 20
    numbers, 80 bytes; but its parameters live in storage padded to 3 + 3 and 2 + 2 rows, 33
    numbers, and its gradients are views of one reduce-scatter buffer of the same padded size:
    tensor_bytes counts what the rank holds, 132 bytes each. Adam's moments are made from the
    unpadded local shard: 2 x 80 bytes."""
    per_rank = launch(_dtensor_worker, 2, device="cpu", echo=False, timeout=60)
    for held, numel, grad, state, _ in per_rank:
        assert numel == 5 * 6
        assert held == grad == 5 * 6 * 4
        assert state == 2 * 5 * 6 * 4
    padded = (3 * 6 + 3 + 2 * 5 + 2) * 4  # both ranks' storage: ceil(rows / 2) rows per parameter
    assert per_rank[0][4] == {"local": padded, "parameters": padded, "gradients": padded,
                              "optimizer": 2 * padded}  # rank 0's shard is the full padded size
    assert per_rank[1][4] == {"local": 80, "parameters": padded, "gradients": padded,
                              "optimizer": 2 * 80}  # rank 1's: 20 numbers, in padded storage
