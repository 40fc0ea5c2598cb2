"""What lesson 01 says about the CUDA caching allocator, checked on a GPU.

``memory_allocated`` counts each tensor as a block of its size rounded up to 512 bytes;
``memory_reserved`` grows in segments: 2 MiB ones shared by tensors of up to 1 MiB, and for a
tensor of 10 MiB or more a segment of its size rounded up to a multiple of 2 MiB. These are the
allocator's defaults, so the tests skip when ``PYTORCH_CUDA_ALLOC_CONF`` changes them.
"""

from __future__ import annotations

import os

import pytest
import torch

MiB = 2**20

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "PYTORCH_CUDA_ALLOC_CONF" in os.environ,
        reason="PYTORCH_CUDA_ALLOC_CONF changes the allocator's rounding",
    ),
]


def _grow(n_bytes: int) -> tuple[int, int, torch.Tensor]:
    """Allocate ``n_bytes`` on cuda:0; return how far allocated and reserved memory grew."""
    torch.cuda.synchronize(0)
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
    tensor = torch.empty(n_bytes, dtype=torch.uint8, device="cuda:0")
    grown = torch.cuda.memory_allocated(0) - allocated, torch.cuda.memory_reserved(0) - reserved
    return grown[0], grown[1], tensor


@pytest.mark.parametrize("n_bytes", [1, 511, 512, 513, 100_000])
def test_memory_allocated_rounds_up_to_512_bytes(n_bytes):
    allocated, _, tensor = _grow(n_bytes)
    assert allocated == -(-n_bytes // 512) * 512
    del tensor


def test_small_tensors_share_a_2_mib_segment():
    _, reserved, first = _grow(1000)
    assert reserved in (0, 2 * MiB)  # 0 when a small segment with room already exists
    before = torch.cuda.memory_reserved(0)
    second = torch.empty(1000, dtype=torch.uint8, device="cuda:0")
    assert torch.cuda.memory_reserved(0) == before  # fits in the same segment
    del first, second


def test_a_large_tensor_gets_a_segment_rounded_up_to_2_mib():
    allocated, reserved, tensor = _grow(12 * MiB + 1)
    assert allocated == 12 * MiB + 512
    address = tensor.data_ptr()
    (segment,) = [
        s
        for s in torch.cuda.memory_snapshot()
        if s["address"] <= address < s["address"] + s["total_size"]
    ]
    assert segment["total_size"] % (2 * MiB) == 0
    if reserved:  # a new segment, not room left in one that other tensors still use
        assert reserved == segment["total_size"] == 14 * MiB
    del tensor
