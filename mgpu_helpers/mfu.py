"""Model FLOPs utilisation: the FLOPs a training step needs over what the device can do (lesson 11).

MFU = tokens per second x FLOPs per token / the device's peak FLOP/s. Three parts:

**FLOPs per token** (:func:`flops_per_token`), for the GPT of :mod:`mgpu_helpers.lm`. Every
weight matrix W (d_in x d_out) costs 2 d_in d_out FLOPs per token in the forward pass (a multiply
and an add per weight), and twice that in the backward pass (one matmul for the gradient of the
input, one for the gradient of W): 6 FLOPs per weight per token for a training step. With N the
weights of all matrix multiplications, that is 6N. N counts each layer's q, k, v and out
projections (4 d^2), the MLP's up and down matrices (2 mlp_ratio d^2) and the output head
(vocab x d) ONCE: the head's weight is the token embedding's (tied), and the embedding's own use
is a table lookup, not a matmul. The position embedding is a lookup too, so it is not in N, and
neither are the LayerNorms, biases (the GPT has none) and GELU (elementwise, a few FLOPs per
activation: negligible next to d FLOPs per weight row).

Attention adds two matmuls per layer that have no weights: the scores Q K^T and the mix of the
values A V. Per token and layer each is 2 T d FLOPs (T = seq_len, summed over the heads), so
4 T d forward and, backward, 2 x that: 12 x n_layers x d_model x seq_len per token. That is the
PaLM paper's 6N + 12 L H Q T (H Q = d) which nanoGPT and torchtitan quote.

How ``torch.utils.flop_counter.FlopCounterMode`` counts the same step (read in its source,
torch 2.14): ``mm`` / ``bmm`` as 2 m n k, exactly the terms above, so the 6N part agrees exactly.
For ``F.scaled_dot_product_attention`` it depends on the kernel that runs:
- the math kernel (``sdpa_kernel(SDPBackend.MATH)``) is plain ``bmm``s: 4 T d forward and 8 T d
  backward per token and layer, the formula's 12 exactly (:func:`counted_flops` uses it);
- CUDA's fused kernels (flash, memory-efficient, cuDNN) have a formula of their own: the forward
  4 T d, the backward 10 T d, because it also counts recomputing the scores (Q K^T) that these
  kernels do instead of storing them: 14 T d in all;
- the CPU's fused kernel (``_scaled_dot_product_flash_attention_for_cpu``) is not in its table
  at all: it counts 0 FLOPs for attention on the CPU.
``is_causal=True`` halves nothing in either count: its formulas say "we aren't accounting for
causal attention" and count the full T x T scores, and the math kernel does compute all of them
before masking. The fused kernels do skip the blocks above the diagonal, so they do about half
the attention term's work; like PaLM's convention this module counts the full term (the model's
FLOPs, not the hardware's): at GPTConfig's defaults it is 14% of the total.

**The peak** (:func:`peak_matmul_flops`): a large square matmul in the training dtype
(:func:`training_dtype`), timed with :func:`mgpu_helpers.timing.measure` (warm-up, synchronised
repeats, median and spread). On GPUs the datasheet's dense tensor-core figure is also known for
some models (:data:`DATASHEET_PEAK`, :func:`datasheet_peak`), said as such: a real matmul
reaches less (clocks under power limits, memory traffic), and the lesson divides by the measured
figure.

**torch.compile** (:func:`compile_available`): the CPU backend (inductor) writes C++ and needs a
compiler, the CUDA backend needs triton; it says which one is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from .lm import GPTConfig, lm_loss
from .timing import Timing, measure

__all__ = [
    "DATASHEET_PEAK",
    "DatasheetPeak",
    "Peak",
    "attention_flops_per_token",
    "compile_available",
    "counted_flops",
    "datasheet_model",
    "datasheet_peak",
    "default_matmul_size",
    "flops_per_token",
    "matmul_params",
    "matmul_work",
    "mfu",
    "peak_matmul_flops",
    "training_dtype",
]


def matmul_params(cfg: GPTConfig) -> int:
    """N: the weights that enter a matmul, the tied head once, no position embedding (lesson 11)."""
    per_layer = (4 + 2 * cfg.mlp_ratio) * cfg.d_model**2  # q, k, v, out; MLP up and down
    return cfg.n_layers * per_layer + cfg.vocab_size * cfg.d_model  # + the (tied) head


def attention_flops_per_token(cfg: GPTConfig) -> int:
    """12 L d T: Q K^T and A V, forward and backward, as FlopCounterMode's math path counts them.

    Lesson 11. The full T x T scores: the causal mask is not subtracted (see the module's notes).
    """
    return 12 * cfg.n_layers * cfg.d_model * cfg.seq_len


def flops_per_token(cfg: GPTConfig) -> int:
    """FLOPs of one training step (forward + backward) per token: 6N + 12 L d T (lesson 11)."""
    return 6 * matmul_params(cfg) + attention_flops_per_token(cfg)


def counted_flops(model: nn.Module, x: Tensor, y: Tensor, math_attention: bool = True) -> int:
    """FLOPs of one forward and backward of ``model`` on ``(x, y)`` as FlopCounterMode counts them.

    Lesson 11 checks :func:`flops_per_token` against it. ``math_attention=True`` runs attention
    on the math kernel, whose matmuls the counter sees; ``False`` keeps the default kernel, which
    it counts differently (nothing on the CPU, the recomputation on CUDA: see the module's notes).
    Gradients accumulate into ``model``'s ``.grad`` as in any backward pass.
    """
    kernel = sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext()
    with kernel, FlopCounterMode(display=False) as counter:
        lm_loss(model(x), y).backward()
    return counter.get_total_flops()


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the FLOP/s the tokens needed over the peak FLOP/s (lesson 11)."""
    values = {
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "peak_flops": peak_flops,
    }
    bad = [f"{k}={v!r}" for k, v in values.items() if not math.isfinite(v) or v < 0]
    if bad or flops_per_token == 0 or peak_flops == 0:
        raise ValueError(
            "mfu needs finite numbers, tokens_per_s >= 0 and flops_per_token, peak_flops > 0; "
            f"got tokens_per_s={tokens_per_s!r}, flops_per_token={flops_per_token!r}, "
            f"peak_flops={peak_flops!r}"
        )
    return tokens_per_s * flops_per_token / peak_flops


# --- the peak, measured -----------------------------------------------------------------------


def training_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype lesson 11 trains in, and so the dtype of the peak that MFU divides by.

    CUDA: bfloat16 from compute capability 8.0 (A100, L4, H100) on, float16 before (T4, V100:
    no bfloat16 tensor cores). CPU: float32. Some CPUs multiply bfloat16 faster (AVX512-BF16,
    AMX), but lesson 11 trains on the CPU in float32, so its peak is float32's.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return torch.float32
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return torch.bfloat16 if torch.cuda.get_device_capability(index) >= (8, 0) else torch.float16


def default_matmul_size(device: torch.device | str) -> tuple[int, int]:
    """(n, matmuls per timed call) for the peak: large enough to fill the device (lesson 11).

    CPU: one 1024 x 1024 product (2.1 GFLOP, tens of ms), so warm-up and five repeats take well
    under 2 s. GPU: eight 8192 x 8192 products per call (8.8 TFLOP), so a call lasts ms even on
    an H100 and the launch overhead is a rounding error.
    """
    return (8192, 8) if torch.device(device).type == "cuda" else (1024, 1)


@dataclass(frozen=True)
class Peak:
    """A measured matmul peak (lesson 11): ``median`` FLOP/s and the ``spread`` of the repeats."""

    device: str
    dtype: str
    size: int  # n of the n x n by n x n products
    matmuls: int  # products per timed call
    threads: int  # torch CPU threads during the measurement
    timing: Timing

    @property
    def flops_per_call(self) -> int:
        return 2 * self.size**3 * self.matmuls

    @property
    def median(self) -> float:
        """FLOP/s at the median time: the figure to quote."""
        return self.flops_per_call / self.timing.median

    @property
    def spread(self) -> float:
        """(max - min) / median of the repeats' times: how noisy the measurement was."""
        return self.timing.spread

    def __str__(self) -> str:
        return (
            f"{self.median / 1e12:.3g} TFLOP/s ({self.dtype} {self.size}x{self.size} matmul on "
            f"{self.device}, {self.threads} thread(s), spread {self.spread:.0%})"
        )


def _check_device(dev: torch.device) -> None:
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here: measure the peak with device='cpu'")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be cpu, cuda or mps, got {dev}")


def matmul_work(
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    size: int | None = None,
    matmuls: int | None = None,
    seed: int = 0,
) -> tuple[Callable[[], None], Callable[[Timing], Peak]]:
    """The peak's work, to time, and how to read its :class:`Timing` as a :class:`Peak`.

    Lesson 11's benchmark times the work in the same rounds as the training steps
    (``timing.measure_alternating``), so a busy spell of the machine falls on both alike.
    ``dtype`` defaults to :func:`training_dtype`, ``size`` and ``matmuls`` to
    :func:`default_matmul_size`.
    """
    dev = torch.device(device)
    _check_device(dev)
    dtype = dtype or training_dtype(dev)
    default_n, default_k = default_matmul_size(dev)
    size = default_n if size is None else size
    matmuls = default_k if matmuls is None else matmuls
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    if size < 1 or matmuls < 1:
        raise ValueError(f"size and matmuls must be at least 1, got size={size}, {matmuls=}")
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(size, size, generator=g).to(dev, dtype) for _ in range(2))
    out = torch.empty(size, size, device=dev, dtype=dtype)
    name, threads = str(dtype).removeprefix("torch."), torch.get_num_threads()

    def products() -> None:
        for _ in range(matmuls):
            torch.mm(a, b, out=out)

    def as_peak(timing: Timing) -> Peak:
        return Peak(str(dev), name, size, matmuls, threads, timing)

    return products, as_peak


def peak_matmul_flops(
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    size: int | None = None,
    matmuls: int | None = None,
    *,
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
) -> Peak:
    """The device's matmul FLOP/s, measured: ``matmuls`` n x n products per timed call (lesson 11).

    Defaults as :func:`matmul_work`'s. On the CPU the figure holds for this process's torch
    threads (``torch.get_num_threads()``, recorded): measure with the threads each rank trains
    with, and at the same time as what it is compared with (a busy machine moves it).
    """
    work, as_peak = matmul_work(device, dtype, size, matmuls, seed)
    return as_peak(measure(work, device, warmup=warmup, repeats=repeats))


# --- the peak, from the datasheet --------------------------------------------------------------


@dataclass(frozen=True)
class DatasheetPeak:
    """A GPU's dense tensor-core peak per dtype, as its datasheet states it (lesson 11)."""

    model: str
    flops: Mapping[str, float]  # dtype name -> dense FLOP/s (without 2:4 structured sparsity)
    source: str  # where the figure is printed, and how dense follows from it

    def __post_init__(self) -> None:
        # internal invariant: every figure in the table is a positive FLOP/s
        assert self.flops and all(v > 0 for v in self.flops.values()), self.model


def _both(tflops: float) -> dict[str, float]:
    return {"bfloat16": tflops * 1e12, "float16": tflops * 1e12}


# Dense figures: NVIDIA's datasheets print the Ampere/Ada/Hopper tensor-core figures "with
# sparsity" (2:4 structured sparsity, twice the dense rate) and say so in a footnote; dense is
# half. Turing (T4) and Volta (V100) have no sparsity support: their figures are dense. Not
# listed: the A10 and A10G (no tensor-core figure from NVIDIA could be checked here; the A10G,
# AWS's variant, has no NVIDIA datasheet at all) and the H100/H200 NVL boards.
DATASHEET_PEAK: dict[str, DatasheetPeak] = {
    "H100 SXM": DatasheetPeak(
        "H100 SXM",
        _both(989),
        "NVIDIA H100 Tensor Core GPU datasheet: BF16/FP16 Tensor Core 1,979 TFLOPS with sparsity",
    ),
    "H100 PCIe": DatasheetPeak(
        "H100 PCIe",
        _both(756),
        "NVIDIA H100 Tensor Core GPU datasheet: BF16/FP16 Tensor Core 1,513 TFLOPS with sparsity",
    ),
    "H200": DatasheetPeak(
        "H200",
        _both(989),
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16/FP16 1,979 TFLOPS with sparsity",
    ),
    "A100": DatasheetPeak(
        "A100",
        _both(312),
        "NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 Tensor Core 312 TFLOPS (624 sparse)",
    ),
    "L4": DatasheetPeak(
        "L4",
        _both(121),
        "NVIDIA L4 Tensor Core GPU datasheet: BF16/FP16 Tensor Core 242 TFLOPS with sparsity",
    ),
    "T4": DatasheetPeak(
        "T4",
        {"float16": 65e12},
        "NVIDIA T4 datasheet: Mixed Precision (FP16/FP32) 65 TFLOPS (Turing: dense; no bf16)",
    ),
    "V100 SXM2": DatasheetPeak(
        "V100 SXM2",
        {"float16": 125e12},
        "NVIDIA V100 datasheet: Tensor Performance 125 TFLOPS (SXM2; Volta: dense; no bf16)",
    ),
    "V100 PCIe": DatasheetPeak(
        "V100 PCIe",
        {"float16": 112e12},
        "NVIDIA V100 datasheet: Tensor Performance 112 TFLOPS (PCIe; Volta: dense; no bf16)",
    ),
}

# torch.cuda.get_device_name spellings -> table rows, first match wins: "NVIDIA H100 80GB HBM3"
# (SXM), "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-40GB", "NVIDIA L4", "Tesla T4",
# "Tesla V100-SXM2-16GB". Word boundaries keep L40S, A100 and V100S apart.
_NAME_RULES: tuple[tuple[str, str | None], ...] = (
    (r"\bH100\b.*\bNVL\b", None),
    (r"\bH100\b.*\bPCIE\b", "H100 PCIe"),
    (r"\bH100\b", "H100 SXM"),
    (r"\bH200\b.*\bNVL\b", None),
    (r"\bH200\b", "H200"),
    (r"\bA100\b", "A100"),
    (r"\bL4\b", "L4"),
    (r"\bT4\b", "T4"),
    (r"\bV100\b.*\bPCIE\b", "V100 PCIe"),
    (r"\bV100\b", "V100 SXM2"),
)


def datasheet_model(device_name: str) -> str | None:
    """The :data:`DATASHEET_PEAK` row for a ``torch.cuda.get_device_name`` string, or None."""
    name = device_name.upper().replace("-", " ").replace("_", " ")
    for pattern, model in _NAME_RULES:
        if re.search(pattern, name):
            return model
    return None


def datasheet_peak(device_name: str, dtype: torch.dtype) -> DatasheetPeak | None:
    """The datasheet's dense peak for this GPU and dtype (lesson 11); None when not listed.

    ``result.flops[name]`` is the FLOP/s; ``result.source`` says where it is printed.
    """
    model = datasheet_model(device_name)
    if model is None:
        return None
    row = DATASHEET_PEAK[model]
    return row if str(dtype).removeprefix("torch.") in row.flops else None


# --- torch.compile ---------------------------------------------------------------------------


def _cpp_compilers() -> list[str]:
    """The C++ compilers inductor tries, in its order: ``torch._inductor.config.cpp.cxx``.

    It holds ``$CXX`` or ``g++`` (``clang++`` on macOS), after a conda download that only runs
    with ``TORCH_INDUCTOR_INSTALL_GXX`` set (the ``None`` entry, skipped here).
    """
    try:
        from torch._inductor import config

        wanted = config.cpp.cxx
        found = list(wanted) if isinstance(wanted, (list, tuple)) else [wanted]
    except ImportError:  # an older layout: the same default by hand
        found = [os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")]
    return [c for c in found if c]


def _compiler_runs(compiler: str) -> bool:
    """What inductor checks (``cpp_compiler_search``): ``<compiler> --version`` succeeds."""
    path = shutil.which(compiler)
    if path is None:
        return False
    try:
        subprocess.run([path, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def compile_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether ``torch.compile`` can run here, and why not when it cannot (lesson 11).

    ``device`` defaults to CUDA when there is a GPU, else the CPU. The CPU backend (inductor)
    writes C++ and compiles it: it needs the compiler inductor looks for (``$CXX`` or ``g++``)
    on PATH. On CUDA it writes triton kernels: it needs the ``triton`` package and a GPU of
    compute capability 7.0 or more.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from torch._dynamo import is_dynamo_supported

    if not is_dynamo_supported():
        return False, f"torch.compile does not support Python {sys.version.split()[0]} here"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False, "no CUDA device: pass device='cpu' to ask about the CPU backend"
        if importlib.util.find_spec("triton") is None:
            return False, "torch.compile on CUDA writes triton kernels: pip install triton"
        major, minor = torch.cuda.get_device_capability(dev)
        if (major, minor) < (7, 0):
            return (
                False,
                f"triton needs compute capability 7.0 or more; this GPU has {major}.{minor}",
            )

        return True, "triton is installed: torch.compile (inductor) can run on this GPU"
    compilers = _cpp_compilers()
    for compiler in compilers:
        if _compiler_runs(compiler):
            return True, f"C++ compiler {shutil.which(compiler)} found: inductor can build kernels"
    tried = " or ".join(compilers) or "g++"
    return False, (
        f"torch.compile on the CPU (inductor) compiles C++, and no compiler runs here (looked "
        f"for {tried} on PATH): install one (e.g. apt install g++) or point CXX at one; "
        "eager mode runs without it"
    )
