"""Lesson 06c (mixed precision), with the lesson's own code read from its notebook.

bf16 logits stay within the lesson's derived bound of float32's (and above zero), training with
them lowers the loss as float32 does, gradients stay within 40 u; fp16 loses small gradients
without a scaler and keeps them with one; the scaled step (unscale, then clip) applies float32's
clipped gradients, and clipping before unscaling changes the step exactly when S·‖g‖ > max_norm;
DDP under autocast all-reduces float32 gradients.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_helpers.devices import full_float32
from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import load_lesson_code
from mgpu_helpers.models import count_parameters, mlp

NAMES = ["amp_step", "amp_scaler", "amp_gradient", "rel_error", "logit_error"]
BF16_U = 2.0**-8  # bf16's unit roundoff


def load(names: list[str], extra: dict) -> types.SimpleNamespace:
    """The lesson's definitions `names`, run with its imports and `extra`."""
    return load_lesson_code("06c", names, {"F": F, "nn": nn, "torch": torch, **extra})


def lesson(device: torch.device) -> types.SimpleNamespace:
    return load(NAMES, {"amp_device": device})


LESSON = lesson(torch.device("cpu"))
S = 2.0**16  # exact in binary: scaling and unscaling by it change no bits


def model_and_batch(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    g = torch.Generator().manual_seed(seed + 1)
    return model, torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def test_bf16_has_float32s_range_and_fp16_does_not() -> None:
    bf16, fp32, fp16 = (torch.finfo(t) for t in (torch.bfloat16, torch.float32, torch.float16))
    assert bf16.tiny == fp32.tiny and bf16.max < fp32.max < 1.01 * bf16.max
    assert torch.tensor(1e-30).to(torch.bfloat16) != 0  # far below fp16's range, kept
    assert torch.tensor(1e-8).to(torch.float16) == 0
    assert torch.tensor(1e-44).to(torch.bfloat16) == 0 < torch.tensor(1e-44)  # float32's subnormals


def test_bf16_autocast_gradients_are_close_to_float32() -> None:
    model, x, y = model_and_batch()
    reference = LESSON.amp_gradient(model, x, y, torch.float32)
    bf16 = LESSON.amp_gradient(model, x, y, torch.bfloat16)
    # the lesson's empirical allowance (cancellation and ReLU flips; measured about 8 u here)
    assert 0 < LESSON.rel_error(bf16, reference) <= 40 * BF16_U


def test_bf16_logits_stay_within_the_lessons_bound_at_every_step() -> None:
    """0 < ‖z16 − z32‖/‖z32‖ <= τ = 4·√layers·u on the same weights (section 3's derivation).

    Measured here: about 1.2 u against τ ≈ 6.9 u. The lower bound catches autocast not running.
    """
    tau = 4 * math.sqrt(3) * BF16_U  # three linear layers
    losses, errors = {}, []
    for dtype in (torch.float32, torch.bfloat16):
        model, x, y = model_and_batch()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = LESSON.amp_scaler(dtype)
        assert not scaler.is_enabled(), "bf16 and float32 need no scaler"
        losses[dtype] = []
        for _ in range(8):
            if dtype == torch.bfloat16:
                errors.append(LESSON.logit_error(model, x, dtype))
            losses[dtype].append(LESSON.amp_step(model, optimizer, scaler, x, y, dtype).item())
    assert 0 < min(errors) and max(errors) <= tau, [e / BF16_U for e in errors]
    drop32, drop16 = (run[0] - run[-1] for run in (losses[torch.float32], losses[torch.bfloat16]))
    assert drop32 > 0.1, "the loss should fall"
    assert drop16 >= 0.9 * drop32, "the bf16 run should learn as float32 does"


def test_logit_error_is_zero_without_autocast() -> None:
    """The lower bound has teeth: float32 "under autocast" changes no logit."""
    model, x, _ = model_and_batch()
    assert LESSON.logit_error(model, x, torch.float32) == 0


def test_the_scaled_step_unscales_before_clipping() -> None:
    """A scaled float32 step with clipping = float32's clipped step."""
    model, x, y = model_and_batch()
    reference, _, _ = model_and_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=S)
    LESSON.amp_step(model, optimizer, scaler, x, y, torch.float32, max_norm=0.05)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    F.cross_entropy(reference(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    assert norm > 0.05, "the test needs clipping to act"
    ref_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert scaler.get_scale() == S, "no overflow: the scale stays"


def clip_first_gradients(max_norm: float) -> tuple[float, float]:
    """(norm of the gradients a step applies when clipped before unscaling, the true norm)."""
    model, x, y = model_and_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the gradients are what we look at
    scaler = torch.amp.GradScaler("cpu", init_scale=S)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    true_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item() / S
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the wrong order
    scaler.step(optimizer)  # unscales the gradients in place
    return torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item(), true_norm


@pytest.mark.parametrize("times_norm", [0.5, 2.0, 2 * S])
def test_clipping_before_unscaling_changes_the_step_exactly_when_s_g_exceeds_max_norm(
    times_norm: float,
) -> None:
    _, g = clip_first_gradients(1.0)
    moved, _ = clip_first_gradients(times_norm * g)
    if S * g > times_norm * g:  # the first two cases: shrunk to max_norm / S
        assert math.isclose(moved, times_norm * g / S, rel_tol=1e-4)
    else:  # S·‖g‖ <= max_norm: nothing clipped, the true gradient applied
        assert math.isclose(moved, g, rel_tol=1e-4)


def test_fp16_on_the_cpu_needs_the_scaler_for_small_gradients() -> None:
    model, x, y = model_and_batch()
    reference = LESSON.amp_gradient(model, x, y, torch.float32, factor=1e-4)
    plain = LESSON.amp_gradient(model, x, y, torch.float16, factor=1e-4)
    scaled = LESSON.amp_gradient(model, x, y, torch.float16, factor=1e-4, scale=S)
    bf16 = LESSON.amp_gradient(model, x, y, torch.bfloat16, factor=1e-4)
    assert LESSON.rel_error(scaled, reference) < 0.02  # fp16: 11 significant bits
    assert LESSON.rel_error(plain, reference) > 5 * LESSON.rel_error(scaled, reference)
    nonzero = reference != 0
    lost = {
        name: ((g == 0) & nonzero).float().mean().item()
        for name, g in (("plain", plain), ("scaled", scaled), ("bf16", bf16))
    }
    assert lost["plain"] > 10 * max(lost["scaled"], lost["bf16"], 1e-4), lost


def test_fp16_gets_an_enabled_scaler() -> None:
    assert LESSON.amp_scaler(torch.float16).is_enabled()


def test_ddp_under_autocast_all_reduces_float32_gradients() -> None:
    """Section 2.1's worker on 2 CPU ranks: float32 buckets, 4 bytes per parameter."""
    names = ["make_model", "make_batch", "bucket_spy", "autocast_ddp_worker"]
    constants = {
        "IN_FEATURES": 256,
        "CLASSES": 10,
        "SEED": 0,
        "WIDTH": 64,
        "DEPTH": 2,
        "BATCH_SIZE": 8,
    }
    code = load(
        names,
        {
            "dist": dist,
            "DDP": DDP,
            "default_hooks": default_hooks,
            "DistEnv": DistEnv,
            "full_float32": full_float32,
            "mlp": mlp,
            **constants,
        },
    )
    ranks = launch(
        code.autocast_ddp_worker, 2, torch.bfloat16, device="cpu", echo=False, timeout=60
    )
    n_params = count_parameters(code.make_model())
    for result in ranks:
        assert result["logits"] == "torch.bfloat16"
        assert result["loss"] == "torch.float32", "the loss belongs inside the autocast block"
        assert {kind for kind, _ in result["sent"]} == {"torch.float32"}
        assert sum(n for _, n in result["sent"]) == 4 * n_params
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


@pytest.mark.gpu
def test_autocast_on_the_gpu_stays_close_trains_and_keeps_less_for_backward() -> None:
    """bf16 from compute capability 8.0 on, else fp16 with the scaler: the lesson's choice."""
    full_float32()  # the float32 reference without TF32
    matmul = torch.backends.cuda.matmul
    reduced = (
        matmul.allow_fp16_reduced_precision_reduction,
        matmul.allow_bf16_reduced_precision_reduction,
    )
    matmul.allow_fp16_reduced_precision_reduction = False  # 16-bit products summed in float32
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        check_autocast_on_the_gpu(torch.device("cuda:0"))
    finally:
        (
            matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction,
        ) = reduced


def check_autocast_on_the_gpu(dev: torch.device) -> None:
    gpu = lesson(dev)
    fp16 = torch.cuda.get_device_capability(dev) < (8, 0)
    dtype = torch.float16 if fp16 else torch.bfloat16
    model, x, y = model_and_batch()
    model, x, y = model.to(dev), x.to(dev), y.to(dev)
    u = torch.finfo(dtype).eps / 2
    assert 0 < gpu.logit_error(model, x, dtype) <= 4 * math.sqrt(3) * u
    reference = gpu.amp_gradient(model, x, y, torch.float32)
    mixed = gpu.amp_gradient(model, x, y, dtype, scale=S if fp16 else 1.0)
    assert 0 < gpu.rel_error(mixed, reference) <= 40 * u
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
