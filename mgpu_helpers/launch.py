"""Start a distributed run from a notebook, a script or a test (lesson 04).

``launch(worker, world_size)`` starts ``world_size`` processes with the *spawn* start method
through this importable module, so it works from a Jupyter kernel even after earlier cells used
CUDA, and it sends ``worker`` to the children by value (cloudpickle), so a function written in a
notebook cell works too. Each child gets the usual environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), joins the process group with
``dist.init_process_group`` and calls ``worker(env, *args)`` with a :class:`DistEnv`.

The parent hosts the rendezvous store itself on a port the operating system picks (as
``torchrun``'s agent does), so launches back to back or side by side never collide. It streams
the children's output into the caller's (rank 0 as is, so its progress bar draws; other ranks
prefixed with their rank), keeps a log per rank, returns each rank's return value, and when one
rank fails it stops the others within seconds and raises :class:`WorkerError` with that rank's
traceback. Collectives that wait longer than ``timeout`` seconds fail instead of hanging.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .devices import gpu_count

__all__ = ["DistEnv", "LaunchPlan", "WorkerError", "launch", "plan_launch"]

_GRACE_SECONDS = 3.0  # how long a stopped rank gets to exit before it is killed
_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class DistEnv:
    """Who am I in a distributed run: the one record every worker and script uses."""

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
    def from_environ(cls, device_type: str = "auto", backend: str | None = None) -> DistEnv:
        """Read RANK, LOCAL_RANK and WORLD_SIZE as set by ``launch`` or ``torchrun``."""
        try:
            rank = int(os.environ["RANK"])
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            world_size = int(os.environ["WORLD_SIZE"])
        except KeyError as exc:
            raise RuntimeError(
                f"{exc.args[0]} is not set: start this with mgpu_helpers.launch or torchrun"
            ) from None
        if device_type == "auto":
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if device_type == "cuda":
            device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        else:
            device = torch.device("cpu")
        if backend is None:
            backend = "nccl" if device.type == "cuda" else "gloo"
        return cls(rank, local_rank, world_size, device, backend)


@dataclass(frozen=True)
class LaunchPlan:
    """Where the ranks of a launch run and how they talk; printed before every launch."""

    world_size: int
    device_type: str  # "cpu" or "cuda"
    backend: str
    share_gpus: bool  # several ranks on one GPU
    threads_per_rank: int  # torch CPU threads per rank

    def describe(self) -> str:
        where = "CPU processes" if self.device_type == "cpu" else "GPUs"
        if self.device_type == "cuda" and self.share_gpus:
            where = "ranks sharing GPUs"
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return (
            f"launching {ranks} as {where}, backend {self.backend}, "
            f"{self.threads_per_rank} CPU thread(s) per rank"
        )


class WorkerError(RuntimeError):
    """A rank failed; carries its number and its traceback."""

    def __init__(self, rank: int, details: str) -> None:
        self.rank = rank
        self.details = details
        super().__init__(f"rank {rank} failed:\n{details}")


def plan_launch(
    world_size: int,
    device: str = "auto",
    *,
    share_gpus: bool = False,
    backend: str | None = None,
    n_gpus: int | None = None,
    cpu_count: int | None = None,
) -> LaunchPlan:
    """Check a launch request against the hardware; ValueError saying what to change."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r} is unknown; choose 'auto', 'cpu' or 'cuda'")
    gpus = gpu_count() if n_gpus is None else n_gpus
    cpus = (os.cpu_count() or 1) if cpu_count is None else cpu_count
    if device == "auto":
        device = "cuda" if gpus >= 1 and (gpus >= world_size or share_gpus) else "cpu"
        if 1 <= gpus < world_size and not share_gpus:
            raise ValueError(
                f"world_size={world_size} needs {world_size} GPUs but {gpus} are visible; use "
                f"world_size<={gpus}, share_gpus=True (ranks share GPUs over gloo) or "
                "device='cpu' (CPU processes)"
            )
    if device == "cuda":
        if gpus == 0:
            raise ValueError("device='cuda' but no GPU is visible; use device='cpu' or 'auto'")
        if world_size > gpus and not share_gpus:
            raise ValueError(
                f"world_size={world_size} needs {world_size} GPUs but {gpus} are visible; use "
                f"world_size<={gpus}, share_gpus=True (ranks share GPUs over gloo) or "
                "device='cpu' (CPU processes)"
            )
    sharing = device == "cuda" and world_size > gpus
    if backend is None:
        own_gpus = device == "cuda" and not sharing
        backend = "nccl" if own_gpus and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is unknown; choose 'gloo' or 'nccl'")
    if backend == "nccl" and device != "cuda":
        raise ValueError("the NCCL backend needs GPUs; use backend='gloo' for CPU processes")
    if backend == "nccl" and sharing:
        raise ValueError(
            "NCCL refuses two ranks on one GPU; use backend='gloo' or world_size<=GPU count"
        )
    threads = max(1, cpus // world_size) if device == "cpu" else max(1, min(4, cpus // world_size))
    return LaunchPlan(world_size, device, backend, sharing, threads)


def _dumps(obj: object) -> bytes:
    """Pickle by value where needed (functions from a notebook), by reference otherwise."""
    try:
        import cloudpickle
    except ImportError:  # plain pickle still handles workers importable from a module
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


class _Forward:
    """A child's sys.stdout/sys.stderr: every write goes to its log and to the parent."""

    def __init__(self, rank: int, stream: str, channel: Any, log: Any) -> None:
        self.rank, self.stream, self.channel, self.log = rank, stream, channel, log

    def write(self, text: str) -> int:
        if text:
            self.log.write(text)
            self.channel.put(("out", self.rank, self.stream, text))
        return len(text)

    def flush(self) -> None:
        self.log.flush()

    def isatty(self) -> bool:
        return False


def _entry(rank: int, environ: dict[str, str], payload: bytes, channel: Any, spec: dict) -> None:
    """What each child process runs (importable, so the spawn start method can find it)."""
    os.environ.update(environ)  # this rank's RANK, WORLD_SIZE, MASTER_ADDR, ...
    log = open(spec["log_dir"] / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115
    os.dup2(log.fileno(), 1)  # output from C/C++ (NCCL, gloo) lands in the log too
    os.dup2(log.fileno(), 2)
    sys.stdout = _Forward(rank, "stdout", channel, log)
    sys.stderr = _Forward(rank, "stderr", channel, log)
    failed = False
    try:
        worker, args, kwargs = pickle.loads(payload)
        torch.set_num_threads(spec["threads"])
        env = DistEnv.from_environ(spec["device_type"], spec["backend"])
        if env.device.type == "cuda":
            torch.cuda.set_device(env.device)  # make "cuda" mean this rank's GPU
        if spec["init"]:
            dist.init_process_group(
                env.backend, timeout=datetime.timedelta(seconds=spec["timeout"])
            )
        result = worker(env, *args, **kwargs)
        channel.put(("result", rank, _dumps(result)))
    except BaseException:
        failed = True
        details = traceback.format_exc()
        log.write(details)  # the log keeps every rank's traceback, the caller gets the first
        channel.put(("error", rank, details))
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group must not hide the real error
                pass
        # DDP keeps the gloo group alive in a reference cycle; collect it now, while Python is
        # fully alive, or its worker threads may abort the process at interpreter shutdown.
        gc.collect()
        sys.stdout.flush()
        log.flush()
    if failed:
        channel.close()
        channel.join_thread()  # make sure the traceback reached the parent
        os._exit(1)


class _Printer:
    """Shows the children's output in the parent, a whole line at a time.

    Rank 0's lines appear as they are; a progress-bar redraw (a write that starts with a
    carriage return) passes straight through so the bar animates in place. Other ranks' lines
    get a ``[rank k]`` prefix, and their progress bars become lines.
    """

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.partial: dict[tuple[int, str], str] = {}

    def show(self, rank: int, stream: str, text: str) -> None:
        if not self.echo:
            return
        target = sys.stdout if stream == "stdout" else sys.stderr
        key = (rank, stream)
        if rank == 0 and text.startswith("\r") and not self.partial.get(key):
            target.write(text)
            target.flush()
            return
        buffered = self.partial.get(key, "") + text
        if rank != 0:
            buffered = buffered.replace("\r", "\n")
        *lines, self.partial[key] = buffered.split("\n")
        prefix = "" if rank == 0 else f"[rank {rank}] "
        for line in lines:
            if rank == 0 or line.strip():
                target.write(f"{prefix}{line}\n")
        target.flush()

    def finish(self) -> None:
        for (rank, stream), rest in self.partial.items():
            if rest.strip() and self.echo:
                target = sys.stdout if stream == "stdout" else sys.stderr
                target.write(f"{'' if rank == 0 else f'[rank {rank}] '}{rest}\n")
        self.partial.clear()


def _new_log_dir(keep: int = 20) -> Path:
    """A fresh folder for this run's logs, under one root that keeps the latest ``keep`` runs."""
    root = Path(tempfile.gettempdir()) / "mgpu-runs"
    root.mkdir(exist_ok=True)
    runs = []
    for path in root.glob("run-*"):
        try:  # another launch (another thread or process) may be pruning at the same time
            runs.append((path.stat().st_mtime, path))
        except FileNotFoundError:
            continue
    runs.sort()
    for _, old in runs[: max(0, len(runs) - keep + 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix="run-", dir=root))


def launch(
    worker: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "auto",
    share_gpus: bool = False,
    backend: str | None = None,
    init_process_group: bool = True,
    timeout: float = 120.0,
    log_dir: str | Path | None = None,
    echo: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``worker(env, *args, **kwargs)`` on ``world_size`` ranks; returns their results.

    ``device``: "auto" (one GPU per rank when there are enough, else CPU processes), "cpu" or
    "cuda". ``share_gpus=True`` allows more ranks than GPUs (over gloo). ``timeout``: seconds a
    collective may wait before it fails. With ``init_process_group=False`` the worker joins
    the group itself (``dist.init_process_group(env.backend)``, lesson 04) and sets its own
    timeout there (``timeout=datetime.timedelta(seconds=...)``; PyTorch's default is long).
    Logs go to ``log_dir`` (default: a fresh folder under the temp directory's ``mgpu-runs``,
    which keeps the latest 20 runs).
    """
    plan = plan_launch(world_size, device, share_gpus=share_gpus, backend=backend)
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    logs = Path(log_dir) if log_dir is not None else _new_log_dir()
    logs.mkdir(parents=True, exist_ok=True)
    if echo:
        print(f"{plan.describe()}; logs in {logs}", flush=True)
    payload = _dumps((worker, args, kwargs))
    spec = {
        "device_type": plan.device_type,
        "backend": plan.backend,
        "threads": plan.threads_per_rank,
        "init": init_process_group,
        "timeout": timeout,
        "log_dir": logs,
    }
    # The parent hosts the rendezvous store on a port the OS picks, so runs never collide;
    # TORCHELASTIC_USE_AGENT_STORE tells env:// that every rank is a client of it (torchrun's way).
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=max(timeout, 60.0)),
        wait_for_workers=False,
    )
    ctx = mp.get_context("spawn")
    channel = ctx.Queue()
    procs: list[mp.process.BaseProcess] = []
    printer = _Printer(echo)
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world_size),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",  # older torch releases read it in agent-store mode
        "OMP_NUM_THREADS": str(plan.threads_per_rank),  # for libraries the worker starts
    }
    try:
        for rank in range(world_size):
            # Passed as an argument, not through os.environ: two launches from two threads
            # must not see each other's variables.
            environ = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            proc = ctx.Process(
                target=_entry, args=(rank, environ, payload, channel, spec), name=f"mgpu-rank{rank}"
            )
            proc.start()
            procs.append(proc)
        results = _collect(procs, channel, printer)
    finally:
        printer.finish()
        _stop(procs)
        channel.close()
        channel.cancel_join_thread()
        del store
    return [results[r] for r in range(world_size)]


def _collect(procs: list, channel: Any, printer: _Printer) -> dict[int, Any]:
    """Wait for every rank's result; raise WorkerError as soon as one rank fails."""
    results: dict[int, Any] = {}
    world_size = len(procs)
    while len(results) < world_size:
        try:
            message = channel.get(timeout=_POLL_SECONDS)
        except queue_module.Empty:
            for rank, proc in enumerate(procs):
                if rank not in results and proc.exitcode is not None:
                    _drain(channel, printer, results)  # its last words may still be queued
                    if rank not in results:
                        raise WorkerError(
                            rank,
                            f"the process exited with code {proc.exitcode} without a "
                            "traceback (killed, out of memory, or os._exit); see its log",
                        ) from None
            continue
        _handle(message, printer, results)
    return results


def _handle(message: tuple, printer: _Printer, results: dict[int, Any]) -> None:
    kind, rank = message[0], message[1]
    if kind == "out":
        printer.show(rank, message[2], message[3])
    elif kind == "result":
        results[rank] = pickle.loads(message[2])
    elif kind == "error":
        raise WorkerError(rank, message[2].rstrip())


def _drain(channel: Any, printer: _Printer, results: dict[int, Any]) -> None:
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            _handle(channel.get(timeout=0.1), printer, results)
        except queue_module.Empty:
            return


def _stop(procs: list) -> None:
    """Stop every child still running: terminate, wait a moment, then kill."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _GRACE_SECONDS
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
