"""Who am I in a distributed run: the one record every worker and script uses (lesson 04a).

Under ``torchrun``, each rank reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE`` and asks :func:`~mgpu_helpers.placement.place` for its device and backend,
so a script started with more ranks than GPUs puts ranks on shared GPUs over gloo (NCCL refuses
two ranks on one GPU) instead of failing, and says so. Under ``launch`` the placement was
decided before the ranks started: the launcher passes each worker its ``DistEnv`` and also
exports the rank's device and backend as ``MGPU_DEVICE`` and ``MGPU_BACKEND``, which
``from_environ`` honours, so both ways give a worker the same record.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from dataclasses import dataclass
from typing import NoReturn

import torch

from .placement import place

__all__ = ["DistEnv", "exit_at_once"]


@dataclass(frozen=True)
class DistEnv:
    """Who am I in a distributed run: rank, local rank, world size, device and backend."""

    rank: int  # this process's index among all processes, 0 .. world_size-1
    local_rank: int  # its index on this machine (which GPU it drives)
    world_size: int  # number of processes in the run
    device: torch.device  # the device this process computes on
    backend: str  # torch.distributed backend: "nccl" or "gloo"

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that prints, plots and saves."""
        return self.rank == 0

    @classmethod
    def from_environ(cls, device: str = "auto") -> DistEnv:
        """Read the variables ``launch`` and ``torchrun`` set; device and backend from ``place``.

        ``device``: "auto", "cpu" or "cuda", as for :func:`place`. The ranks of this machine
        (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``) are placed with ``share_gpus=True``; local
        rank 0 warns when that puts ranks on shared GPUs over gloo. Under ``launch``, the
        launcher's ``MGPU_DEVICE`` and ``MGPU_BACKEND`` are used instead.
        """
        try:
            rank = int(os.environ["RANK"])
            world_size = int(os.environ["WORLD_SIZE"])
        except KeyError as exc:
            raise RuntimeError(
                f"{exc.args[0]} is not set: start this with mgpu_helpers.launch.launch or "
                "torchrun, or build DistEnv(rank, local_rank, world_size, device, backend)"
            ) from None
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if not 0 <= local_rank < local_world_size:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} is outside 0..LOCAL_WORLD_SIZE-1={local_world_size - 1}"
                "; set LOCAL_WORLD_SIZE to the number of ranks on this machine"
            )
        launched = os.environ.get("MGPU_DEVICE"), os.environ.get("MGPU_BACKEND")
        if all(launched):  # under launch: the placement the worker's env was built from
            where, backend = launched
            if device not in ("auto", torch.device(where).type):
                raise RuntimeError(
                    f"launch placed this rank on {where} (MGPU_DEVICE); call from_environ() "
                    f"without device={device!r}, or launch on a placement with that device"
                )
        else:
            placement = place(local_world_size, device, share_gpus=True)
            where, backend = placement.devices[local_rank], placement.backend
            if local_rank == 0 and placement.device_type == "cuda" and backend == "gloo":
                _say_once(" ".join(placement.notes))
        return cls(rank, local_rank, world_size, torch.device(where), backend)


@functools.cache
def _say_once(reason: str) -> None:
    """Warn once per process that GPU ranks talk over gloo, and why (STYLE: say which)."""
    warnings.warn(f"DistEnv.from_environ chose the gloo backend: {reason}", stacklevel=3)


def exit_at_once(code: int = 0) -> NoReturn:
    """End a worker whose run is over without Python's shutdown (the scripts of lessons 07, 11).

    After ``destroy_process_group()`` a gloo worker thread may still be letting go of the last
    collective's tensors. If Python is shutting down when that thread asks for the interpreter
    lock, the process aborts ("terminate called without an active exception", SIGABRT) after a
    run that succeeded, and torchrun reports it failed: now and then, on a busy machine. Output
    is flushed first; nothing else is left to do once the group is destroyed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
