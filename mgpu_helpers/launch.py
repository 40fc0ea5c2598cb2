"""Start a distributed run from a notebook, a script or a test (lesson 04).

``launch(worker, world_size)`` starts ``world_size`` processes through this importable module,
from a *fork server*: a fresh interpreter, started once per kernel or script like a spawned
process, that imports torch once and forks every rank from itself. So it works from a Jupyter
kernel even after earlier cells used CUDA (the server never touches CUDA), and a rank starts in
milliseconds instead of importing torch again (seconds); where there is no fork server
(Windows) the ranks are spawned. It sends ``worker`` to the children by value (cloudpickle), so
a function written in a notebook cell works too; its source travels along, so a rank's traceback
shows the failing line.
Each child gets the usual environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), joins the process group with ``dist.init_process_group`` and
calls ``worker(env, *args)`` with a :class:`DistEnv`.

The parent hosts the rendezvous store itself on a port the operating system picks (as
``torchrun``'s agent does), so launches back to back or side by side never collide. It streams
the children's output into the caller's (rank 0's lines as they are and its progress bar drawn
in place on stdout; other ranks' lines prefixed with their rank), keeps a log per rank, returns
each rank's return value, and when one rank fails it stops the others within seconds and raises
:class:`WorkerError` naming the rank that failed first and how (its traceback, or the exit code
or signal of a process that died without one), with the other ranks' errors as consequences.
Collectives that wait longer than ``timeout`` seconds fail instead of hanging.
"""

from __future__ import annotations

import datetime
import gc
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

import torch
import torch.distributed as dist

from .dist_env import DistEnv  # TEMPORARY re-export too (issue 9): import it from dist_env
from .placement import Placement, place

__all__ = ["WorkerError", "launch"]

_GRACE_SECONDS = 3.0  # how long a stopped rank gets to exit before it is killed
_POLL_SECONDS = 0.05
# After the first failure, how long to wait for the other ranks' outcome before deciding who
# failed first: a survivor's "Connection closed by peer" can arrive before the parent sees the
# exit of the rank that died.
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
    """A rank failed: which one failed first, how, and what the other ranks saw (lesson 04).

    ``rank`` is the rank that failed first and ``details`` its traceback (or, for a process that
    died without one, how it ended and the last lines of its log). ``how`` says how it failed
    ("raised an exception", "exited with code 3", "killed by SIGKILL"), ``exitcode`` is the
    process's exit code when it died without a traceback (negative: the signal's number),
    ``collective`` the torch.distributed call it was waiting in, if any, ``log`` its log file,
    ``others`` the other failed ranks' details (mostly consequences of the first failure) and
    ``finished`` the ranks that had already returned from the worker.
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
        self.rank = rank
        self.details = details
        self.how = how
        self.exitcode = exitcode
        self.collective = collective
        self.log = log
        self.others = dict(others or {})
        self.finished = tuple(finished)
        head = f"rank {rank} failed:"
        body = f"{head}\n{details}" if summary is None else f"{summary}\n{details}"
        super().__init__(body)


def plan_launch(world_size: int, device: str = "auto", **kwargs: Any) -> Placement:
    """Deprecated: use :func:`mgpu_helpers.placement.place`."""
    return place(world_size, device, **kwargs)  # TEMPORARY alias (issue 9)


LaunchPlan = Placement  # TEMPORARY alias (issue 9)


def _dumps(obj: object) -> bytes:
    """Pickle by value where needed (functions from a notebook), by reference otherwise."""
    try:
        import cloudpickle
    except ImportError:  # plain pickle still handles workers importable from a module
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


def _named_code(args: tuple, filename: str) -> types.CodeType:
    """Rebuild a code object sent by value under its own file name (see ``_pack``)."""
    return types.CodeType(*args).replace(co_filename=filename)


def _pack(obj: object) -> tuple[bytes, dict[str, list[str]]]:
    """Pickle ``obj`` like ``_dumps``, keeping the file names of functions sent by value.

    cloudpickle renames the code of every function it sends by value to ``<dynamic-code>``, so a
    traceback in a rank could not show the failing line. This keeps each code object's own file
    name and returns, beside the bytes, the source lines of the files a child cannot read (a
    notebook cell's, which IPython keeps in ``linecache`` under a made-up path).
    """
    try:
        import cloudpickle
        from cloudpickle import cloudpickle as implementation
    except ImportError:
        return pickle.dumps(obj), {}
    code_reduce = getattr(implementation, "_code_reduce", None)
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
    sources = {}
    for name in filenames:
        lines = [] if os.path.isfile(name) else linecache.getlines(name)
        if lines:  # a child reads real files itself
            sources[name] = lines
    return buffer.getvalue(), sources


def _check_worker(worker: object, args: tuple, kwargs: dict) -> tuple[bytes, dict[str, list[str]]]:
    """Pickle the worker and its arguments, or say what to pass instead (before any process)."""
    if not callable(worker):
        raise ValueError(
            f"the worker must be a function that every rank calls as worker(env, *args), got "
            f"{type(worker).__name__} {_short(worker)}; pass the function itself, for example "
            "launch(train, 2, cfg), not launch(train(...), 2)"
        )
    try:
        return _pack((worker, args, kwargs))
    except Exception as exc:
        raise ValueError(_unpicklable(worker, args, kwargs, exc)) from exc


def _short(obj: object, width: int = 60) -> str:
    text = repr(obj)
    return text if len(text) <= width else text[: width - 3] + "..."


def _kind(obj: object) -> str:
    return f"a {type(obj).__module__}.{type(obj).__qualname__}".replace("a builtins.", "a ")


def _fails_to_pickle(obj: object) -> bool:
    try:
        _pack(obj)
    except Exception:
        return True
    return False


def _unpicklable(worker: Any, args: tuple, kwargs: dict, exc: Exception) -> str:
    """Name what cannot be sent to the ranks: a captured variable or an argument."""
    name = getattr(worker, "__name__", type(worker).__name__)
    culprits = []
    if _fails_to_pickle(worker):
        target = worker.func if hasattr(worker, "func") else worker  # functools.partial
        try:
            captured = inspect.getclosurevars(target)
            variables = {**captured.globals, **captured.nonlocals}
        except TypeError:  # not a plain function (a callable object): it is the culprit
            variables = {}
        for var, value in variables.items():
            if not inspect.ismodule(value) and _fails_to_pickle(value):
                culprits.append(f"`{var}` ({_kind(value)})")
        what = f"the worker `{name}`"
        reason = f"it uses {', '.join(culprits)}, which" if culprits else "it"
    else:
        for i, value in enumerate(args, start=1):
            if _fails_to_pickle(value):
                culprits.append(f"argument {i} ({_kind(value)})")
        for key, value in kwargs.items():
            if _fails_to_pickle(value):
                culprits.append(f"argument {key}= ({_kind(value)})")
        what = f"the arguments of `{name}`"
        reason = ", ".join(culprits) if culprits else "they"
    return (
        f"launch cannot send {what} to the ranks: {reason} cannot be pickled "
        f"({type(exc).__name__}: {exc}). Each rank is a new process that receives a copy of the "
        "worker and its arguments: create locks, open files, sockets, CUDA streams and process "
        "groups inside the worker, and pass plain values (numbers, strings, paths, tensors, "
        "dataclasses) as arguments"
    )


class _Channel:
    """A child's line to the parent: its own pipe, written synchronously.

    Nothing waits in a buffer (as it would in a multiprocessing queue's feeder thread), so a
    rank that ends abruptly (``os._exit``, SIGKILL) has delivered everything it wrote before.
    Each message is a length-prefixed pickle.
    """

    header = struct.Struct("!Q")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn  # kept alive: it owns the file descriptor
        self.fd = conn.fileno()
        self.lock = threading.Lock()
        os.register_at_fork(after_in_child=self._reset)  # DataLoader workers fork from here

    def _reset(self) -> None:
        self.lock = threading.Lock()

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = self.header.pack(len(data))
        # One write for a small message (most are lines of output); no copy of a large one.
        parts = (head + data,) if len(data) < 1 << 16 else (head, data)
        with self.lock:
            try:
                for part in parts:
                    view = memoryview(part)
                    while view:
                        view = view[os.write(self.fd, view) :]
            except OSError:  # the parent is gone: the log still has everything
                pass


class _Forward:
    """A child's sys.stdout/sys.stderr: every write goes to its log and to the parent."""

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
    dist_error = getattr(dist, "DistError", ())
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
        text = str(exc)
        markers = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer")
        if (dist_error and isinstance(exc, dist_error)) or any(m in text for m in markers):
            found = ""
        exc = exc.__cause__ or exc.__context__
    return found


def _joined(env: DistEnv, timeout: float) -> dist.Store:
    """Tell the rendezvous store that this rank has finished joining the process group."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    store.set(f"mgpu/joined/{env.rank}", "1")
    return store


def _wait_until_all_joined(store: dist.Store, env: DistEnv, timeout: float) -> None:
    """Before leaving the group, wait (out of band) until every rank has finished joining it.

    A rank whose worker returns at once would otherwise tear its connections down while a slower
    rank is still connecting to it inside init_process_group, which then fails with "Connection
    closed by peer". A barrier would do it too, but would also complete a collective that another
    rank called by mistake and hide that bug; the store is outside the collectives.
    """
    keys = [f"mgpu/joined/{rank}" for rank in range(env.world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception:  # a rank that never joined has failed: the launcher reports that one
        pass


def _entry(
    rank: int,
    environ: dict[str, str],
    payload: bytes,
    sources: dict[str, list[str]],
    conn: Connection,
    spec: dict,
) -> None:
    """What each child process runs (importable, so the fork server or spawn can find it)."""
    # A rank forked from the fork server starts with the server's environment, path and folder,
    # as they were when it started: take the caller's as they are now, as spawn would.
    os.environ.clear()
    os.environ.update(spec["caller_environ"])
    os.environ.update(environ)  # this rank's RANK, WORLD_SIZE, MASTER_ADDR, ...
    sys.path[:] = spec["caller_path"]
    os.chdir(spec["caller_cwd"])
    channel = _Channel(conn)
    log = open(spec["log_dir"] / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115
    os.dup2(log.fileno(), 1)  # output from C/C++ (NCCL, gloo) lands in the log too
    os.dup2(log.fileno(), 2)
    sys.stdout = _Forward("stdout", channel, log)
    sys.stderr = _Forward("stderr", channel, log)
    for filename, lines in sources.items():  # a notebook cell's source, for the tracebacks
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    failed = False
    try:
        worker, args, kwargs = pickle.loads(payload)
        torch.set_num_threads(spec["placement"].threads_per_rank)
        placement = spec["placement"]
        env = DistEnv(
            rank,
            rank,
            placement.world_size,
            torch.device(placement.devices[rank]),
            placement.backend,
        )
        if env.device.type == "cuda":
            torch.cuda.set_device(env.device)  # make "cuda" mean this rank's GPU
        store = None
        if spec["init"]:
            dist.init_process_group(
                env.backend, timeout=datetime.timedelta(seconds=spec["timeout"])
            )
            store = _joined(env, spec["timeout"])
        result = worker(env, *args, **kwargs)
        returned_at = time.time()
        channel.send(("result", _dumps(result), returned_at))
        if store is not None:
            _wait_until_all_joined(store, env, spec["timeout"])
    except BaseException as exc:
        failed = True
        failed_at = time.time()
        details = traceback.format_exc()
        log.write(details)  # the log keeps every rank's traceback
        channel.send(("error", details, failed_at, _collective(exc)))
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group must not hide the real error
                pass
        # DDP keeps the gloo group alive in a reference cycle; collect it now, while Python is
        # fully alive, or its worker threads may abort the process at interpreter shutdown.
        gc.collect()
        log.flush()
    if failed:
        os._exit(1)  # every message was written synchronously: nothing is lost


class _Printer:
    """Shows the children's output in the parent, a whole line at a time.

    Rank 0's lines appear as they are. Its progress bar (writes that return to the line start
    with a carriage return, as tqdm's do on stderr) is drawn in place on the parent's *stdout*:
    in JupyterLab stderr is shown as error output, in red, and a bar erased there (tqdm's
    ``leave=False`` writes carriage returns and spaces) would leave empty red strips. A line
    printed while the bar is drawn takes its place and the bar is drawn again below it; an erased
    bar is overwritten by what comes next. Other ranks' lines get a ``[rank k]`` prefix, and
    their progress bars become lines on stdout. Empty stderr lines are dropped.
    """

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.partial: dict[tuple[int, str], str] = {}
        self.bar = ""  # rank 0's bar as drawn now ("" when none, or erased)
        self.width = 0  # characters on the parent's current stdout line that belong to the bar
        self.bar_stream = ""  # the stream rank 0's bar writes to

    def show(self, rank: int, stream: str, text: str) -> None:
        if not self.echo or not text:
            return
        if rank == 0:
            self._main(stream, text)
            return
        key = (rank, "progress") if "\r" in text else (rank, stream)
        buffered = self.partial.get(key, "") + text.replace("\r", "\n")
        *lines, self.partial[key] = buffered.split("\n")
        for line in lines:
            if line.strip():
                self._line(f"[rank {rank}] {line}", "stderr" if key[1] == "stderr" else "stdout")

    def _main(self, stream: str, text: str) -> None:
        text = text.replace("\x1b[A", "")  # tqdm's cursor-up between nested bars: no terminal
        key = (0, stream)
        pending = self.partial.get(key, "")
        redraw = "\r" in text.replace("\r\n", "\n")
        ends_bar = text == "\n" and not pending and self.width and stream == self.bar_stream
        if redraw or ends_bar:
            self.partial[key] = ""
            self.bar_stream = stream
            self._progress(pending + text)
            return
        *lines, self.partial[key] = (pending + text).split("\n")
        for line in lines:
            self._line(line, stream)

    def _progress(self, text: str) -> None:
        *ended, current = text.replace("\r\n", "\n").split("\n")
        for line in ended:
            shown = line.rsplit("\r", 1)[-1].rstrip()
            if shown:
                self._draw(shown)
            if self.bar:  # a frame followed by a newline stays as a line (tqdm's leave=True)
                sys.stdout.write("\n")
                self.bar, self.width = "", 0
        self._draw(current.rsplit("\r", 1)[-1].rstrip())
        sys.stdout.flush()

    def _draw(self, shown: str) -> None:
        self.bar = shown
        if shown:  # an erased bar ("") stays on screen until the next line overwrites it
            sys.stdout.write("\r" + shown + " " * (self.width - len(shown)))
            self.width = max(self.width, len(shown))

    def _line(self, line: str, stream: str) -> None:
        if stream == "stderr":
            if line.strip():
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            return
        if self.width:  # the bar's line: overwrite it, then draw the bar again below
            sys.stdout.write("\r" + line + " " * (self.width - len(line)) + "\n")
            self.width = 0
            if self.bar:
                self._draw(self.bar)
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def finish(self) -> None:
        if not self.echo:
            return
        for (rank, stream), rest in self.partial.items():
            if rest.strip():
                prefix = "" if rank == 0 else f"[rank {rank}] "
                self._line(prefix + rest, "stderr" if stream == "stderr" else "stdout")
        self.partial.clear()
        if self.width:  # the last frame stays as a line
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.bar, self.width = "", 0


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

    ``placement``: a :class:`Placement` from ``place(...)`` (what the lessons pass), or a
    number of ranks, placed with ``place(n, device, share_gpus=..., backend=...)`` (``device``
    "auto", "cpu" or "cuda"). ``timeout``: seconds a
    collective may wait before it fails. With ``init_process_group=False`` the worker joins
    the group itself (``dist.init_process_group(env.backend)``, lesson 04) and sets its own
    timeout there (``timeout=datetime.timedelta(seconds=...)``; PyTorch's default is long).
    Logs go to ``log_dir`` (default: a fresh folder under the temp directory's ``mgpu-runs``,
    which keeps the latest 20 runs). A worker that is not callable, or that cannot be pickled
    with its arguments, is refused (ValueError) before any process starts.
    """
    plan = _placement(placement, device, share_gpus, backend)
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    payload, sources = _check_worker(worker, args, kwargs)
    logs = Path(log_dir) if log_dir is not None else _new_log_dir()
    logs.mkdir(parents=True, exist_ok=True)
    if echo:
        print(f"{plan.describe()}; logs in {logs}", flush=True)
    spec = {
        "placement": plan,
        "init": init_process_group,
        "timeout": timeout,
        "log_dir": logs,
        "caller_environ": dict(os.environ),
        "caller_path": list(sys.path),
        "caller_cwd": os.getcwd(),
    }
    # The parent hosts the rendezvous store on a port the OS picks, so runs never collide;
    # TORCHELASTIC_USE_AGENT_STORE tells env:// that every rank is a client of it (torchrun's way).
    world_size = plan.world_size
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=max(timeout, 60.0)),
        wait_for_workers=False,
    )
    ctx = _start_method()
    ranks: list[_Rank] = []
    printer = _Printer(echo)
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",  # older torch releases read it in agent-store mode
        "OMP_NUM_THREADS": str(plan.threads_per_rank),  # for libraries the worker starts
    }
    try:
        for rank in range(world_size):
            # Passed as an argument, not through os.environ: two launches from two threads
            # must not see each other's variables.
            environ = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            state = _Rank(rank, read_fd, logs / f"rank{rank}.log")
            ranks.append(state)
            writer = Connection(write_fd, readable=False)
            try:
                state.proc = ctx.Process(
                    target=_entry,
                    args=(rank, environ, payload, sources, writer, spec),
                    name=f"mgpu-rank{rank}",
                )
                state.proc.start()
            finally:
                writer.close()  # the child has its own copy; the pipe ends when the child does
        _collect(ranks, printer)
        _let_exit(ranks, printer)  # every rank returned: let them clean up before any stop
    finally:
        _stop([r.proc for r in ranks if r.proc is not None])
        for state in ranks:
            try:
                _read(state, printer)  # every rank's last words, before the error is shown
            except Exception:  # a garbled message from a rank stopped mid-write: never mind
                pass
            finally:
                state.close()
        printer.finish()
        del store
    return [r.result for r in ranks]


def _placement(
    placement: Placement | int, device: str | None, share_gpus: bool | None, backend: str | None
) -> Placement:
    """The placement a launch runs on: the one given, or ``place()`` of a number of ranks."""
    if isinstance(placement, Placement):
        given = [
            f"{k}="
            for k, v in (("device", device), ("share_gpus", share_gpus), ("backend", backend))
            if v is not None
        ]
        if given:
            raise ValueError(
                f"launch(worker, placement) takes the devices and backend from the placement; "
                f"drop {', '.join(given)} or pass them to place(...)"
            )
        return placement
    return place(placement, device or "auto", share_gpus=bool(share_gpus), backend=backend)


def _start_method() -> mp.context.BaseContext:
    """The fork server, with this module (and so torch) preloaded; spawn where there is none.

    What it adds to spawn: each rank is forked from a process that has already imported torch,
    instead of importing it again (about 2 s of CPU per rank, measured on a laptop core). It
    keeps spawn's safety: the server is a fresh interpreter that never touches CUDA, so the
    caller may have used CUDA before. The server lives as long as the caller.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


@dataclass
class _Rank:
    """What the parent knows about one rank while the launch runs."""

    rank: int
    fd: int | None  # reading end of the rank's pipe
    log: Path
    proc: Any = None
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
    def settled(self) -> bool:
        return self.error is not None or self.returned_at is not None or self.exitcode is not None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _read(state: _Rank, printer: _Printer) -> None:
    """Take in whatever the rank has written so far, without waiting."""
    header = _Channel.header
    while state.fd is not None:
        try:
            chunk = os.read(state.fd, 1 << 20)
        except BlockingIOError:
            break
        if not chunk:  # every writer has gone
            state.close()
        state.buffer += chunk
        while len(state.buffer) >= header.size:
            (size,) = header.unpack_from(state.buffer)
            if len(state.buffer) < header.size + size:
                break
            message = pickle.loads(state.buffer[header.size : header.size + size])
            del state.buffer[: header.size + size]
            _handle(state, message, printer)


def _handle(state: _Rank, message: tuple, printer: _Printer) -> None:
    kind = message[0]
    if kind == "out":
        printer.show(state.rank, message[1], message[2])
    elif kind == "result":
        state.result, state.returned_at = pickle.loads(message[1]), message[2]
    elif kind == "error":
        state.error, state.failed_at, state.collective = message[1].rstrip(), *message[2:]


def _collect(ranks: list[_Rank], printer: _Printer) -> None:
    """Wait for every rank's result; raise WorkerError soon after one rank fails."""
    settle_until = None
    while not all(r.returned_at is not None for r in ranks):
        pending = [r.proc.sentinel for r in ranks if r.exitcode is None]
        wait([r.fd for r in ranks if r.fd is not None] + pending, timeout=_POLL_SECONDS)
        for state in ranks:
            _read(state, printer)
            if state.exitcode is None and state.proc.exitcode is not None:
                _read(state, printer)  # all it wrote before it ended is in the pipe now
                state.exitcode, state.exited_at = state.proc.exitcode, time.time()
        if any(r.error is not None or r.died for r in ranks):
            # Wait a moment for the others' outcome: who failed first is decided on all of it.
            if settle_until is None:
                settle_until = time.monotonic() + _SETTLE_SECONDS
            if all(r.settled for r in ranks) or time.monotonic() > settle_until:
                raise _failure(ranks)


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


def _was(how: str) -> str:
    return f"was {how}" if how.startswith("killed") else how


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").rstrip().splitlines()[-_LOG_TAIL_LINES:]
    except OSError:
        return ""
    return "\n".join(f"    {line}" for line in lines)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def _in(collective: str | None) -> str:
    return f"a collective ({collective})" if collective else "a collective"


def _lost_a_peer(error: str) -> bool:
    """Whether a traceback says its collective failed because another rank went away."""
    return any(marker in error for marker in _LOST_PEER)


def _failure(ranks: list[_Rank]) -> WorkerError:
    """Name the rank that failed first and how; the others' errors are listed as consequences.

    A rank that died without a traceback (killed, os._exit, a crash) or raised an error of its
    own outranks a rank whose collective failed (it timed out, for example), which outranks a
    rank whose collective lost its peer ("Connection closed by peer": another rank had ended).
    Within each kind, the earliest wins: the child's clock when it raised, or the parent's when
    it saw a process end.
    """
    errors = [r for r in ranks if r.error is not None]
    own = [(r.exited_at, r.rank) for r in ranks if r.died]
    own += [(r.failed_at, r.rank) for r in errors if r.collective is None]
    waited = [
        (r.failed_at, r.rank)
        for r in errors
        if r.collective is not None and not _lost_a_peer(r.error or "")
    ]
    lost = [(r.failed_at, r.rank) for r in errors if r.collective is not None]
    first = ranks[min(own or waited or lost)[1]]
    among = " first" if any(r is not first and (r.died or r.error) for r in ranks) else ""
    when = first.exited_at if first.died else first.failed_at
    finished = tuple(
        r.rank for r in ranks if r.returned_at is not None and r.returned_at <= (when or 0.0)
    )
    if first.died:
        how, cause = _how(first.exitcode)
        summary = (
            f"rank {first.rank} failed{among}: its process {_was(how)} without a Python traceback "
            f"({cause}); see its log: {first.log}"
        )
        tail = _log_tail(first.log)
        details = (
            f"{how}; the last lines of its log:\n{tail}" if tail else f"{how}; its log is empty"
        )
        exitcode = first.exitcode
    else:
        how, details, exitcode = "raised an exception", first.error or "", None
        if first.collective is not None and finished:
            done = f"rank{'s' * (len(finished) > 1)} {', '.join(map(str, finished))}"
            summary = (
                f"rank {first.rank} failed while waiting in {_in(first.collective)}: {done} "
                f"had already returned (finished the worker), so never joined it. "
                f"Every rank must call the same collectives in the same order. Its log: "
                f"{first.log}"
            )
        elif first.collective is not None:
            summary = f"rank {first.rank} failed in {_in(first.collective)}; its log: {first.log}"
        else:
            summary = f"rank {first.rank} failed{among}; its log: {first.log}"
    others: dict[int, str] = {}
    notes = []
    for r in ranks:
        if r is first:
            continue
        if r.error is not None:
            others[r.rank] = r.error
            if r.collective is not None and _lost_a_peer(r.error):
                notes.append(
                    f"rank {r.rank} failed in {_in(r.collective)} as a consequence (its peer "
                    f"had gone): {_last_line(r.error)}"
                )
            elif r.collective is not None:
                notes.append(
                    f"rank {r.rank} also failed in {_in(r.collective)}: {_last_line(r.error)}"
                )
            else:
                notes.append(f"rank {r.rank} also failed: {_last_line(r.error)}")
        elif r.died:
            other_how, _ = _how(r.exitcode)
            others[r.rank] = f"{other_how} without a Python traceback; see its log: {r.log}"
            notes.append(f"rank {r.rank} also ended: {others[r.rank]}")
        elif r.returned_at is not None:
            if r.rank not in finished or first.collective is None:
                notes.append(f"rank {r.rank} {'had already ' * (r.rank in finished)}returned")
        else:
            notes.append(f"rank {r.rank} was still running; the launcher stopped it")
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


def _let_exit(ranks: list[_Rank], printer: _Printer) -> None:
    """Wait up to the grace period for ranks that have returned to exit on their own.

    They still leave the process group and release what they hold (tqdm's semaphore, for one);
    a rank stopped in the middle of that leaves leaked resources behind.
    """
    deadline = time.monotonic() + _GRACE_SECONDS
    while time.monotonic() < deadline:
        running = [r.proc.sentinel for r in ranks if r.proc.exitcode is None]
        if not running:
            return
        wait([r.fd for r in ranks if r.fd is not None] + running, timeout=_POLL_SECONDS)
        for state in ranks:
            _read(state, printer)  # a rank blocked writing to a full pipe could not exit


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
