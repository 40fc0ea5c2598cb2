"""What a training script under ``torchrun`` needs besides training (lessons 07 and 11).

``scripts/train_ddp.py`` (lesson 07) and ``scripts/train_lm.py`` (lesson 11) share these: the
restart count of the job, ``--kill-at-step`` fault injection, a clean stop on Ctrl-C or SIGTERM
(torchrun passes it to every worker), the names of the files next to a snapshot, and the
command to use when a script is started without ``torchrun``.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from .dist_env import DistEnv

__all__ = [
    "STOP_SIGNALS",
    "KillOptions",
    "job_restarts",
    "maybe_die",
    "node_name",
    "on_stop_signal",
    "restart_count",
    "retries_refuse_alike",
    "sibling",
    "stop_requested",
    "torchrun_hint",
    "warn_if_store_shared",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stop_signal: list[int] = []  # the signal this process received, if any


class KillOptions(Protocol):
    """What ``maybe_die`` reads from a script's run options."""

    kill_at_step: int | None  # the global step before which a rank dies (None: never)
    kill_rank: int  # the rank that dies
    restarts: int  # the job's restarts before this attempt


def on_stop_signal(signum: int, _frame: object) -> None:
    """The handler a script installs (lesson 07): note the signal; the loop stops after its step."""
    _stop_signal.append(signum)


def stop_requested(device: torch.device) -> bool:
    """Whether any rank got a stop signal (lesson 07): a collective, so all stop at one step."""
    flag = torch.tensor([float(bool(_stop_signal))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def restart_count() -> int:
    """How many times this node's torchrun agent restarted the group before this attempt (07)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def job_restarts(env: DistEnv) -> int:
    """The job's restarts before this attempt: the largest count of any node's agent (lesson 07).

    Each agent counts only the failures it saw itself, and a restart for a new node counts
    nowhere (torch.distributed.elastic: "TE does not synchronize number of restarts between
    agents"). A node whose ranks merely waited may still say 0 after another node's rank died.
    A collective: every rank calls it and gets the same answer.
    """
    count = torch.tensor([restart_count()], device=env.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def warn_if_store_shared() -> None:
    """Say so when torchrun may restart the group on a store shared across attempts (lesson 07).

    torchrun's agent keeps one store for every attempt (unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    is 1), so keys that the dead attempt wrote (each rank's address) are still there when the
    new ranks join, and a new rank may read a dead rank's address and fail to connect.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print(
            "warning: with --max-restarts, start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
            "; otherwise a restarted group may read the dead ranks' addresses from torchrun's "
            "store and fail to connect, now and then (pytorch/pytorch#167288)"
        )


def maybe_die(env: DistEnv, run: KillOptions) -> None:
    """--kill-at-step (lessons 07, 11): on the job's first attempt only, rank --kill-rank dies of
    SIGKILL (a real process death: no exception, no cleanup), so torchrun must restart the group."""
    if env.rank == run.kill_rank and run.restarts == 0:
        print(
            f"rank {env.rank}: SIGKILL to myself after {run.kill_at_step} optimizer steps "
            "(--kill-at-step)",
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)


def retries_refuse_alike() -> str:
    """For a refusal under ``--max-restarts``: the retries will refuse too (lessons 07, 11)."""
    retries = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    return f" (torchrun's --max-restarts={retries} retries refuse alike)" if retries else ""


def sibling(path: Path, suffix: str) -> Path:
    """``snapshot.pt`` -> ``snapshot.pt.prev``: a file or folder next to a snapshot (07, 11)."""
    return path.with_name(path.name + suffix)


def node_name() -> str:
    """This machine in messages: torchrun's node rank (GROUP_RANK) and the host name (07, 11)."""
    return f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})"


def torchrun_hint(script: str | os.PathLike[str], argv: list[str], nproc: int = 2) -> str:
    """The torchrun command to use instead, for a script started without it (lessons 07, 11)."""
    where = os.path.relpath(script)
    where = shlex.quote(str(script) if where.startswith("..") else where)
    line = f"torchrun --standalone --nproc-per-node={nproc} {where} "
    return (line + " ".join(map(shlex.quote, argv))).strip()
