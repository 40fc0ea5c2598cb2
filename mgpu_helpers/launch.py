"""Start a distributed run from a notebook, a script or a test (lesson 04a).

``launch(worker, placement)`` runs ``worker(env, *args)`` on every rank of a
:class:`~mgpu_helpers.placement.Placement` (or ``launch(worker, n, device=...)``) and returns
the ranks' results in rank order. PyTorch does the process work: ``torch.multiprocessing.
start_processes`` starts the ranks and its ``ProcessContext`` holds them. This module adds only
what PyTorch does not do for a notebook, each marked "Adds:" below:

- the worker travels by value (cloudpickle) with its cell's source, so a function written in a
  notebook cell works and a rank's traceback shows the failing line;
- the ranks are forked from a fork server that imported torch once and never touches CUDA, so a
  launch takes a tenth of a second and stays safe after the notebook used CUDA;
- the parent hosts the rendezvous store on a port the operating system picks, as torchrun's
  agent does, so launches back to back or side by side never collide;
- rank 0's output streams into the notebook (its progress bar drawn in place on stdout), the
  other ranks' lines are prefixed with their rank, and every rank keeps a log;
- when a rank fails, the others are stopped within seconds and :class:`WorkerError` names the
  rank that failed first and how (its traceback, or the exit code or signal of a process that
  died without one); collectives that wait longer than ``timeout`` fail instead of hanging; no
  rank outlives the call, interrupts and a killed kernel included.
"""

from __future__ import annotations

import datetime
import faulthandler
import inspect
import io
import linecache
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from .dist_env import DistEnv
from .placement import Placement, place
from .troubleshooting import see

__all__ = ["WorkerError", "launch", "start_fork_server"]

_GRACE_SECONDS = 3.0  # how long a rank gets to exit on its own before it is stopped (or killed)
_POLL_SECONDS = 0.05
# After the first failure, how long to wait for the other ranks' outcome before deciding who
# failed first: a survivor's "Connection closed by peer" can arrive before the dead rank's exit.
_SETTLE_SECONDS = 2.0
_LOG_TAIL_LINES = 12  # lines of a dead rank's log quoted in the error
# What gloo and NCCL say when the other end of a collective has gone away.
_LOST_PEER = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
)


class WorkerError(RuntimeError):
    """A rank failed: which one failed first, how, and what the other ranks saw (lesson 04a).

    ``rank`` failed first; ``details`` is its traceback (or, for a process that died without
    one, how it ended and the last lines of its log); ``how``: "raised an exception", "exited
    with code 3", "killed by SIGKILL"; ``exitcode``: the exit code of a process that died without
    a traceback (negative: the signal's number); ``collective``: the torch.distributed call it
    was waiting in, if any; ``log``: its log file; ``others``: the other failed ranks' details
    (mostly consequences); ``finished``: the ranks that had already returned from the worker.
    """

    def __init__(
        self,
        rank: int,
        details: str,
        *,
        how: str = "raised an exception",
        exitcode: int | None = None,
        collective: str | None = None,
        log: Path | None = None,
        others: dict[int, str] | None = None,
        finished: tuple[int, ...] = (),
        summary: str | None = None,
    ) -> None:
        self.rank, self.details, self.how, self.exitcode = rank, details, how, exitcode
        self.collective, self.log, self.finished = collective, log, tuple(finished)
        self.others = dict(others or {})
        super().__init__(f"{summary or f'rank {rank} failed:'}\n{details}")


def launch(
    worker: Callable[..., Any],
    placement: Placement | int,
    *args: Any,
    device: str | None = None,
    share_gpus: bool | None = None,
    backend: str | None = None,
    init_process_group: bool = True,
    timeout: float = 120.0,
    log_dir: str | Path | None = None,
    echo: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``worker(env, *args, **kwargs)`` on every rank of ``placement``; their results.

    ``placement``: a :class:`Placement` from ``place(...)`` (what the lessons pass), or a number
    of ranks, then placed with ``place(n, device or "auto", share_gpus=..., backend=...)``.
    ``timeout``: seconds a collective may wait before it fails. With
    ``init_process_group=False`` the worker joins the group itself
    (``dist.init_process_group(env.backend)``, lesson 04a) and sets its own timeout there.
    Logs go to ``log_dir`` (default: a fresh folder under the temp directory's ``mgpu-runs``,
    which keeps the latest 20 runs). A worker that is not callable, or that cannot be pickled
    with its arguments, is refused (ValueError) before any process starts.
    """
    if isinstance(placement, Placement):
        keywords = {"device=": device, "share_gpus=": share_gpus, "backend=": backend}
        if given := [name for name, value in keywords.items() if value is not None]:
            raise ValueError(
                "launch(worker, placement) takes the devices and backend from the placement; "
                f"drop {', '.join(given)} or pass them to place(...)"
            )
    else:
        placement = place(placement, device or "auto", share_gpus=bool(share_gpus), backend=backend)
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    payload, sources = _check_worker(worker, args, kwargs)
    logs = Path(log_dir) if log_dir is not None else _new_log_dir()
    logs.mkdir(parents=True, exist_ok=True)
    if echo:
        print(f"{placement.describe()}\n  logs in {logs}", flush=True)
    # Adds: the parent hosts the rendezvous store on a port the OS picks, so runs never collide;
    # TORCHELASTIC_USE_AGENT_STORE tells env:// (a worker joining by itself) that every rank is
    # a client of it, as under torchrun.
    wait_at_most = datetime.timedelta(seconds=max(timeout, 60.0))
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_at_most, wait_for_workers=False)
    # The caller's variables, path and folder go as arguments: a forked rank would otherwise
    # keep the fork server's, as they were when it started (and two launches from two threads
    # must not share os.environ).
    spec = {
        "placement": placement,
        "init": init_process_group,
        "timeout": timeout,
        "log_dir": logs,
        "path": list(sys.path),
        "cwd": os.getcwd(),
        "environ": {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "WORLD_SIZE": str(placement.world_size),
            "LOCAL_WORLD_SIZE": str(placement.world_size),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",  # older torch releases read it in agent mode
            "MGPU_BACKEND": placement.backend,  # for DistEnv.from_environ (MGPU_DEVICE: _entry)
            # Not this rank's torch threads (torch.set_num_threads in _entry sets those, and
            # the OpenMP runtime read the variable when the fork server imported torch): the
            # processes the worker starts, and libraries it loads later, read it then.
            "OMP_NUM_THREADS": str(placement.threads_per_rank),
        },
    }
    ranks = [_Rank(rank, None, logs / f"rank{rank}.log") for rank in range(placement.world_size)]
    pipes = []  # the children's ends: each rank's pipe to this process, then the lifeline
    for state in ranks:  # Adds: a pipe per rank for its output, result and traceback
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        state.fd = read_fd
        pipes.append(Connection(write_fd, readable=False))
    lifeline_r, lifeline_w = os.pipe()  # Adds: ranks end when this process dies (_watch_parent)
    pipes.append(Connection(lifeline_r, writable=False))
    printer = _Printer(echo)
    procs: list[Any] = []
    try:
        try:
            _wait_for_server(_SERVER_START_SECONDS)
            procs = torch_mp.start_processes(
                _entry,
                args=(payload, sources, pipes, spec),
                nprocs=placement.world_size,
                join=False,  # we supervise: see _supervise
                start_method=_start_method(),
            ).processes
        finally:
            for pipe in pipes:
                pipe.close()  # each rank has its own copy; a pipe ends when its rank does
        _supervise(ranks, procs, printer)
    finally:
        _stop(procs)
        os.close(lifeline_w)
        for state in ranks:
            try:
                _read(state, printer)  # every rank's last words, before the error is shown
            except Exception:  # a garbled message from a rank stopped mid-write: never mind
                pass
            state.close()
        printer.finish()
        del store
    return [r.result for r in ranks]


def _start_method() -> str:
    """The fork server, with this module (and so torch) preloaded.

    Adds to ``start_processes(start_method="spawn")``: each rank is forked from a process that
    has already imported torch instead of importing it again (seconds per rank). It keeps
    spawn's safety: the server is a fresh interpreter that never touches CUDA, so the caller may
    have used CUDA before. The server lives as long as the caller.
    """
    if "forkserver" not in mp.get_all_start_methods():
        raise RuntimeError(
            "launch needs the 'forkserver' start method (Linux, macOS); on "
            "Windows run the course in WSL2"
        )
    # torch._dynamo as well: DistributedDataParallel's constructor imports it, which costs each
    # rank about 2 s of every launch unless the server has it already (measured on 2 CPU ranks:
    # a DDP launch 1.9 s without, 0.1 s with)
    mp.get_context("forkserver").set_forkserver_preload([__name__, "torch._dynamo"])
    return "forkserver"


# Adds: the fork server starts in the background, and the first launch waits for it at most
# this long. Its start imports torch once (5-7 s on an idle 2-core laptop, more when busy).
_SERVER_START_SECONDS = 300.0
_server = {"thread": None, "ready": threading.Event(), "error": None}
_server_lock = threading.Lock()


def _nothing() -> None:
    """What the first process forked from the server runs: its start proves the server is up."""


def _start_server() -> None:
    try:
        process = mp.get_context(_start_method()).Process(target=_nothing, name="mgpu-warm-up")
        process.start()
        process.join()
    except BaseException as exc:  # reported by the launch that waits for the server
        _server["error"] = exc
    finally:
        _server["ready"].set()


def start_fork_server() -> None:
    """Start the launcher's fork server in a background thread, once (lesson 04a).

    A Jupyter kernel does this when it imports this module, so the server imports torch while
    the learner reads; the first launch then waits only for what is left of that. Elsewhere
    the first launch starts it.
    """
    with _server_lock:
        if _server["thread"] is None:
            _server["thread"] = threading.Thread(
                target=_start_server, name="mgpu-fork-server", daemon=True
            )
            _server["thread"].start()


def _wait_for_server(seconds: float) -> None:
    """Block until the fork server is up; a clear error instead of an endless wait."""
    start_fork_server()
    if not _server["ready"].wait(seconds):
        raise RuntimeError(
            f"the launcher's fork server has not started within {seconds:g} s (it imports "
            "torch once, which a busy machine slows down). Restart the kernel and run the "
            "cell again; if it happens again, run `mgpu doctor` in a terminal"
        )
    if _server["error"] is not None:
        raise RuntimeError(f"the launcher's fork server failed to start: {_server['error']}")


def _in_interactive_shell() -> bool:
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


if _in_interactive_shell():  # a notebook: start the server while the learner reads
    start_fork_server()


# --- sending the worker (Adds: by value, with its source, refused early if it cannot go) ---


def _named_code(args: tuple, filename: str) -> types.CodeType:
    """Rebuild a code object sent by value under its own file name (see ``_pack``)."""
    return types.CodeType(*args).replace(co_filename=filename)


def _pack(obj: object) -> tuple[bytes, dict[str, list[str]]]:
    """Pickle ``obj`` with cloudpickle, keeping the file names of functions sent by value.

    cloudpickle renames the code of every function it sends by value to ``<dynamic-code>``, so a
    traceback in a rank could not show the failing line. This keeps each code object's own file
    name and returns, beside the bytes, the source lines of the files a child cannot read (a
    notebook cell's, which IPython keeps in ``linecache`` under a made-up path).
    """
    code_reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None)
    filenames: set[str] = set()

    class _Pickler(cloudpickle.Pickler):
        def reducer_override(self, item: Any) -> Any:
            if isinstance(item, types.CodeType) and code_reduce is not None:
                rebuild, args = code_reduce(item)
                if rebuild is types.CodeType:  # as in cloudpickle 3; otherwise its own way
                    filenames.add(item.co_filename)
                    return _named_code, (args, item.co_filename)
            return super().reducer_override(item)

    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    sources = {name: linecache.getlines(name) for name in filenames if not os.path.isfile(name)}
    return buffer.getvalue(), {name: lines for name, lines in sources.items() if lines}


def _check_worker(worker: object, args: tuple, kwargs: dict) -> tuple[bytes, dict[str, list[str]]]:
    """Pickle the worker and its arguments, or say what to pass instead (before any process)."""
    if not callable(worker):
        shown = repr(worker)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ValueError(
            f"the worker must be a function that every rank calls as worker(env, *args), got "
            f"{type(worker).__name__} {shown}; pass the function itself, for example "
            "launch(train, 2, cfg), not launch(train(...), 2)"
        )
    try:
        return _pack((worker, args, kwargs))
    except Exception as exc:
        raise ValueError(_unpicklable(worker, args, kwargs, exc)) from exc


def _fails_to_pickle(obj: object) -> bool:
    try:
        _pack(obj)
    except Exception:
        return True
    return False


def _unpicklable(worker: Any, args: tuple, kwargs: dict, exc: Exception) -> str:
    """Name what cannot be sent to the ranks: a captured variable or an argument."""

    def kind(obj: object) -> str:
        return f"a {type(obj).__module__}.{type(obj).__qualname__}".replace("a builtins.", "a ")

    name = getattr(worker, "__name__", type(worker).__name__)
    if _fails_to_pickle(worker):
        try:  # the variables a function (or a functools.partial's function) uses
            found = inspect.getclosurevars(getattr(worker, "func", worker))
            used = {**found.globals, **found.nonlocals}
        except TypeError:  # not a plain function (a callable object): it is the culprit
            used = {}
        culprits = [
            f"`{var}` ({kind(value)})"
            for var, value in used.items()
            if not inspect.ismodule(value) and _fails_to_pickle(value)
        ]
        what = f"the worker `{name}`"
        reason = f"it uses {', '.join(culprits)}, which" if culprits else "it"
    else:
        named = [(f"argument {i}", value) for i, value in enumerate(args, start=1)]
        named += [(f"argument {key}=", value) for key, value in kwargs.items()]
        culprits = [f"{label} ({kind(value)})" for label, value in named if _fails_to_pickle(value)]
        what, reason = f"the arguments of `{name}`", ", ".join(culprits) or "they"
    return (
        f"launch cannot send {what} to the ranks: {reason} cannot be pickled "
        f"({type(exc).__name__}: {exc}). Each rank is a new process that receives a copy of the "
        "worker and its arguments: create locks, open files, sockets, CUDA streams and process "
        "groups inside the worker, and pass plain values (numbers, strings, paths, tensors, "
        f"dataclasses) as arguments; {see(1)}"
    )


# --- in each rank (Adds: output, result and traceback sent to the parent as they happen) -----


class _Channel:
    """A rank's line to the parent: its own pipe, written synchronously.

    Nothing waits in a buffer (as it would in a multiprocessing queue's feeder thread), so a
    rank that ends abruptly (``os._exit``, SIGKILL) has delivered everything it wrote before.
    Each message is a pickle framed by ``Connection.send_bytes`` (see ``_read``).
    """

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock = conn, threading.Lock()
        os.register_at_fork(after_in_child=self._reset)  # DataLoader workers fork from here

    def _reset(self) -> None:
        self.lock = threading.Lock()

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the parent is gone: the log still has everything
                pass


class _Forward:
    """A rank's sys.stdout/sys.stderr: every write goes to its log and to the parent."""

    def __init__(self, stream: str, channel: _Channel, log: Any) -> None:
        self.stream, self.channel, self.log = stream, channel, log

    def write(self, text: str) -> int:
        if text:
            self.log.write(text)
            self.log.flush()  # a partial last line must reach the file before an abrupt end
            self.channel.send(("out", self.stream, text))
        return len(text)

    def flush(self) -> None:
        self.log.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:  # fds 1 and 2 point at the log (faulthandler writes there)
        return 1 if self.stream == "stdout" else 2


def _collective(exc: BaseException | None) -> str | None:
    """The torch.distributed call an exception (or one it wraps) came from; None if none.

    "" means a communication failure whose call is unknown (for example inside DDP's backward).
    """
    seen: set[int] = set()
    found = None
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        calls = [
            frame.name
            for frame in traceback.extract_tb(exc.__traceback__)
            if "/torch/distributed/" in frame.filename.replace("\\", "/")
        ]
        public = [name for name in calls if not name.startswith("_") and name != "wrapper"]
        if calls:  # the innermost public call, e.g. barrier, all_reduce, init_process_group
            return (public or calls)[-1]
        if isinstance(exc, getattr(dist, "DistError", ())) or any(
            marker in str(exc) for marker in ("gloo", "NCCL", *_LOST_PEER[:2])
        ):
            found = ""
        exc = exc.__cause__ or exc.__context__
    return found


def _watch_parent(lifeline: Connection) -> None:
    """End this rank when the launching process dies, even by SIGKILL (a restarted kernel).

    Adds: torch's ``start_processes`` asks the kernel to signal a rank when its parent dies
    (``PR_SET_PDEATHSIG``), but a rank's parent is the fork server, which outlives the caller.
    The caller holds the only write end of the lifeline; its death closes it, and the read below
    returns.
    """

    def watch() -> None:
        try:
            lifeline.recv_bytes()  # nothing is ever sent: this returns at end of file
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="mgpu-lifeline", daemon=True).start()


def _entry(rank: int, payload: bytes, sources: dict, pipes: list[Connection], spec: dict) -> None:
    """What each rank runs, called by torch's ``start_processes`` as ``_entry(rank, ...)``.

    ``pipes``: each rank's pipe to the parent, then the lifeline (see ``_watch_parent``).
    """
    *writers, lifeline = pipes
    _watch_parent(lifeline)
    channel = _Channel(writers[rank])
    for other in writers:
        if other is not writers[rank]:
            other.close()  # only the parent may hold the other ranks' pipes open
    placement: Placement = spec["placement"]
    device = torch.device(placement.devices[rank])
    os.environ.clear()
    os.environ.update(
        spec["environ"], RANK=str(rank), LOCAL_RANK=str(rank), MGPU_DEVICE=str(device)
    )
    sys.path[:] = spec["path"]
    os.chdir(spec["cwd"])
    log = open(spec["log_dir"] / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115
    os.dup2(log.fileno(), 1)  # output from C/C++ (NCCL, gloo) lands in the log too
    os.dup2(log.fileno(), 2)
    sys.stdout = _Forward("stdout", channel, log)
    sys.stderr = _Forward("stderr", channel, log)
    # Adds: `kill -USR1 <pid>` writes every thread's Python stack to the rank's log, at any
    # time, even in a collective that never returns (the course runner's hang report uses it).
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True, chain=False)
    for filename, lines in sources.items():  # a notebook cell's source, for the tracebacks
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    timeout = datetime.timedelta(seconds=spec["timeout"])
    failed = False
    try:
        # torch.distributed read TORCH_DISTRIBUTED_DEBUG when the fork server imported it: read
        # the caller's value again. (Variables torch reads only at import, such as
        # TORCH_CPP_LOG_LEVEL, keep the server's values: restart the kernel to change them.)
        dist.set_debug_level_from_env()
        worker, args, kwargs = pickle.loads(payload)
        torch.set_num_threads(placement.threads_per_rank)
        env = DistEnv(rank, rank, placement.world_size, device, placement.backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # "cuda" means this rank's GPU; before NCCL starts
        store = None
        if spec["init"]:
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timeout
            )
            dist.init_process_group(
                env.backend, store=store, rank=rank, world_size=env.world_size, timeout=timeout
            )
            store.set(f"mgpu/joined/{rank}", "1")
        result = worker(env, *args, **kwargs)
        channel.send(("result", cloudpickle.dumps(result), time.time()))
        if store is not None:
            # Adds: leave the group only once every rank has finished joining it. A rank whose
            # worker returns at once would otherwise close its connections while a slower rank
            # is still connecting ("Connection closed by peer"). A barrier would also complete a
            # collective that another rank called by mistake and hide that bug.
            try:
                store.wait([f"mgpu/joined/{r}" for r in range(env.world_size)], timeout)
            except Exception:  # a rank that never joined has failed: that one is reported
                pass
    except BaseException as exc:
        failed = True
        details = traceback.format_exc()
        log.write(details)  # the log keeps every rank's traceback
        channel.send(("error", details, time.time(), _collective(exc)))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group must not hide the real error
                pass
        log.flush()
    if failed:  # end now: its threads and child processes are not waited for
        os._exit(1)


# --- in the parent (Adds: streaming while supervising, attribution, a bounded stop) ---------


@dataclass
class _Rank:
    """What the parent knows about one rank while the launch runs."""

    rank: int
    fd: int | None  # reading end of the rank's pipe
    log: Path
    buffer: bytearray = field(default_factory=bytearray)
    result: Any = None
    returned_at: float | None = None  # when the worker returned (time.time() in the child)
    error: str | None = None  # its traceback
    failed_at: float | None = None
    collective: str | None = None  # the torch.distributed call it failed in ("" unknown)
    exitcode: int | None = None
    exited_at: float | None = None  # when the parent saw the process end

    @property
    def died(self) -> bool:
        """Ended without a result and without a traceback (os._exit, a signal, a crash)."""
        return self.exitcode is not None and self.error is None and self.returned_at is None

    @property
    def settled(self) -> bool:  # its outcome is known
        return self.error is not None or self.returned_at is not None or self.exitcode is not None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _read(state: _Rank, printer: _Printer) -> None:
    """Take in whatever the rank has written so far, without waiting.

    The framing is ``Connection.send_bytes``'s: a 4-byte signed size, or -1 and an 8-byte size.
    """
    while state.fd is not None:
        try:
            chunk = os.read(state.fd, 1 << 20)
        except BlockingIOError:
            break
        if not chunk:  # every writer has gone
            state.close()
        state.buffer += chunk
        while len(state.buffer) >= 4:
            (size,), start = struct.unpack_from("!i", state.buffer), 4
            if size == -1 and len(state.buffer) >= 12:
                (size,), start = struct.unpack_from("!Q", state.buffer, 4), 12
            if size == -1 or len(state.buffer) < start + size:
                break
            kind, *message = pickle.loads(state.buffer[start : start + size])
            del state.buffer[: start + size]
            if kind == "out":
                printer.show(state.rank, *message)
            elif kind == "result":
                state.result, state.returned_at = pickle.loads(message[0]), message[1]
            else:
                state.error, state.failed_at, state.collective = message[0].rstrip(), *message[1:]


def _supervise(ranks: list[_Rank], procs: list[Any], printer: _Printer) -> None:
    """Stream the ranks' output until all have returned and exited; WorkerError on a failure.

    Why not ``ProcessContext.join``: it waits for process exits only, so it would neither stream
    output while it waits nor notice a rank that reported its error and then hangs in cleanup;
    on a failure it blames whichever exit it happens to see first and, during its grace period,
    reads nothing, so a rank still printing blocks on its full pipe.
    """
    failure_seen = returned = None
    while True:
        live = [p.sentinel for p in procs if p.exitcode is None]
        wait([r.fd for r in ranks if r.fd is not None] + live, timeout=_POLL_SECONDS)
        for state, proc in zip(ranks, procs, strict=True):
            _read(state, printer)
            if state.exitcode is None and proc.exitcode is not None:
                _read(state, printer)  # all it wrote before it ended is in the pipe now
                state.exitcode, state.exited_at = proc.exitcode, time.time()
        now = time.monotonic()
        if any(r.error is not None or r.died for r in ranks):
            # Wait a moment for the others' outcome: who failed first is decided on all of it.
            failure_seen = failure_seen or now
            if all(r.settled for r in ranks) or now - failure_seen > _SETTLE_SECONDS:
                raise _failure(ranks)
        elif all(r.returned_at is not None for r in ranks):
            # Every rank returned: let them leave the group and release what they hold (a rank
            # stopped in the middle of that leaks semaphores), then stop any that hangs.
            returned = returned or now
            if all(r.exitcode is not None for r in ranks) or now - returned > _GRACE_SECONDS:
                return


def _stop(procs: list[Any]) -> None:
    """Stop every rank still running: terminate, wait up to the grace period, then kill.

    ``ProcessContext`` only stops the others after a failed exit; a launch also stops its ranks
    after an interrupt (KeyboardInterrupt), an error in the parent, or a rank that hangs.
    """
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _GRACE_SECONDS
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


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
    for _, old in sorted(runs)[: max(0, len(runs) - keep + 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix="run-", dir=root))


class _Printer:
    """Adds: the ranks' output shown in the parent as a notebook cell would, whole lines only.

    Rank 0's lines appear as they are. Its progress bar (a write with a carriage return, as
    tqdm's on stderr) is drawn in place on *stdout*: JupyterLab shows stderr in red, and a bar
    erased there (tqdm's ``leave=False``) would leave empty red strips. A line printed under the
    bar takes its place and the bar is drawn again below it. Other ranks' lines get a
    ``[rank k]`` prefix, and their progress bars become lines. Empty stderr lines are dropped.
    """

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.partial: dict[tuple[int, str], str] = {}  # (rank, stream): its unfinished line
        self.bar = ""  # rank 0's bar as drawn now ("" when none, or erased)
        self.width = 0  # characters on the current stdout line that belong to the bar
        self.bar_stream = ""  # the stream rank 0's bar writes to

    def show(self, rank: int, stream: str, text: str) -> None:
        if not self.echo or not text:
            return
        key, text = (rank, stream), text.replace("\r\n", "\n")
        if rank and "\r" in text:  # another rank's bar: each frame a line
            key, text = (rank, "progress"), text.replace("\r", "\n")
        elif not rank:
            text = text.replace("\x1b[A", "")  # tqdm's cursor-up between nested bars
            closes_bar = text == "\n" and not self.partial.get(key) and stream == self.bar_stream
            if "\r" in text or (closes_bar and self.width):
                self.bar_stream = stream
                self._progress(self.partial.pop(key, "") + text)
                return
        *lines, self.partial[key] = (self.partial.get(key, "") + text).split("\n")
        for line in lines:
            if not rank or line.strip():
                self._line(f"[rank {rank}] " * (rank > 0) + line, key[1])

    def _progress(self, text: str) -> None:
        *ended, current = text.split("\n")
        for line in ended:
            if line.rsplit("\r", 1)[-1].rstrip():
                self._draw(line.rsplit("\r", 1)[-1].rstrip())
            if self.bar:  # a frame followed by a newline stays as a line (tqdm's leave=True)
                sys.stdout.write("\n")
                self.bar, self.width = "", 0
        self._draw(current.rsplit("\r", 1)[-1].rstrip())
        sys.stdout.flush()

    def _draw(self, shown: str) -> None:
        self.bar = shown
        if shown:  # an erased bar ("") stays on screen until the next line overwrites it
            sys.stdout.write("\r" + shown.ljust(self.width))
            self.width = max(self.width, len(shown))

    def _line(self, line: str, stream: str) -> None:
        if stream == "stderr":
            if line.strip():
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            return
        # On the bar's line: overwrite it, then draw the bar again below.
        sys.stdout.write("\r" * (self.width > 0) + line.ljust(self.width) + "\n")
        self.width = 0
        if self.bar:
            self._draw(self.bar)
        sys.stdout.flush()

    def finish(self) -> None:
        if not self.echo:
            return
        for (rank, stream), rest in self.partial.items():
            if rest.strip():
                self._line(f"[rank {rank}] " * (rank > 0) + rest, stream)
        self.partial.clear()
        if self.width:  # the last frame stays as a line
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.bar, self.width = "", 0


# --- who failed first (Adds: attribution over every rank's outcome, not the first exit seen) --


# Lesson 10's entry on each signal, where one explains it (see mgpu_helpers.troubleshooting).
_SIGNAL_ENTRIES = {"SIGKILL": 5, "SIGABRT": 8, "SIGBUS": 20}
_SIGNAL_CAUSES = {
    "SIGKILL": "the out-of-memory killer sends SIGKILL, and so does `kill -9`",
    "SIGSEGV": "a crash in C/C++ code",
    "SIGBUS": "a crash in C/C++ code, or shared memory (/dev/shm) running out",
    "SIGABRT": "an abort in C/C++ code, for example NCCL's watchdog after a collective timed out",
    "SIGTERM": "something outside the launcher stopped it",
}


def _how(exitcode: int) -> tuple[str, str]:
    """How a process that left no traceback ended, and what usually causes that."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}", _SIGNAL_CAUSES.get(name, "a signal from outside")
    if exitcode == 0:
        return "exited with code 0 before returning", "os._exit(0) or sys.exit() in C code"
    return f"exited with code {exitcode}", "os._exit(), a library calling exit(), or a crash"


def _within(collective: str) -> str:
    return f"a collective ({collective})" if collective else "a collective"


def _lost_a_peer(state: _Rank) -> bool:
    """Whether its collective failed because another rank went away ("closed by peer")."""
    return state.collective is not None and any(m in (state.error or "") for m in _LOST_PEER)


def _failure(ranks: list[_Rank]) -> WorkerError:
    """Name the rank that failed first and how; the others' errors are listed as consequences.

    A rank that died without a traceback or raised an error of its own outranks a rank whose
    collective failed (it timed out, for example), which outranks a rank whose collective lost
    its peer (another rank had ended). Within each kind, the earliest wins: the child's clock
    when it raised, or the parent's when it saw a process end.
    """

    def rank_of(r: _Rank) -> tuple[int, float]:
        if r.died:
            return 0, r.exited_at or 0.0
        return (0 if r.collective is None else 1 + _lost_a_peer(r)), r.failed_at or 0.0

    first = min((r for r in ranks if r.died or r.error is not None), key=rank_of)
    among = " first" if any(r is not first and (r.died or r.error) for r in ranks) else ""
    when = (first.exited_at if first.died else first.failed_at) or 0.0
    finished = tuple(r.rank for r in ranks if r.returned_at is not None and r.returned_at <= when)
    how, details, exitcode = "raised an exception", first.error or "", None
    where = "" if first.collective is None else f" in {_within(first.collective)}"
    if first.died:
        exitcode = first.exitcode
        how, cause = _how(exitcode)
        was = "was " * how.startswith("killed")
        summary = (
            f"rank {first.rank} failed{among}: its process {was}{how} without a Python "
            f"traceback ({cause}); see its log: {first.log}"
        )
        if entry := _SIGNAL_ENTRIES.get(how.removeprefix("killed by ")):
            summary += f"\n{see(entry)}"
        try:
            tail = first.log.read_text(errors="replace").rstrip().splitlines()[-_LOG_TAIL_LINES:]
        except OSError:
            tail = []
        details = f"{how}; " + ("the last lines of its log:\n" if tail else "its log is empty")
        details += "\n".join(f"    {line}" for line in tail)
    elif where and finished:
        done = f"rank{'s' * (len(finished) > 1)} {', '.join(map(str, finished))}"
        summary = (
            f"rank {first.rank} failed while waiting{where}: {done} had already returned "
            "(finished the worker), so never joined it. Every rank must call the same "
            f"collectives in the same order. Its log: {first.log}\n{see(6)}"
        )
    else:
        summary = f"rank {first.rank} failed{where or among}; its log: {first.log}"
        if where and not _lost_a_peer(first) and "timed out" in details.lower():
            summary += f"\n{see(6)}"  # a collective that waited in vain: some rank never called it
    others: dict[int, str] = {}
    notes = []
    for r in ranks:
        if r is first:
            continue
        where = "" if r.collective is None else f" in {_within(r.collective)}"
        if r.error is not None:
            others[r.rank] = r.error
            lines = [line.strip() for line in r.error.splitlines() if line.strip()]
            said = lines[-1] if lines else r.error
            if _lost_a_peer(r):
                notes.append(
                    f"rank {r.rank} failed{where} as a consequence (its peer had gone): {said}"
                )
            else:
                notes.append(f"rank {r.rank} also failed{where}: {said}")
        elif r.died:
            others[r.rank] = (
                f"{_how(r.exitcode)[0]} without a Python traceback; see its log: {r.log}"
            )
            notes.append(f"rank {r.rank} also ended: {others[r.rank]}")
        elif r.returned_at is None:
            notes.append(f"rank {r.rank} was still running; the launcher stopped it")
        elif r.rank not in finished or first.collective is None:
            notes.append(f"rank {r.rank} {'had already ' * (r.rank in finished)}returned")
    if notes:
        summary += "\nthe other ranks:\n" + "\n".join(f"  {note}" for note in notes)
    if not first.died:
        summary += f"\nrank {first.rank}'s traceback:"
    return WorkerError(
        first.rank,
        details,
        how=how,
        exitcode=exitcode,
        collective=first.collective,
        log=first.log,
        others=others,
        finished=finished,
        summary=summary,
    )
