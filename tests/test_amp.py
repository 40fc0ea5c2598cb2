"""Lesson 06, section 5: mixed precision on the CPU, with the lesson's own step from its notebook.

bf16 autocast stays close to float32 (tolerances say why), and the GradScaler step the lesson
writes (unscale, then clip) applies float32's clipped gradients; clipping before unscaling
does not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mgpu_helpers.devices import full_float32
from mgpu_helpers.lesson_code import load_lesson_code

LESSON = load_lesson_code(
    "06",
    ["amp_step", "amp_scaler", "amp_gradient", "rel_error"],
    {"F": F, "nn": nn, "torch": torch, "amp_device": torch.device("cpu")},
)


def model_and_batch(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    g = torch.Generator().manual_seed(seed + 1)
    return model, torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def test_bf16_autocast_gradients_are_close_to_float32() -> None:
    model, x, y = model_and_batch()
    reference = LESSON.amp_gradient(model, x, y, torch.float32)
    bf16 = LESSON.amp_gradient(model, x, y, torch.bfloat16)
    # bf16 keeps 8 significant bits (relative step 2^-8): a few percent over sums of products
    assert 0 < LESSON.rel_error(bf16, reference) < 0.1


def test_bf16_training_follows_float32() -> None:
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, x, y = model_and_batch()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = LESSON.amp_scaler(dtype)
        assert not scaler.is_enabled(), "bf16 and float32 need no scaler"
        losses[dtype] = [
            LESSON.amp_step(model, optimizer, scaler, x, y, dtype, 1.0).item() for _ in range(8)
        ]
    assert losses[torch.float32][-1] < losses[torch.float32][0] - 0.1, "the loss should fall"
    for a, b in zip(losses[torch.bfloat16], losses[torch.float32], strict=True):
        assert abs(a - b) < 0.02 * b  # bf16's rounding, not a different course


def test_the_scaled_step_unscales_before_clipping() -> None:
    """A scaled float32 step (S = 2^16, exact in binary) with clipping = float32's clipped step."""
    model, x, y = model_and_batch()
    reference, _, _ = model_and_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    LESSON.amp_step(model, optimizer, scaler, x, y, torch.float32, max_norm=0.05)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    F.cross_entropy(reference(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    assert norm > 0.05, "the test needs clipping to act"
    ref_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert scaler.get_scale() == 2.0**16, "no overflow: the scale stays"


def test_clipping_scaled_gradients_shrinks_the_update_by_the_scale() -> None:
    model, x, y = model_and_batch()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # the wrong order
    scaler.step(optimizer)
    moved = torch.cat([(p - b).flatten() for p, b in zip(model.parameters(), before, strict=True)])
    assert 0 < moved.norm() < 0.5 * 0.05 / 2.0**16 * 1.01  # lr · max_norm / S


def test_fp16_on_the_cpu_needs_the_scaler_for_small_gradients() -> None:
    model, x, y = model_and_batch()
    reference = LESSON.amp_gradient(model, x, y, torch.float32, factor=1e-4)
    plain = LESSON.amp_gradient(model, x, y, torch.float16, factor=1e-4)
    scaled = LESSON.amp_gradient(model, x, y, torch.float16, factor=1e-4, scale=2.0**16)
    assert LESSON.rel_error(scaled, reference) < 0.02  # fp16: 11 significant bits
    assert LESSON.rel_error(plain, reference) > 5 * LESSON.rel_error(scaled, reference)


@pytest.mark.parametrize("dtype", [torch.float16])
def test_fp16_gets_an_enabled_scaler(dtype: torch.dtype) -> None:
    assert LESSON.amp_scaler(dtype).is_enabled()


@pytest.mark.gpu
def test_autocast_on_the_gpu_stays_close_trains_and_keeps_less_for_backward() -> None:
    """bf16 from compute capability 8.0 on, else fp16 with the scaler: the lesson's choice."""
    full_float32()  # the float32 reference without TF32
    dev = torch.device("cuda:0")
    names = ["amp_step", "amp_scaler", "amp_gradient", "rel_error"]
    gpu = load_lesson_code("06", names, {"F": F, "nn": nn, "torch": torch, "amp_device": dev})
    fp16 = torch.cuda.get_device_capability(dev) < (8, 0)
    dtype = torch.float16 if fp16 else torch.bfloat16
    model, x, y = model_and_batch()
    model, x, y = model.to(dev), x.to(dev), y.to(dev)
    reference = gpu.amp_gradient(model, x, y, torch.float32)
    mixed = gpu.amp_gradient(model, x, y, dtype, scale=2.0**16 if fp16 else 1.0)
    assert gpu.rel_error(mixed, reference) < 0.1
    optimizer, scaler = torch.optim.SGD(model.parameters(), lr=0.1), gpu.amp_scaler(dtype)
    assert scaler.is_enabled() == fp16
    losses = [gpu.amp_step(model, optimizer, scaler, x, y, dtype, 1.0).item() for _ in range(8)]
    assert losses[-1] < losses[0] - 0.1, "the autocast step should train"

    torch.manual_seed(0)
    wide = nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    ).to(dev)
    big_x = torch.randn(4096, 256, device=dev)
    big_y = torch.randint(0, 10, (4096,), device=dev)
    peaks = {}
    for kind in (torch.float32, dtype):
        wide.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        gpu.amp_gradient(wide, big_x, big_y, kind)
        torch.cuda.synchronize(dev)
        peaks[kind] = torch.cuda.max_memory_allocated(dev)
    assert peaks[dtype] < peaks[torch.float32], f"peak bytes: {peaks}"
