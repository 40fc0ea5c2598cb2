"""mgpu_helpers.jobs: bounded command lines with streamed, prefixed output (lesson 07)."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from mgpu_helpers import jobs
from mgpu_helpers.jobs import JobResult, free_port, run_job, run_jobs

PY = sys.executable


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def test_run_job_streams_prefixed_lines_and_keeps_the_output(capsys):
    code = "import sys; print('one'); print('two', file=sys.stderr); print('three', end='')"
    result = run_job([PY, "-c", code], timeout=30, prefix="[job] ")
    assert isinstance(result, JobResult) and result.ok and result.returncode == 0
    assert result.output.splitlines() == ["one", "two", "three"]  # stderr too, in order
    assert capsys.readouterr().out.splitlines() == ["[job] one", "[job] two", "[job] three"]
    assert result.seconds > 0 and result.cmd[0] == PY


def test_run_job_quiet_env_and_cwd(tmp_path, capsys):
    code = "import os; print(os.environ['JOB_TEST_VALUE'], os.getcwd())"
    result = run_job(
        [PY, "-c", code], timeout=30, env={"JOB_TEST_VALUE": "42"}, cwd=tmp_path, echo=False
    )
    assert result.output.split() == ["42", str(tmp_path)]
    assert capsys.readouterr().out == ""


def test_failure_is_returned_or_raised_with_the_tail():
    code = "print('before the error'); raise SystemExit(3)"
    result = run_job([PY, "-c", code], timeout=30, echo=False)
    assert result.returncode == 3 and not result.ok
    with pytest.raises(RuntimeError, match=r"exited with status 3[\s\S]*before the error"):
        result.check()
    with pytest.raises(RuntimeError, match="status 3"):
        run_job([PY, "-c", code], timeout=30, echo=False, check=True)


def test_run_jobs_run_at_once(tmp_path, capsys):
    # each job waits for the other's file: this finishes only if both run at the same time
    wait = (
        "import pathlib, sys, time\n"
        "d = pathlib.Path(sys.argv[1]); (d / sys.argv[2]).touch()\n"
        "while not (d / sys.argv[3]).exists(): time.sleep(0.02)\n"
        "print('saw', sys.argv[3])\n"
    )
    results = run_jobs(
        [[PY, "-c", wait, str(tmp_path), "a", "b"], [PY, "-c", wait, str(tmp_path), "b", "a"]],
        timeout=30,
    )
    assert [r.output for r in results] == ["saw b\n", "saw a\n"]
    assert sorted(capsys.readouterr().out.splitlines()) == ["[node 0] saw b", "[node 1] saw a"]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="run_job finds a tree in /proc (Linux)")
def test_timeout_kills_the_whole_tree(tmp_path):
    # like torchrun: the job starts a child in a session of its own, then both hang
    pids = tmp_path / "pids"
    code = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
        "                         start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"2 s timeout[\s\S]*started"):
        run_job([PY, "-c", code], timeout=2, echo=False)
    assert time.perf_counter() - start < 10
    parent, child = map(int, pids.read_text().split())
    deadline = time.perf_counter() + 5
    while (_alive(parent) or _alive(child)) and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert not _alive(parent) and not _alive(child), "a process of the timed-out job survived"


def test_clear_errors_for_bad_arguments():
    with pytest.raises(ValueError, match="at least one command"):
        run_jobs([], timeout=1)
    with pytest.raises(ValueError, match="timeout"):
        run_job([PY, "-V"], timeout=0)
    with pytest.raises(ValueError, match="finite"):  # no bound is no timeout
        run_job([PY, "-V"], timeout=float("inf"))
    with pytest.raises(ValueError, match="prefixes"):
        run_jobs([[PY, "-V"], [PY, "-V"]], timeout=5, prefixes=["a"])
    with pytest.raises(ValueError, match="empty command"):
        run_job([], timeout=5)
    with pytest.raises(RuntimeError, match="could not start"):
        run_job(["/no/such/program-here"], timeout=5)


def test_free_port_can_be_bound():
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_an_interrupt_stops_the_jobs(monkeypatch):
    started = []

    def interrupted(procs, *args):
        started.extend(p.pid for p in procs)
        raise KeyboardInterrupt  # as the notebook's stop button does while output streams

    monkeypatch.setattr(jobs, "_stream", interrupted)
    sleep = [PY, "-c", "import time; time.sleep(60)"]
    with pytest.raises(KeyboardInterrupt):
        run_jobs([sleep, sleep], timeout=60)
    assert len(started) == 2 and not any(_alive(pid) for pid in started)
