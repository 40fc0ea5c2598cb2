"""Where training memory goes: bytes of parameters, gradients, optimizer state, activations.

One implementation for the lessons that count memory: lesson 05a splits it per device and per
pipeline stage (:func:`memory_by_device`, :func:`memory_by_stage`), lesson 06c measures what
autograd saves (:func:`saved_activation_bytes`), and lesson 08a counts what each rank holds
under DDP, ZeRO and FSDP2 (:func:`tensor_bytes`, :func:`optimizer_state_bytes`) and reads the
CUDA allocator next to it (:func:`cuda_memory`). Everything here counts tensors, so it is
exact on any hardware; only :func:`cuda_memory` needs a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "CudaMemory",
    "LiveActivations",
    "cuda_memory",
    "local_tensor",
    "measured_training_memory",
    "memory_by_device",
    "memory_by_stage",
    "optimizer_state_bytes",
    "saved_activation_bytes",
    "tensor_bytes",
    "watch_activations",
]

_KINDS = ("parameters", "gradients", "optimizer", "activations")


def local_tensor(t: Tensor) -> Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard, else ``t`` itself."""
    to_local = getattr(t, "to_local", None)  # DTensor (FSDP2's parameters, lesson 08b)
    return to_local() if callable(to_local) else t


def _storage(t: Tensor) -> tuple[str, int, int]:
    """(device, address, bytes) of the memory ``t`` keeps alive: its whole storage."""
    try:
        storage = t.untyped_storage()
        return str(t.device), storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return str(t.device), id(t), t.numel() * t.element_size()


def tensor_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes this process holds for ``tensors`` (lessons 08a-08c: what each rank keeps).

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
    """Bytes of the tensors in ``optimizer.state`` here (lessons 08a-08c; a DTensor: its shard).

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
    """What the CUDA allocator says about one GPU, in bytes (lesson 08a, section 1)."""

    allocated: int  # held by live tensors now (torch.cuda.memory_allocated)
    peak: int  # the most held at once since the last reset (torch.cuda.max_memory_allocated)
    reserved: int  # the allocator's cached segments (torch.cuda.memory_reserved), >= allocated


def cuda_memory(device: torch.device | str) -> CudaMemory | None:
    """The allocator's view of ``device``, or None when it is not a CUDA device (lesson 08a).

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
    """Bytes of parameters, gradients, optimizer state and activations on each device (lesson 05a).

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
    """One :func:`memory_by_device` row per stage of a split model (lesson 05a, section 2.1).

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

    Lessons 05 (section 2), 06 and 08a-08b. Each storage counts once (a ReLU's output that the next
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


class LiveActivations:
    """Bytes one stage's autograd holds for backward now, and the most it held (lesson 05b).

    Every tensor autograd saves during a watched forward counts from then until autograd lets it
    go (after that micro-batch's backward); a storage saved twice counts once. Parameters,
    buffers and ``exclude`` (the input batch, in memory anyway) do not count.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._excluded = {_storage(t)[:2] for t in exclude}
        self._held: dict[tuple[str, int], list[int]] = {}  # storage -> [holders, bytes]
        self._lock = threading.Lock()  # GPU backwards release tensors on autograd's threads
        self.live = 0  # bytes held now
        self.peak = 0  # the most bytes held at once

    def pack(self, t: Tensor) -> object:
        """The saved-tensor hook: count ``t``'s storage until the returned holder is freed."""
        device, address, size = _storage(t)
        key = (device, address)
        if key in self._excluded or not size:
            return t
        with self._lock:
            entry = self._held.setdefault(key, [0, size])
            if entry[0] == 0:
                self.live += size
                self.peak = max(self.peak, self.live)
            entry[0] += 1
        return _Held(self, key, t)

    def release(self, key: tuple[str, int]) -> None:
        """One holder of ``key`` is gone; its bytes stop counting with the last one."""
        with self._lock:
            entry = self._held[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self._held[key]


class _Held:
    """A saved tensor as autograd keeps it: freeing it tells the meter."""

    def __init__(self, meter: LiveActivations, key: tuple[str, int], t: Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, t

    def __del__(self) -> None:
        self.meter.release(self.key)


def _unpack(saved: object) -> Tensor:
    return saved.tensor if isinstance(saved, _Held) else saved  # type: ignore[return-value]


@contextmanager
def watch_activations(
    stages: Sequence[nn.Module], exclude: Iterable[Tensor] = ()
) -> Iterator[list[LiveActivations]]:
    """One :class:`LiveActivations` per stage, counting during every forward of that stage.

    Lesson 05b compares GPipe's and 1F1B's peaks on the same split. The hooks go on each stage's
    forward, in whatever thread runs it, and come off when the block ends.
    """
    exclude = list(exclude)
    meters, handles = [], []
    for stage in stages:
        meter = LiveActivations([*exclude, *stage.parameters(), *stage.buffers()])
        stack = threading.local()  # each thread's open hook contexts

        def before(_module: nn.Module, _args: object, meter=meter, stack=stack) -> None:
            hooks = torch.autograd.graph.saved_tensors_hooks(meter.pack, _unpack)
            hooks.__enter__()
            stack.__dict__.setdefault("open", []).append(hooks)

        def after(_module: nn.Module, _args: object, _out: object, stack=stack) -> None:
            stack.open.pop().__exit__(None, None, None)

        handles.append(stage.register_forward_pre_hook(before))
        handles.append(stage.register_forward_hook(after, always_call=True))
        meters.append(meter)
    try:
        yield meters
    finally:
        for handle in handles:
            handle.remove()


def measured_training_memory(
    build: Callable[[], nn.Module], devices: Sequence[torch.device], x: Tensor, y: Tensor
) -> dict[str, dict[str, int]]:
    """Bytes the allocator holds on each GPU in ``devices`` while ``build()``'s model trains.

    Lesson 05a, section 2.2: parameters after ``build()``, gradients and SGD momentum after a
    first step, the activations left by the second step's forward (its output not counted) and
    backward's temporaries up to that step's peak. Differences remove what was there before.
    """
    gpus = sorted({torch.device(d) for d in devices if torch.device(d).type == "cuda"}, key=str)
    if not gpus:
        raise ValueError(f"measured_training_memory needs a GPU in devices, got {list(devices)}")

    def used() -> dict[torch.device, int]:
        return {d: torch.cuda.memory_allocated(d) for d in gpus}

    x = x.to(devices[0])
    base = used()
    model = build()  # the model arrives on its device(s) here
    after_params = used()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    before, after_forward = after_params, after_params
    for step in range(2):
        if step == 1:  # measure the second step, when all state already exists
            before = used()
            for d in gpus:
                torch.cuda.reset_peak_memory_stats(d)
        opt.zero_grad(set_to_none=False)  # keep the gradient tensors, as a training loop does
        out = model(x)
        if step == 1:  # what the forward left behind, less the output itself
            after_forward = used()
            after_forward[out.device] -= out.untyped_storage().nbytes()
        torch.nn.functional.cross_entropy(out, y.to(out.device)).backward()
        opt.step()
        del out
        for d in gpus:
            torch.cuda.synchronize(d)
    return {
        str(d): {
            "parameters": after_params[d] - base[d],
            "gradients + optimizer": before[d] - after_params[d],
            "activations": after_forward[d] - before[d],
            "temporaries (peak)": torch.cuda.max_memory_allocated(d) - after_forward[d],
        }
        for d in gpus
    }
