"""mgpu_helpers.mfu (lesson 11): the FLOP formula against FlopCounterMode, MFU, the peak, compile.

The formula is checked EXACTLY: FlopCounterMode counts 2 m n k per matmul, the same terms the
formula adds up, so any difference is a term missing or counted twice. No speed is asserted
(the peak is only checked to be a positive, finite measurement).
"""

from __future__ import annotations

import math
import stat
from pathlib import Path

import pytest
import torch

from mgpu_helpers.lm import GPT, GPTConfig
from mgpu_helpers.mfu import (
    DATASHEET_PEAK,
    attention_flops_per_token,
    compile_available,
    counted_flops,
    datasheet_model,
    datasheet_peak,
    flops_per_token,
    matmul_params,
    matmul_work,
    mfu,
    peak_matmul_flops,
    training_dtype,
)
from mgpu_helpers.timing import measure_alternating

# three shapes: the formula must hold for any head count, MLP ratio and context length
CONFIGS = (
    GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4),
    GPTConfig(seq_len=64, d_model=48, n_layers=3, n_heads=6, mlp_ratio=2),
    GPTConfig(vocab_size=200, seq_len=128, d_model=64, n_layers=1, n_heads=8),
)


def _model_and_batch(cfg: GPTConfig, batch: int = 2) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(cfg.vocab_size, (batch, cfg.seq_len))
    return model, x, torch.roll(x, -1, dims=1)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c.d_model}h{c.n_heads}t{c.seq_len}")
def test_formula_equals_flop_counter_exactly(cfg: GPTConfig) -> None:
    model, x, y = _model_and_batch(cfg)
    tokens = x.numel()
    assert counted_flops(model, x, y) == flops_per_token(cfg) * tokens


def test_matmul_params_are_the_2d_weights_less_the_position_table() -> None:
    for cfg in CONFIGS:
        model, _, _ = _model_and_batch(cfg)
        # parameters() lists the tied head/embedding weight once
        two_d = sum(p.numel() for p in model.parameters() if p.dim() == 2)
        assert matmul_params(cfg) == two_d - model.pos_emb.weight.numel()


def test_the_cpus_fused_attention_is_invisible_to_the_counter() -> None:
    # torch's table has no formula for _scaled_dot_product_flash_attention_for_cpu: with the
    # default kernel only the 6N part is counted on the CPU (why counted_flops uses MATH)
    cfg = CONFIGS[1]
    model, x, y = _model_and_batch(cfg)
    assert counted_flops(model, x, y, math_attention=False) == 6 * matmul_params(cfg) * x.numel()


def test_the_causal_mask_does_not_halve_the_count() -> None:
    cfg = CONFIGS[0]
    assert attention_flops_per_token(cfg) == 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
    model, x, y = _model_and_batch(cfg)
    full = counted_flops(model, x, y) - 6 * matmul_params(cfg) * x.numel()
    assert full == 12 * cfg.n_layers * cfg.d_model * cfg.seq_len * x.numel()


@pytest.mark.gpu
def test_cuda_fused_attention_counts_the_recomputed_scores() -> None:
    # flash / efficient / cuDNN backward formulas add Q K^T once more: 4 + 10 = 14 L d T
    cfg = GPTConfig(seq_len=128, d_model=128, n_layers=2, n_heads=4)
    model, x, y = _model_and_batch(cfg)
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        counted = counted_flops(model, x, y, math_attention=False)
    attention = 14 * cfg.n_layers * cfg.d_model * cfg.seq_len
    assert counted == (6 * matmul_params(cfg) + attention) * x.numel()


def test_mfu_arithmetic_and_bad_input() -> None:
    assert mfu(1000, 6e6, 1e10) == pytest.approx(0.6)
    assert mfu(0, 6e6, 1e10) == 0.0
    for args in ((-1, 6e6, 1e10), (1000, 0, 1e10), (1000, 6e6, 0), (math.nan, 6e6, 1e10),
                 (1000, 6e6, math.inf)):  # fmt: skip
        with pytest.raises(ValueError, match="mfu needs"):
            mfu(*args)


def test_peak_is_a_positive_finite_measurement() -> None:
    peak = peak_matmul_flops("cpu", size=128, repeats=3)
    assert peak.dtype == "float32" and peak.size == 128 and peak.matmuls == 1
    assert len(peak.timing.times) == 3 and peak.threads == torch.get_num_threads()
    assert math.isfinite(peak.median) and peak.median > 0 and peak.spread >= 0
    assert peak.median == pytest.approx(2 * 128**3 / peak.timing.median)
    assert "TFLOP/s (float32 128x128 matmul on cpu" in str(peak)
    assert peak_matmul_flops("cpu", torch.bfloat16, size=64, repeats=1).dtype == "bfloat16"


def test_matmul_work_times_in_anyones_rounds() -> None:
    work, as_peak = matmul_work("cpu", size=64, matmuls=3)
    timings = measure_alternating({"peak": work, "other": lambda: None}, "cpu", repeats=3)
    peak = as_peak(timings["peak"])
    assert peak.flops_per_call == 2 * 64**3 * 3 and peak.timing is timings["peak"]
    assert peak.median == pytest.approx(peak.flops_per_call / timings["peak"].median)


def test_peak_rejects_bad_input() -> None:
    for size in (0, -4):
        with pytest.raises(ValueError, match="at least 1"):
            peak_matmul_flops("cpu", size=size)
    with pytest.raises(ValueError, match="floating-point"):
        peak_matmul_flops("cpu", torch.int32, size=8)
    with pytest.raises(ValueError, match="repeats >= 1"):
        peak_matmul_flops("cpu", size=8, repeats=0)
    with pytest.raises(ValueError, match="cpu, cuda or mps"):
        peak_matmul_flops("meta", size=8)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            peak_matmul_flops("cuda", size=8)


def test_training_dtype_on_the_cpu_is_float32() -> None:
    assert training_dtype("cpu") == torch.float32


def _fake_compiler(folder: Path, name: str, works: bool) -> None:
    script = folder / name
    script.write_text("#!/bin/sh\n" + ("echo fake 1.0\n" if works else "exit 3\n"))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def _compile_available_with(name: str, path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """compile_available("cpu") with inductor looking for ``name`` and PATH only ``path``."""
    from torch._inductor import config

    monkeypatch.setenv("PATH", str(path))
    with config.patch({"cpp.cxx": (None, name)}):
        return compile_available("cpu")


def test_compile_without_a_compiler_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ok, why = _compile_available_with("g++", tmp_path, monkeypatch)  # an empty folder as PATH
    assert ok is False
    assert "no compiler runs here (looked for g++ on PATH)" in why
    assert "apt install g++" in why and "CXX" in why
    _fake_compiler(tmp_path, "g++", works=False)  # on PATH but failing --version, as inductor
    assert _compile_available_with("g++", tmp_path, monkeypatch)[0] is False


def test_compile_with_a_compiler_finds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_compiler(tmp_path, "my-cxx", works=True)
    ok, why = _compile_available_with("my-cxx", tmp_path, monkeypatch)
    assert ok is True and str(tmp_path / "my-cxx") in why


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", None),
        ("Tesla T4", "T4"),
        ("NVIDIA A10", None),
        ("NVIDIA A10G", None),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla V100S-PCIE-32GB", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_datasheet_lookup_by_device_name(name: str, model: str | None) -> None:
    assert datasheet_model(name) == model


def test_datasheet_figures_are_dense_per_dtype() -> None:
    h100 = datasheet_peak("NVIDIA H100 80GB HBM3", torch.bfloat16)
    assert h100 is not None and h100.flops["bfloat16"] == 989e12 and "sparsity" in h100.source
    assert datasheet_peak("NVIDIA A100-SXM4-40GB", torch.bfloat16).flops["bfloat16"] == 312e12
    assert datasheet_peak("Tesla T4", torch.float16).flops["float16"] == 65e12
    assert datasheet_peak("Tesla T4", torch.bfloat16) is None  # Turing: no bf16 tensor cores
    assert datasheet_peak("NVIDIA A10G", torch.bfloat16) is None
    assert all(row.source.startswith("NVIDIA ") for row in DATASHEET_PEAK.values())


@pytest.mark.gpu
def test_the_gpu_trains_and_peaks_in_bf16_or_fp16() -> None:
    major, _ = torch.cuda.get_device_capability(0)
    dtype = training_dtype("cuda:0")
    assert dtype == (torch.bfloat16 if major >= 8 else torch.float16)
    peak = peak_matmul_flops("cuda:0", size=4096, matmuls=4, repeats=3)
    assert peak.dtype == str(dtype).removeprefix("torch.") and peak.median > 1e12  # > 1 TFLOP/s
    sheet = datasheet_peak(torch.cuda.get_device_name(0), dtype)
    if sheet is not None:  # a measured matmul reaches a share of the dense datasheet figure
        assert 0.2 < peak.median / sheet.flops[peak.dtype] < 1.05
