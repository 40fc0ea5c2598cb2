"""The notebook launcher (lesson 04a), with real processes over gloo on the CPU."""

from __future__ import annotations

import os
import re
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from procs import rank_children

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import WorkerError, launch
from mgpu_helpers.placement import place, usable_cpus


def rank_sum(env: DistEnv, scale: float) -> tuple[int, int, float]:
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)  # 1 + 2 + ... + world_size on every rank
    return env.rank, env.world_size, t.item() * scale


def fails_on_rank_one(env: DistEnv) -> None:
    if env.rank == 1:
        raise ValueError(f"deliberate failure on rank 1 at {time.time()}")
    dist.barrier()  # the others wait here for rank 1, which never comes


def hangs(env: DistEnv) -> None:
    if env.rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins this collective
    else:
        time.sleep(120)


def exits_hard(env: DistEnv) -> None:
    if env.rank == 1:
        os._exit(3)
    time.sleep(120)


def identity(env: DistEnv) -> dict:
    return {
        "rank": env.rank,
        "local_rank": env.local_rank,
        "world_size": env.world_size,
        "device": str(env.device),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "is_main": env.is_main,
        "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
    }


def own_init(env: DistEnv) -> int:
    assert not dist.is_initialized()
    dist.init_process_group(env.backend)  # env:// from the variables the launcher set
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


@pytest.mark.parametrize("world_size", [2, 3])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = launch(rank_sum, world_size, 2.0, device="cpu", echo=False)
    total = world_size * (world_size + 1) / 2
    assert results == [(r, world_size, total * 2.0) for r in range(world_size)]


def test_each_rank_knows_who_it_is_and_threads_are_split() -> None:
    infos = launch(identity, 2, device="cpu", echo=False)
    assert [i["rank"] for i in infos] == [0, 1]
    assert [i["is_main"] for i in infos] == [True, False]
    assert {i["backend"] for i in infos} == {"gloo"}
    assert {i["device"] for i in infos} == {"cpu"}
    expected_threads = max(1, usable_cpus() // 2)  # the cores this process may use
    assert {i["threads"] for i in infos} == {expected_threads}
    assert infos[0]["master"] == infos[1]["master"]


def test_worker_defined_inside_a_function_is_sent_by_value() -> None:
    offset = 7  # captured: the child cannot import this closure by name

    def local_worker(env: DistEnv) -> int:
        return env.rank + offset

    assert launch(local_worker, 2, device="cpu", echo=False) == [7, 8]


def test_worker_may_join_the_group_itself() -> None:
    assert launch(own_init, 2, device="cpu", init_process_group=False, echo=False) == [2, 2]


def test_failing_rank_stops_everyone_fast_with_its_traceback() -> None:
    with pytest.raises(WorkerError) as info:
        launch(fails_on_rank_one, 3, device="cpu", echo=False)
    stopped = time.time()  # every rank is stopped when launch returns
    raised = float(re.findall(r"failure on rank 1 at (\d+\.\d+)", str(info.value))[-1])
    assert stopped - raised < 10, f"took {stopped - raised:.1f} s from the error to the stop"
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)
    assert "fails_on_rank_one" in info.value.details  # the traceback, not just the message
    assert rank_children() == []


def test_a_hung_collective_becomes_an_error() -> None:
    with pytest.raises(WorkerError) as info:
        launch(hangs, 2, device="cpu", timeout=3, echo=False)
    assert info.value.rank == 0
    assert rank_children() == []


def test_a_rank_that_dies_without_a_traceback_is_reported() -> None:
    with pytest.raises(WorkerError, match="exited with code 3") as info:
        launch(exits_hard, 2, device="cpu", echo=False)
    assert info.value.rank == 1
    assert rank_children() == []


def test_back_to_back_and_concurrent_launches_do_not_collide() -> None:
    for _ in range(2):  # back to back
        assert launch(rank_sum, 2, 1.0, device="cpu", echo=False) == [(0, 2, 3.0), (1, 2, 3.0)]
    outcomes: dict[int, object] = {}

    def run(slot: int) -> None:
        try:
            outcomes[slot] = launch(rank_sum, 2, float(slot), device="cpu", echo=False)
        except Exception as exc:  # reported below
            outcomes[slot] = exc

    threads = [threading.Thread(target=run, args=(slot,)) for slot in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert outcomes == {1: [(0, 2, 3.0), (1, 2, 3.0)], 2: [(0, 2, 6.0), (1, 2, 6.0)]}
    assert rank_children() == []


def test_output_is_streamed_with_rank_prefixes_and_logged(capsys, tmp_path) -> None:
    def chatty(env: DistEnv) -> None:
        print(f"hello from rank {env.rank}")

    launch(chatty, 2, device="cpu", log_dir=tmp_path)
    out = capsys.readouterr().out
    assert "hello from rank 0" in out
    assert "[rank 1] hello from rank 1" in out
    assert "launching 2 ranks as CPU processes, backend gloo" in out
    assert "hello from rank 1" in (tmp_path / "rank1.log").read_text()


def debug_level(env: DistEnv) -> str:
    return dist.get_debug_level().name


def test_the_callers_torch_distributed_debug_reaches_the_ranks(monkeypatch) -> None:
    """torch.distributed reads TORCH_DISTRIBUTED_DEBUG once, at import: in the fork server."""
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    assert launch(debug_level, 2, device="cpu", echo=False) == ["OFF", "OFF"]  # server started
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # set later, as in a notebook cell
    assert launch(debug_level, 2, device="cpu", echo=False) == ["DETAIL", "DETAIL"]


def both_records(env: DistEnv) -> tuple[DistEnv, DistEnv, str]:
    """The env the launcher passed and the one from_environ() reads, as on a 2-GPU machine."""
    import importlib

    devices = importlib.import_module("mgpu_helpers.devices")  # patched in this rank only
    devices.gpu_count = lambda: 2
    devices.available_backends = lambda: ("gloo", "nccl")
    try:
        DistEnv.from_environ("cuda")
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return env, DistEnv.from_environ(), refused


def test_from_environ_inside_a_launch_agrees_with_the_workers_env() -> None:
    for env, read, refused in launch(both_records, 2, device="cpu", echo=False):
        assert read == env and env.device == torch.device("cpu") and env.backend == "gloo"
        assert "launch placed this rank on cpu" in refused


def test_launch_takes_a_placement() -> None:
    placement = place(3, "cpu")
    assert launch(rank_sum, placement, 1.0, echo=False) == [(r, 3, 6.0) for r in range(3)]
    infos = launch(identity, place(2, "cpu", cpu_count=2), echo=False)
    assert {i["threads"] for i in infos} == {1}  # the placement's threads, not this machine's


def test_launch_refuses_a_placement_with_placement_keywords() -> None:
    with pytest.raises(ValueError, match=r"drop device=, share_gpus= or pass them to place"):
        launch(rank_sum, place(2, "cpu"), 1.0, device="cpu", share_gpus=True, echo=False)
    assert rank_children() == []


def test_a_worker_that_is_not_callable_is_refused_before_anything_starts(capsys) -> None:
    with pytest.raises(ValueError, match="pass the function itself"):
        launch(sum([1.0, 2.0]), 2, device="cpu")  # a function's result instead of the function
    assert "launching" not in capsys.readouterr().out
    assert rank_children() == []


def test_a_worker_that_cannot_be_pickled_is_refused_saying_what_to_pass(tmp_path, capsys) -> None:
    lock = threading.Lock()
    with pytest.raises(ValueError, match=r"uses `lock` \(a _thread.lock\).*inside the worker"):
        launch(lambda env: lock.locked(), 2, device="cpu")
    with open(tmp_path / "notes.txt", "w") as handle:
        with pytest.raises(ValueError, match=r"uses `handle` \(a _io.TextIOWrapper\)"):
            launch(lambda env: handle.write(str(env.rank)), 2, device="cpu")
    refusal = r"argument 1 \(a _thread.lock\).*plain values .*; see lesson 10b .*, entry 1: "
    with pytest.raises(ValueError, match=refusal):
        launch(rank_sum, 2, threading.Lock(), device="cpu")
    assert "launching" not in capsys.readouterr().out
    assert rank_children() == []


def test_launch_rejects_bad_requests_before_starting_anything() -> None:
    with pytest.raises(ValueError, match="timeout"):
        launch(rank_sum, 2, 1.0, device="cpu", timeout=0, echo=False)
    with pytest.raises(ValueError, match="world_size"):
        launch(rank_sum, 0, 1.0, echo=False)
    assert rank_children() == []


@pytest.mark.multigpu
def test_one_gpu_per_rank_over_nccl() -> None:
    infos = launch(identity, 2, device="cuda", echo=False)
    assert [i["device"] for i in infos] == ["cuda:0", "cuda:1"]
    assert {i["backend"] for i in infos} == {"nccl"}


@pytest.mark.gpu
def test_ranks_sharing_one_gpu_over_gloo() -> None:
    infos = launch(identity, 2, device="cuda", share_gpus=True, echo=False)
    assert {i["backend"] for i in infos} == {"gloo"}
    assert all(i["device"].startswith("cuda:") for i in infos)


class RecordedWrites:
    """A text stream that keeps each write, as a rank's redirected sys.stderr receives them."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def screen(text: str) -> list[str]:
    """The lines a terminal or JupyterLab shows: a carriage return goes back to the line start
    and what follows overwrites the line from there."""
    shown = []
    for raw in text.split("\n"):
        line = ""
        for part in raw.split("\r"):
            line = part + line[len(part) :]
        shown.append(line.rstrip())
    return shown[:-1] if shown and shown[-1] == "" else shown


def test_printer_keeps_lines_whole_and_lets_progress_bars_redraw(capsys) -> None:
    from mgpu_helpers.launch import _Printer

    printer = _Printer(echo=True)
    printer.show(0, "stdout", "epoch 0 done")
    printer.show(1, "stdout", "epoch 0 done on one\n")
    printer.show(0, "stdout", "\n")
    printer.show(0, "stderr", "\r 50%|#####     |")
    printer.show(1, "stderr", "\r 50%|#####     |")
    printer.show(1, "stdout", "unfinished")
    printer.finish()
    captured = capsys.readouterr()
    assert "\r 50%|#####     |" in captured.out  # rank 0's bar is drawn in place
    assert screen(captured.out) == [
        "[rank 1] epoch 0 done on one",
        "epoch 0 done",
        "[rank 1] unfinished",
        "[rank 1]  50%|#####     |",  # other ranks' bars become lines
        " 50%|#####     |",  # rank 0's last frame stays as a line
    ]
    assert captured.err == ""  # progress is not error output


def test_rank0_progress_bar_is_drawn_on_stdout_without_empty_strips(capsys) -> None:
    """Lesson 04b's training launch: a tqdm bar per epoch (leave=False), then a printed line.

    JupyterLab shows stderr in red; a bar erased there left empty red strips between the lines.
    """
    from tqdm import tqdm

    from mgpu_helpers.launch import _Printer

    printer = _Printer(echo=True)
    bar_output = RecordedWrites()
    for epoch in (1, 2):
        bar = tqdm(total=4, desc=f"epoch {epoch}", leave=False, file=bar_output, mininterval=0)
        for _ in range(4):
            bar.update()
        bar.close()  # leave=False: carriage returns and spaces erase the bar
        for text in bar_output.writes:
            printer.show(0, "stderr", text)
        bar_output.writes.clear()
        printer.show(0, "stdout", f"epoch {epoch}: loss 0.5\n")
    printer.show(0, "stderr", "train.py:3: UserWarning: a real warning\n")
    printer.show(0, "stderr", "\n")
    printer.finish()
    captured = capsys.readouterr()
    assert captured.err == "train.py:3: UserWarning: a real warning\n"  # only real errors
    assert "\repoch 2: 100%" in captured.out  # the bar was drawn, in place
    assert screen(captured.out) == ["epoch 1: loss 0.5", "epoch 2: loss 0.5"]


def test_a_line_printed_under_a_running_bar_takes_its_place(capsys) -> None:
    from mgpu_helpers.launch import _Printer

    printer = _Printer(echo=True)
    printer.show(0, "stderr", "\r 50%|#####     | 1/2")
    printer.show(0, "stdout", "halfway\n")
    printer.show(0, "stderr", "\r100%|##########| 2/2")
    printer.show(0, "stderr", "\n")  # tqdm's close with leave=True: the bar stays as a line
    printer.show(0, "stdout", "done\n")
    printer.finish()
    captured = capsys.readouterr()
    assert captured.err == ""
    assert screen(captured.out) == ["halfway", "100%|##########| 2/2", "done"]


def test_a_failing_rank_leaves_its_traceback_in_its_log(tmp_path) -> None:
    with pytest.raises(WorkerError):
        launch(fails_on_rank_one, 2, device="cpu", log_dir=tmp_path, echo=False)
    assert "deliberate failure on rank 1" in (tmp_path / "rank1.log").read_text()


INTERRUPTED_SCRIPT = """
import os, sys, time
from mgpu_helpers.launch import launch

def worker(env, folder):
    with open(os.path.join(folder, f"pid{env.rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    try:
        launch(worker, 2, sys.argv[1], device="cpu", echo=False)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


def _signal_the_caller_once_ranks_run(tmp_path, sig: int) -> tuple[list[int], str]:
    """Run INTERRUPTED_SCRIPT, send ``sig`` to it once both ranks are up: (rank pids, stdout)."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(INTERRUPTED_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the ranks never started"
            assert proc.poll() is None, "the launching process died early"
            time.sleep(0.2)
        time.sleep(0.5)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return pids, out


def test_interrupting_the_caller_stops_every_rank(tmp_path) -> None:
    """What happens when a learner interrupts the kernel: SIGINT reaches the launching process."""
    import signal

    pids, out = _signal_the_caller_once_ranks_run(tmp_path, signal.SIGINT)
    assert "interrupted" in out
    for pid in pids:
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert not alive, f"rank process {pid} survived the interrupt"


def test_killing_the_caller_outright_stops_every_rank(tmp_path) -> None:
    """A kernel restarted or killed with SIGKILL runs no cleanup: the ranks must end anyway."""
    import signal

    pids, _ = _signal_the_caller_once_ranks_run(tmp_path, signal.SIGKILL)

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)], "rank processes outlived the killed caller"


def test_log_folders_are_pruned_safely_while_others_prune_too(tmp_path, monkeypatch) -> None:
    from mgpu_helpers import launch as launch_module

    monkeypatch.setattr(launch_module.tempfile, "gettempdir", lambda: str(tmp_path))
    errors: list[BaseException] = []

    def make_many() -> None:
        try:
            for _ in range(40):
                launch_module._new_log_dir(keep=3)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=make_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(list((tmp_path / "mgpu-runs").glob("run-*"))) <= 3 + len(threads)


# --- the fork server's start: in the background in a notebook, and bounded -------------------

_SERVER_PROBE = """
import sys
if sys.argv[1] == "shell":
    from IPython.core.interactiveshell import InteractiveShell
    InteractiveShell.instance()  # what a Jupyter kernel has: get_ipython() answers
import multiprocessing.forkserver as forkserver
import mgpu_helpers.launch as launcher
started = launcher._server["thread"] is not None
ready = launcher._server["ready"].wait(120) if started else False
print(started, ready, launcher._server["error"], forkserver._forkserver._forkserver_pid is not None)
"""


@pytest.mark.parametrize("where", ["shell", "script"])
def test_a_notebook_starts_the_fork_server_as_it_imports_the_launcher(where: str) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _SERVER_PROBE, where], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    if where == "shell":  # started in the background, and up
        assert done.stdout.split() == ["True", "True", "None", "True"], done.stdout
    else:  # a script or a test starts it at its first launch
        assert done.stdout.split() == ["False", "False", "None", "False"], done.stdout


def test_a_fork_server_that_never_starts_is_an_error_not_an_endless_wait(monkeypatch) -> None:
    from mgpu_helpers import launch as launcher

    stuck = {"thread": threading.current_thread(), "ready": threading.Event(), "error": None}
    monkeypatch.setattr(launcher, "_server", stuck)  # started, never ready
    monkeypatch.setattr(launcher, "_SERVER_START_SECONDS", 0.3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"fork server has not started within 0.3 s.*Restart"):
        launch(rank_sum, 2, 1.0, device="cpu", echo=False)
    assert time.monotonic() - start < 5
    assert rank_children() == []
    failed = {"thread": threading.current_thread(), "ready": threading.Event(), "error": None}
    failed["ready"].set()
    failed["error"] = OSError("no fork server here")
    monkeypatch.setattr(launcher, "_server", failed)
    with pytest.raises(RuntimeError, match="fork server failed to start: no fork server here"):
        launch(rank_sum, 2, 1.0, device="cpu", echo=False)
