"""What hardware is here (lessons 00 and 01); where the ranks run on it is `placement.py`.

Looking must not initialise CUDA in the notebook kernel: later lessons start worker processes,
and a kernel that already holds a CUDA context cannot fork them. ``torch.cuda.device_count()``
asks NVML and stays clean; everything that needs a CUDA context (properties, peer access, the
NCCL version) is read in a short-lived subprocess unless this process already initialised CUDA.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

__all__ = [
    "DeviceCheck",
    "GpuInfo",
    "Hardware",
    "available_backends",
    "full_float32",
    "describe_hardware",
    "gpu_count",
    "hardware_as_dict",
    "nvidia_smi",
    "sanity_check_devices",
    "tensor_sanity",
]


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as the course reports it (lesson 01)."""

    index: int
    name: str
    total_memory_gib: float
    capability: tuple[int, int]  # compute capability (major, minor), e.g. (9, 0) on an H100/H200
    multi_processor_count: int


@dataclass(frozen=True)
class Hardware:
    """Everything lesson 00 prints about this machine."""

    python: str
    torch: str
    cuda_build: str | None  # CUDA version torch was built with; None on a CPU build
    cuda_available: bool
    gpus: tuple[GpuInfo, ...]
    peer_access: tuple[tuple[bool, ...], ...]  # peer_access[i][j]: cuda:i can read cuda:j directly
    nccl_version: str | None
    mps_available: bool  # Apple-silicon GPU (single device; no NCCL)
    backends: tuple[str, ...]  # torch.distributed backends built into this torch
    cpu_count: int
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES as set in the environment
    cuda_error: str | None = None  # why CUDA could not be inspected, when it could not


def gpu_count() -> int:
    """Number of visible CUDA devices, without creating a CUDA context (lesson 01)."""
    try:
        return torch.cuda.device_count()
    except Exception:  # a broken driver can make even the count raise
        return 0


def available_backends() -> tuple[str, ...]:
    """The torch.distributed backends this torch was built with (lesson 00)."""
    if not dist.is_available():
        return ()
    return tuple(n for n in ("gloo", "nccl", "mpi") if getattr(dist, f"is_{n}_available")())


def _probe_cuda() -> dict:
    """Read the CUDA facts that need a context; meant to run in a throwaway process."""
    n = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(n)]
    gpus = [
        GpuInfo(
            i, p.name, round(p.total_memory / 2**30, 2), (p.major, p.minor), p.multi_processor_count
        )
        for i, p in enumerate(props)
    ]
    peer = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if "nccl" in available_backends() else None
    return {"gpus": [asdict(g) for g in gpus], "peer": peer, "nccl": nccl}


def _json_from_child(code: str, *args: str, timeout: float = 120.0) -> object:
    """Run ``code`` in a fresh Python, which prints JSON last; this process keeps no CUDA."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
    )
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the child process exited with code {out.returncode}: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _probe_cuda_elsewhere(timeout: float = 120.0) -> dict:
    """Run `_probe_cuda` in a subprocess so this process stays free of a CUDA context."""
    code = "import json, mgpu_helpers.devices as d; print(json.dumps(d._probe_cuda()))"
    try:
        return _json_from_child(code, timeout=timeout)  # type: ignore[return-value]
    except RuntimeError as exc:
        raise RuntimeError(f"CUDA probe failed: {exc}") from None


def describe_hardware() -> Hardware:
    """Inspect this machine without initialising CUDA in the calling process (lesson 00)."""
    n = gpu_count()
    probe: dict = {"gpus": [], "peer": [], "nccl": None}
    error = None
    if n > 0:
        try:
            probe = _probe_cuda() if torch.cuda.is_initialized() else _probe_cuda_elsewhere()
        except Exception as exc:  # reported by `mgpu doctor`, never fatal here
            error = str(exc)
    return Hardware(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda_build=torch.version.cuda,
        cuda_available=n > 0 and error is None,
        gpus=tuple(GpuInfo(**{**g, "capability": tuple(g["capability"])}) for g in probe["gpus"]),
        peer_access=tuple(tuple(row) for row in probe["peer"]),
        nccl_version=probe["nccl"],
        mps_available=torch.backends.mps.is_available(),
        backends=available_backends(),
        cpu_count=os.cpu_count() or 1,
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        cuda_error=error,
    )


def nvidia_smi(*args: str, timeout: float = 30.0) -> str | None:
    """Output of ``nvidia-smi`` with ``args``, or None when the tool is missing or fails."""
    if (exe := shutil.which("nvidia-smi")) is None:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def hardware_as_dict(hw: Hardware) -> dict:
    """The report as plain JSON-ready data (the hardware section of the `make course` report)."""
    return asdict(hw)


@dataclass(frozen=True)
class DeviceCheck:
    """The tiny tensor sanity check on one device (lesson 00)."""

    device: str
    ok: bool
    max_abs_error: float | None  # largest |device result - float64 CPU result|; None on failure
    seconds: float | None  # wall time of the check, copies included; None on failure
    error: str | None = None  # what went wrong, when ok is False


def tensor_sanity(device: str, size: int = 64, seed: int = 0) -> DeviceCheck:
    """Copy a seeded matrix to ``device``, multiply it there, copy back, compare (lesson 00).

    The reference is the same product in float64 on the CPU; the tolerance (1% of the largest
    entry) catches a device that computes garbage, not rounding (TF32 included). A device that
    cannot allocate, compute or copy gives ``ok=False`` with the error, never an exception.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a whole number >= 1, got {size!r}")
    start = time.perf_counter()
    try:
        a = torch.randn(size, size, generator=torch.Generator().manual_seed(seed))
        reference = a.double() @ a.double().T
        on_device = a.to(device)
        result = (on_device @ on_device.T).to("cpu")  # copying back waits for the device
        error = (result.double() - reference).abs().max().item()
    except Exception as exc:  # the point is to report it
        first = (str(exc).strip().splitlines() or [""])[0]
        return DeviceCheck(str(device), False, None, None, f"{type(exc).__name__}: {first}")
    seconds = time.perf_counter() - start
    tolerance = 1e-2 * reference.abs().max().item()
    if math.isfinite(error) and error <= tolerance:
        return DeviceCheck(str(device), True, error, seconds)
    problem = f"result differs from the CPU reference by {error:.3g} (tolerance {tolerance:.3g})"
    return DeviceCheck(str(device), False, error, seconds, problem)


def sanity_check_devices(
    devices: Sequence[str],
    size: int = 64,
    *,
    in_subprocess: bool | None = None,
    timeout: float = 120.0,
) -> tuple[DeviceCheck, ...]:
    """:func:`tensor_sanity` on each distinct device in ``devices``, in order (lesson 00).

    ``in_subprocess=None`` runs the checks in a short-lived child process when one of the
    devices is a GPU and this process has not initialised CUDA yet, so a notebook kernel stays
    free of a CUDA context (see the module docstring); CPU-only checks run here.
    """
    distinct = list(dict.fromkeys(str(d) for d in devices))
    if not distinct:
        raise ValueError("no devices to check; pass e.g. place(2).devices")
    if in_subprocess is None:
        uses_gpu = any(torch.device(d).type == "cuda" for d in distinct)
        in_subprocess = uses_gpu and not torch.cuda.is_initialized()
    if not in_subprocess:
        return tuple(tensor_sanity(d, size) for d in distinct)
    code = (
        "import json, sys, dataclasses, mgpu_helpers.devices as d\n"
        "size = int(sys.argv[1])\n"
        "print(json.dumps([dataclasses.asdict(d.tensor_sanity(x, size)) for x in sys.argv[2:]]))"
    )
    try:
        rows = _json_from_child(code, str(size), *distinct, timeout=timeout)
    except Exception as exc:  # a child that fails, hangs or prints no JSON: report, not raise
        first = (str(exc).strip().splitlines() or [""])[0]
        return tuple(DeviceCheck(d, False, None, None, first) for d in distinct)
    return tuple(DeviceCheck(**row) for row in rows)


def full_float32(deterministic: bool = False) -> None:
    """Switch off TF32 in this process, for GPU results compared with the CPU (lessons 03-05).

    cuDNN runs float32 convolutions in TF32 by default (10-bit mantissas): too coarse for checks
    against the CPU. ``deterministic=True`` also restricts cuDNN to deterministic algorithms
    (none whose atomic adds round differently from run to run) and switches its autotuning
    (``benchmark``) off (lesson 04b compares two runs on GPUs). A function, so a worker calling it
    stays picklable by value (the ``torch.backends.cudnn`` module is not).
    """
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
