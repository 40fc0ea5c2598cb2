"""Fault drills for the launcher (lesson 04a): who failed first, last words, tracebacks.

Each scenario runs several times in a row: an attribution that depends on which message happens
to reach the parent first would show here as a failure in some of the runs.
"""

from __future__ import annotations

import linecache
import os
import re
import signal

import pytest
import torch.distributed as dist
from procs import rank_children

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import WorkerError, launch

REPEATS = 3
LINES = 300  # enough output that some of it is still in flight when the rank dies


def dies_in_a_collective(env: DistEnv, how: str) -> None:
    """Rank 1 prints, then ends without a traceback while rank 0 waits for it in a barrier."""
    if env.rank == 1:
        for i in range(LINES):
            print(f"line {i + 1} of {LINES}")
        print("last words, no newline", end="")
        if how == "exit":
            os._exit(7)
        if how == "bus":  # what touching a full /dev/shm does to a process
            os.kill(os.getpid(), signal.SIGBUS)
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does
    dist.barrier()


def returns_while_rank_0_waits(env: DistEnv) -> int:
    if env.rank == 0:
        dist.barrier()  # WRONG: only rank 0 calls it; rank 1 has returned
    return env.rank


@pytest.mark.parametrize(
    ("how", "exitcode", "described"),
    [
        ("exit", 7, "exited with code 7"),
        ("kill", -9, "was killed by SIGKILL"),
        ("bus", -7, "was killed by SIGBUS"),
    ],
)
def test_a_rank_that_dies_in_a_collective_is_named_with_its_exit(
    how: str, exitcode: int, described: str, capsys, tmp_path
) -> None:
    for attempt in range(REPEATS):
        logs = tmp_path / f"run{attempt}"
        with pytest.raises(WorkerError) as info:
            launch(dies_in_a_collective, 2, how, device="cpu", log_dir=logs)
        error, message = info.value, str(info.value)
        assert error.rank == 1, f"run {attempt + 1}: blamed rank {error.rank}:\n{message}"
        assert error.exitcode == exitcode
        assert re.match(f"rank 1 failed( first)?: its process {described}", message)
        assert f"see its log: {logs / 'rank1.log'}" in message  # the path, not just "its log"
        assert error.log == logs / "rank1.log"
        assert "last words, no newline" in error.details  # the tail of its log
        # SIGKILL points to the entry on a killed rank, SIGBUS to /dev/shm's; an exit code to none
        assert ("entry 5: a rank killed (out of host memory)" in message) == (how == "kill")
        assert ("entry 20: `/dev/shm` too small in a container" in message) == (how == "bus")
        assert "\n  rank 0 " in message  # what the survivor saw comes as a consequence
        out = capsys.readouterr().out
        # Its last lines before the abrupt end reached the notebook, not only its log.
        assert f"[rank 1] line {LINES} of {LINES}\n" in out, f"run {attempt + 1}"
        assert "[rank 1] last words, no newline" in out, f"run {attempt + 1}"
        assert rank_children() == []


def test_a_rank_that_returned_while_another_waits_in_a_collective_is_named() -> None:
    for attempt in range(REPEATS):
        with pytest.raises(WorkerError) as info:
            launch(returns_while_rank_0_waits, 2, device="cpu", echo=False)
        error, message = info.value, str(info.value)
        assert error.rank == 0, f"run {attempt + 1}: blamed rank {error.rank}:\n{message}"
        assert error.finished == (1,)
        assert error.collective == "barrier"
        assert "rank 0 failed while waiting in a collective (barrier)" in message
        assert "rank 1 had already returned" in message
        pointer = "lesson 10b (notebooks/10b_processes_and_hangs.ipynb), entry 6: a collective"
        assert pointer in message
        assert str(error.log) in message and error.log.name == "rank0.log"  # also with echo=False
    assert rank_children() == []


CELL = """\
import os

def cell_worker(env):
    if env.rank == 1:
        helper_in_the_test_module(env)  # the cell calls a function sent by value
    return env.rank
"""


def test_tracebacks_show_the_lines_of_notebook_cells_and_functions_sent_by_value() -> None:
    def helper_in_the_test_module(env: DistEnv) -> None:  # nested: cloudpickle sends it by value
        raise ValueError(f"helper failed on rank {env.rank}")

    # What IPython does with a cell: compile it under a made-up file name, keep its lines in
    # linecache, and run it in __main__ (so cloudpickle sends its functions by value).
    filename = f"/tmp/ipykernel_{os.getpid()}_mgpu_test/123456.py"
    assert not os.path.exists(filename)
    linecache.cache[filename] = (len(CELL), None, CELL.splitlines(True), filename)
    namespace = {"__name__": "__main__", "helper_in_the_test_module": helper_in_the_test_module}
    try:
        exec(compile(CELL, filename, "exec"), namespace)
        with pytest.raises(WorkerError) as info:
            launch(namespace["cell_worker"], 2, device="cpu", init_process_group=False, echo=False)
    finally:
        linecache.cache.pop(filename, None)
    details = info.value.details
    assert info.value.rank == 1
    assert f'File "{filename}", line 5, in cell_worker\n' in details
    assert (
        "    helper_in_the_test_module(env)  # the cell calls a function sent by value" in details
    )
    assert f'File "{__file__}"' in details
    assert 'raise ValueError(f"helper failed on rank {env.rank}")' in details
    assert "<dynamic-code>" not in details


LOST_PEER = "RuntimeError: [gloo/transport/tcp/pair.cc:561] Connection closed by peer [::1]:5"
TIMED_OUT = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms"


def outcome(rank: int, tmp_path, **known):
    """What the parent knows about a rank when it decides who failed first."""
    from mgpu_helpers.launch import _Rank

    state = _Rank(rank, None, tmp_path / f"rank{rank}.log")
    for name, value in known.items():
        setattr(state, name, value)
    return state


def test_who_failed_first_does_not_depend_on_which_message_arrived_first(tmp_path) -> None:
    from mgpu_helpers.launch import _failure

    # The survivor's "closed by peer" was raised (t=10.0) before the parent saw the dead rank's
    # exit (t=10.2): the rank that died still comes first.
    survivor = outcome(0, tmp_path, error=LOST_PEER, failed_at=10.0, collective="barrier")
    dead = outcome(1, tmp_path, exitcode=-9, exited_at=10.2)
    error = _failure([survivor, dead])
    assert (error.rank, error.how, error.exitcode) == (1, "killed by SIGKILL", -9)
    assert "rank 0 failed in a collective (barrier) as a consequence" in str(error)
    # A collective that timed out outranks one that lost its peer a moment earlier (gloo closes
    # the connection as it reports the timeout).
    lost = outcome(0, tmp_path, error=LOST_PEER, failed_at=20.0, collective="barrier")
    waited = outcome(1, tmp_path, error=TIMED_OUT, failed_at=20.01, collective="broadcast")
    assert _failure([lost, waited]).rank == 1
    assert "entry 6: a collective called on some ranks only" in str(_failure([lost, waited]))
    assert "entry 6" not in str(_failure([lost]))  # a lost peer is a consequence, not the cause
    # An error of the rank's own (not in a collective) outranks both.
    own = outcome(2, tmp_path, error="ValueError: bad batch", failed_at=20.05)
    error = _failure([lost, waited, own])
    assert (error.rank, error.collective) == (2, None)
    assert sorted(error.others) == [0, 1]
