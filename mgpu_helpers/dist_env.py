"""Who am I in a distributed run: the one record every worker and script uses (lesson 04).

Under ``launch`` and under ``torchrun`` alike, each rank reads ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` and asks :func:`~mgpu_helpers.placement.place` for its
device and backend, so a script started by ``torchrun`` with more ranks than GPUs puts ranks on
shared GPUs over gloo (NCCL refuses two ranks on one GPU) instead of failing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .placement import place

__all__ = ["DistEnv"]


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
        (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``) are placed with ``share_gpus=True``.
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
        placement = place(local_world_size, device, share_gpus=True)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            device=torch.device(placement.devices[local_rank]),
            backend=placement.backend,
        )
