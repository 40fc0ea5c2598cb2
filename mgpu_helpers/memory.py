"""Where training memory goes: bytes of parameters, gradients, optimizer state, activations.

One implementation for the lessons that count memory: lesson 05 splits it per device and per
pipeline stage (:func:`memory_by_device`, :func:`memory_by_stage`), lesson 06c measures what
autograd saves (:func:`saved_activation_bytes`), and lesson 08 counts what each rank holds
under DDP, ZeRO and FSDP2 (:func:`tensor_bytes`, :func:`optimizer_state_bytes`) and reads the
CUDA allocator next to it (:func:`cuda_memory`). Everything here counts tensors, so it is
exact on any hardware; only :func:`cuda_memory` needs a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "CudaMemory",
    "cuda_memory",
    "local_tensor",
    "memory_by_device",
    "memory_by_stage",
    "optimizer_state_bytes",
    "saved_activation_bytes",
    "tensor_bytes",
]

_KINDS = ("parameters", "gradients", "optimizer", "activations")


def local_tensor(t: Tensor) -> Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard, else ``t`` itself."""
    to_local = getattr(t, "to_local", None)  # DTensor (FSDP2's parameters, lesson 08)
    return to_local() if callable(to_local) else t


def _storage(t: Tensor) -> tuple[str, int, int]:
    """(device, address, bytes) of the memory ``t`` keeps alive: its whole storage."""
    try:
        storage = t.untyped_storage()
        return str(t.device), storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return str(t.device), id(t), t.numel() * t.element_size()


def tensor_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes this process holds for ``tensors`` (lesson 08: what each rank keeps).

    A DTensor counts its local shard; each storage counts once and whole (a view, or two
    parameters sharing one weight, is not counted twice; a slice keeps its whole buffer
    alive, so the whole buffer counts); None (a missing gradient) counts nothing. So the number
    is what the rank holds, padding included: FSDP2 pads an uneven shard to ceil(rows / N)
    rows and its local tensor is a view of that padded storage (its gradients views of one
    padded reduce-scatter buffer), so a rank whose shard is short counts the padded size.
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        device, address, size = _storage(local_tensor(t))
        if (device, address) not in seen:
            seen.add((device, address))
            total += size
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, steps: bool = False) -> int:
    """Bytes of the tensors in ``optimizer.state`` on this process (lesson 08; DTensor: local).

    Adam keeps two tensors per parameter (``exp_avg``, ``exp_avg_sq``), each the parameter's
    size, created by the first ``step()``; before it the state is empty. Its 0-dimensional
    ``step`` counters (one per parameter tensor: 4 bytes, or 8 when the default dtype is
    float64; kept on the CPU unless ``capturable`` or ``fused``) count only with
    ``steps=True``.
    """
    return tensor_bytes(
        t
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, Tensor) and (steps or t.dim() > 0)
    )


@dataclass(frozen=True)
class CudaMemory:
    """What the CUDA allocator says about one GPU, in bytes (lesson 08, section 1)."""

    allocated: int  # held by live tensors now (torch.cuda.memory_allocated)
    peak: int  # the most held at once since the last reset (torch.cuda.max_memory_allocated)
    reserved: int  # the allocator's cached segments (torch.cuda.memory_reserved), >= allocated


def cuda_memory(device: torch.device | str) -> CudaMemory | None:
    """The allocator's view of ``device``, or None when it is not a CUDA device (lesson 08).

    ``peak`` counts since the last ``torch.cuda.reset_peak_memory_stats(device)``: reset it
    before the work you measure. Allocations round up to 512-byte blocks, so a few hundred
    bytes per tensor separate these numbers from :func:`tensor_bytes`.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return CudaMemory(
        torch.cuda.memory_allocated(device),
        torch.cuda.max_memory_allocated(device),
        torch.cuda.memory_reserved(device),
    )


def _memory(module: nn.Module, slots: int, saved: dict[str, int]) -> dict[str, dict[str, int]]:
    """Bytes of each kind per device: the model's state from tensor sizes, plus ``saved``."""
    report: dict[str, dict[str, int]] = {}
    for p in module.parameters():
        size = p.numel() * p.element_size()
        row = report.setdefault(str(p.device), dict.fromkeys(_KINDS, 0))
        row["parameters"] += size
        row["gradients"] += size  # a gradient is as large as its parameter
        row["optimizer"] += slots * size  # optimizer state tensors per parameter
    for device, size in saved.items():  # activations
        report.setdefault(device, dict.fromkeys(_KINDS, 0))["activations"] += size
    return report


def memory_by_device(
    model: nn.Module, optimizer_slots: int = 1, sample: Tensor | None = None
) -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients, optimizer state and activations on each device (lesson 05).

    ``optimizer_slots``: state tensors per parameter (1 for SGD with momentum, 2 for Adam).
    Activations are what autograd saves for backward in one forward of ``sample``
    (:func:`saved_activation_bytes`), so the output and the loss are not counted. Lesson 08
    uses it for the whole model's four parts.
    """
    activations = {} if sample is None else saved_activation_bytes(model, sample)
    return _memory(model, optimizer_slots, activations)


def memory_by_stage(
    stages: Sequence[nn.Module],
    devices: Sequence[torch.device | str],
    optimizer_slots: int = 1,
    sample: Tensor | None = None,
) -> list[dict[str, int]]:
    """One :func:`memory_by_device` row per stage of a split model (lesson 05, section 2.1).

    Each stage counts as if it had a device of its own, so stages sharing a device are told
    apart, and a stage whose first layer saves its input counts the copy that crossed the cut.
    """
    if len(stages) != len(devices) or not stages:
        raise ValueError(f"need one device per stage, got {len(stages)} and {len(devices)}")
    saved = [{}] * len(stages) if sample is None else _saved_by_stage(stages, devices, sample)
    per_device = [_memory(m, optimizer_slots, a) for m, a in zip(stages, saved, strict=True)]
    return [{key: sum(row[key] for row in m.values()) for key in _KINDS} for m in per_device]


def saved_activation_bytes(model: nn.Module, sample: Tensor) -> dict[str, int]:
    """Bytes of the tensors autograd saves for backward in a forward of ``sample``, per device.

    Lessons 05 (section 2), 06 and 08. Each storage counts once (a ReLU's output that the next
    Linear saves too, a view), parameters, buffers and ``sample`` not at all; BatchNorm's
    running statistics are restored afterwards.
    """
    return _saved_by_stage([model], [sample.device], sample)[0]


def _saved_by_stage(
    stages: Sequence[nn.Module], devices: Sequence[torch.device | str], sample: Tensor
) -> list[dict[str, int]]:
    """Bytes saved per device by each stage, run in turn on its input moved to ``devices[i]``."""
    x = sample.to(devices[0])
    excluded = {_storage(t)[:2] for m in stages for t in (*m.parameters(), *m.buffers(), x)}
    buffers = [(b, b.detach().clone()) for stage in stages for b in stage.buffers()]
    per_stage: list[dict[str, int]] = []
    seen: set[tuple[str, int]] = set()

    def pack(t: Tensor) -> Tensor:
        device, address, size = _storage(t)
        if (device, address) not in excluded and (device, address) not in seen and size:
            seen.add((device, address))
            per_stage[-1][device] = per_stage[-1].get(device, 0) + size
        return t

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for stage, device in zip(stages, devices, strict=True):
                per_stage.append({})
                seen.clear()  # a stage's input counts again: on its own device it is a copy
                x = stage(x.to(device))
    finally:
        with torch.no_grad():
            for b, saved in buffers:  # BatchNorm's running statistics, as they were
                b.copy_(saved)
    return per_stage
