"""Where the ranks of one machine run and how they talk: one decision, one record (lesson 00).

``place(world_size)`` looks at the GPUs here and returns a :class:`Placement`: each rank's device
and the torch.distributed backend that joins the ranks. NCCL when every rank has a GPU of its
own; gloo for CPU processes and for ranks that share a GPU (NCCL refuses two ranks on one GPU).
The lessons (``placement = place(n, share_gpus=True)``), the launcher (``launch(worker,
placement)``) and scripts under ``torchrun`` (``DistEnv.from_environ``) all ask this function, so
the backend is chosen in one place. A one-process lesson (03, 05) uses ``placement.devices`` as
its devices. Nothing is simulated: with fewer GPUs the same code runs on fewer physical devices.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import devices as hardware  # looked up at each call: tests patch its functions
from .troubleshooting import see

__all__ = ["Placement", "place", "usable_cpus"]

_DEVICES = ("auto", "cpu", "cuda")
_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Placement:
    """Where the ranks of one machine run and how they talk; printed atop lessons and launches."""

    world_size: int  # ranks on this machine (the devices a one-process lesson uses)
    device_type: str  # "cpu" or "cuda"
    devices: tuple[str, ...]  # each rank's device: ("cpu", "cpu"), ("cuda:0", "cuda:1"), ...
    backend: str  # "nccl" (one GPU per rank) or "gloo" (CPU, or ranks sharing a GPU)
    share_gpus: bool  # several ranks on one GPU
    n_gpus: int  # GPUs visible
    threads_per_rank: int  # torch CPU threads each rank gets
    notes: tuple[str, ...] = ()  # what stands in for what, said once at the top of a lesson

    def __post_init__(self) -> None:
        # Internal invariants: place() builds consistent records; a hand-made one is checked.
        if len(self.devices) != self.world_size:
            raise ValueError(
                f"a Placement needs one device per rank: world_size={self.world_size} but "
                f"devices={self.devices}; build it with place(world_size, ...)"
            )
        if self.device_type not in ("cpu", "cuda") or self.backend not in _BACKENDS:
            raise ValueError(
                f"device_type={self.device_type!r}, backend={self.backend!r}: build the "
                "placement with place(world_size, ...)"
            )

    @property
    def virtual(self) -> bool:
        """Some ranks share one physical device (CPU processes, or ranks sharing a GPU)."""
        return len(set(self.devices)) < len(self.devices)

    def banner(self) -> str:
        """The line at the top of every lesson: what runs where, and whether it is virtual."""
        if self.n_gpus == 0:
            kind = "CPU only"
        else:
            kind = f"{self.n_gpus} GPU{'s' if self.n_gpus > 1 else ''}"
            if self.device_type == "cpu":
                kind += ", not used"
        virtual = " (virtual: one device stands in for each)" if self.virtual else ""
        return f"[{kind}] lessons use {_device_list(self.devices)}{virtual}; backend {self.backend}"

    def describe(self) -> str:
        """The line a launch prints before it starts the ranks (lesson 04a)."""
        where = "CPU processes" if self.device_type == "cpu" else "GPUs"
        if self.device_type == "cuda" and self.share_gpus:
            where = "ranks sharing GPUs"
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return (
            f"launching {ranks} as {where}, backend {self.backend}, "
            f"{self.threads_per_rank} CPU thread(s) per rank"
        )


def _device_list(devices: tuple[str, ...]) -> str:
    """Devices as a short phrase that fits a printed line: ``cpu ×2``, ``cuda:0, cuda:1``,
    ``cuda:0 … cuda:7 (8)``; used by :meth:`Placement.banner`."""
    if len(set(devices)) == 1 and len(devices) > 1:
        return f"{devices[0]} ×{len(devices)}"
    if len(devices) > 4:
        return f"{devices[0]} … {devices[-1]} ({len(devices)})"
    return ", ".join(devices)


def usable_cpus() -> int:
    """The CPU cores this process may run on: its affinity (taskset, SLURM's --cpus-per-task,
    a container's cpuset), not every core of the machine; ``os.cpu_count()`` where the system
    has no affinity (macOS, Windows)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def place(
    world_size: int,
    device: str = "auto",
    *,
    share_gpus: bool = False,
    backend: str | None = None,
    n_gpus: int | None = None,
    cpu_count: int | None = None,
) -> Placement:
    """Decide each rank's device and the backend; ValueError saying what to change (lesson 00).

    ``device``: "auto" (GPUs when there are any, else CPU processes), "cpu" or "cuda". With
    more ranks than GPUs, ``share_gpus=True`` puts several ranks on one GPU (rank r on
    ``cuda:{r % n_gpus}``, over gloo); without it that request is refused. ``backend`` overrides
    the choice (refused where it cannot work). ``n_gpus`` and ``cpu_count`` default to this
    machine's (the cores this process may run on, see :func:`usable_cpus`); pass them to ask
    about another machine.
    """
    if not _whole(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if device not in _DEVICES:
        raise ValueError(f"device={device!r} is unknown; choose 'auto', 'cpu' or 'cuda'")
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; choose 'gloo' or 'nccl' (or None)")
    if n_gpus is not None and (not _whole(n_gpus) or n_gpus < 0):
        raise ValueError(f"n_gpus cannot be negative or fractional, got {n_gpus!r}")
    if cpu_count is not None and (not _whole(cpu_count) or cpu_count < 1):
        raise ValueError(f"cpu_count must be a whole number >= 1, got {cpu_count!r}")
    gpus = hardware.gpu_count() if n_gpus is None else n_gpus
    cpus = usable_cpus() if cpu_count is None else cpu_count
    device_type = ("cuda" if gpus >= 1 else "cpu") if device == "auto" else device
    if device_type == "cuda" and gpus == 0:
        raise ValueError("device='cuda' but no GPU is visible; use device='cpu' or 'auto'")
    if device_type == "cuda" and world_size > gpus and not share_gpus:
        are = "is" if gpus == 1 else "are"
        raise ValueError(
            f"world_size={world_size} needs {world_size} GPUs but {gpus} {are} visible; use "
            f"world_size<={gpus}, share_gpus=True (ranks share GPUs over gloo) or "
            "device='cpu' (CPU processes)"
        )
    sharing = device_type == "cuda" and world_size > gpus
    nccl_built = "nccl" in hardware.available_backends()
    if backend == "nccl" and device_type != "cuda":
        raise ValueError("the NCCL backend needs GPUs; use backend='gloo' for CPU processes")
    if backend == "nccl" and sharing:
        raise ValueError(
            "NCCL refuses two ranks on one GPU; use backend='gloo' or world_size<=GPU count; "
            + see(4)
        )
    if backend == "nccl" and not nccl_built:
        raise ValueError("NCCL is not built into this torch; use backend='gloo' (or None)")
    notes: list[str] = []
    if device_type == "cpu":
        devices = ("cpu",) * world_size
        if gpus == 0:
            notes.append(
                "No GPU: every device is a CPU process; timings show the method, not GPU speed."
            )
        else:
            notes.append(f"device='cpu': every rank is a CPU process; the {gpus} GPU(s) idle.")
        chosen = backend or "gloo"
        threads = max(1, cpus // world_size)
    else:
        devices = tuple(f"cuda:{rank % gpus}" for rank in range(world_size))
        if sharing:
            notes.append(
                f"Only {gpus} GPU(s) for {world_size} devices: some devices share a GPU "
                "(gloo joins them, since NCCL refuses two ranks on one GPU)."
            )
        chosen = backend or ("nccl" if nccl_built and not sharing else "gloo")
        if chosen == "gloo" and backend is None and not sharing:
            notes.append("NCCL is not built into this torch; gloo is slower between GPUs.")
        threads = max(1, min(4, cpus // world_size))  # a GPU rank needs few CPU threads
    return Placement(
        world_size=world_size,
        device_type=device_type,
        devices=devices,
        backend=chosen,
        share_gpus=sharing,
        n_gpus=gpus,
        threads_per_rank=threads,
        notes=tuple(notes),
    )
