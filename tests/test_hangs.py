"""The report on a lesson that runs out of time (tooling.hangs, and the runner that takes it).

A hang must say where it is: the cell, the kernel's stacks, each live rank's stacks and the
kernel log. These tests make processes hang on purpose and read the report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mgpu_helpers.tooling.hangs import STACK_SIGNAL, catches, descendants, dump_stacks
from mgpu_helpers.tooling.runner import run_lesson

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")

WAITS_WITH_HANDLER = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
print("ready", flush=True)
def stuck_here():
    time.sleep(60)
stuck_here()
"""
WAITS_WITHOUT_HANDLER = 'import time\nprint("ready", flush=True)\ntime.sleep(60)\n'


def _start(code: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=open(log, "w"), text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # ended, not yet reaped by its parent
            return True
        time.sleep(0.2)
    return False


def test_only_processes_that_catch_the_signal_are_sent_it(tmp_path: Path) -> None:
    with_handler = _start(WAITS_WITH_HANDLER, tmp_path / "a.log")
    without = _start(WAITS_WITHOUT_HANDLER, tmp_path / "b.log")
    try:
        assert catches(with_handler.pid) and not catches(without.pid)
        assert {with_handler.pid, without.pid} <= set(descendants(os.getpid()))
        dumps = dump_stacks([with_handler.pid, without.pid])
        assert [d.pid for d in dumps] == [with_handler.pid]
        assert dumps[0].stderr == tmp_path / "a.log"
        assert "in stuck_here" in dumps[0].stacks, dumps[0].stacks
        time.sleep(0.3)
        assert without.poll() is None, "a process without a handler must not get the signal"
        assert with_handler.poll() is None, "the dump must not stop the process"
    finally:
        for proc in (with_handler, without):
            proc.kill()
            proc.wait()
    assert not catches(with_handler.pid), "an ended process catches nothing"
    assert STACK_SIGNAL not in (0, None)


HANGING_LESSON = [
    ("params", "RANKS = 2"),
    (
        "code",
        "import time\n"
        "from mgpu_helpers.launch import launch\n"
        "\n"
        "def sleeper(env):\n"
        "    time.sleep(600)  # a rank that never returns\n",
    ),
    ("code", 'print("about to launch", flush=True)\nlaunch(sleeper, RANKS, device="cpu")'),
    ("code", 'print("never reached")'),
]


@pytest.mark.notebook
def test_a_cell_that_hangs_is_reported_with_every_stack(
    notebook_writer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As under `make course`: ipykernel then redirects the kernel's stderr into the notebook
    # (under pytest it does not), so the kernel's stacks must not go to its stderr.
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    path = notebook_writer(tmp_path / "hangs.ipynb", HANGING_LESSON)
    start = time.monotonic()
    # 15 s: the fork server's first start (torch imported once, ~5 s idle) and the launch, then
    # a rank that sleeps on (both ranks slept 6.4 s after the cell's start on the busy machine).
    run = run_lesson(path, tmp_path / "out", quick=True, cell_timeout=15)
    assert run.status == "failed"
    report = run.error
    assert report.startswith("CellTimeoutError:"), report
    assert "cell 2 was running" in report and "launch(sleeper, RANKS" in report, report
    # The kernel waits in the launcher's supervision loop; its stacks say so.
    kernel = report.split("the kernel's Python stacks")[1].split("launched process")[0]
    assert "_supervise" in kernel and "in launch" in kernel, report
    assert "2 launched process(es) still alive" in report, report
    assert report.count("in sleeper") == 2, report  # each rank's stack, from its log
    assert "rank0.log" in report and "rank1.log" in report, report
    assert "the kernel log's last lines" in report
    assert (tmp_path / "out" / "hangs.hang.txt").read_text().strip() == report.split(": ", 1)[1]
    assert time.monotonic() - start < 90, "the report and the shutdown are bounded"
    # Nothing outlives the run: the kernel is shut down, and the ranks follow their launcher.
    pids = [int(line.split()[1]) for line in report.splitlines() if line.startswith("  pid ")]
    assert len(pids) == 2 and all(_gone(pid) for pid in pids), pids


def test_the_course_report_folds_a_long_error_under_its_first_line() -> None:
    from mgpu_helpers.tooling.report import _error_html

    assert _error_html("ValueError: x < 1") == "<code>ValueError: x &lt; 1</code>"
    folded = _error_html("CellTimeoutError: ran out\ncell 3 was running:\n    | f()")
    assert folded.startswith("<details><summary><code>CellTimeoutError: ran out</code>")
    assert "<pre>cell 3 was running:\n    | f()</pre>" in folded


def test_the_report_says_where_the_lessons_time_went() -> None:
    """A cell may run out of time only because a pause before it used the lesson's deadline: the
    longest cells and the longest pauses between cells, from nbclient's timing metadata."""
    from mgpu_helpers.tooling.hangs import time_spent

    def cell(start: str, end: str | None) -> dict:
        timing = {"iopub.execute_input": f"2026-12-02T14:{start}Z"}
        if end:
            timing["shell.execute_reply"] = f"2026-12-02T14:{end}Z"
        return {"metadata": {"execution": timing}}

    cells = [
        cell("23:00.000000", "23:05.000000"),  # 5 s in cell 0
        {"metadata": {}},  # a markdown cell
        cell("23:05.100000", "23:08.000000"),  # 2.9 s in cell 2
        cell("27:28.000000", None),  # started 260 s after cell 2's reply, still running
    ]
    report = time_spent(cells).splitlines()
    assert report[0].strip() == "260.0 s between cell 2's reply and cell 3's start"
    assert report[1].strip() == "5.0 s in cell 0" and len(report) == 3
    assert "no cell had finished" in time_spent([{"metadata": {}}])


def test_a_message_that_arrived_waits_at_most_one_poll_slice() -> None:
    """Issue 28's hang: after a slider cell, nbclient's one long poll sometimes missed a reply
    that had arrived and returned it only at its timeout (120 s, or the rest of the lesson).
    The runner polls in slices, so a missed wake-up costs one slice."""
    import asyncio
    import time as clock
    from queue import Empty

    from mgpu_helpers.tooling import runner

    arrived = clock.monotonic() + 0.2

    async def missing_wakeups(timeout: float | None = None) -> dict:
        """A poll that does not wake for a message arriving while it waits: it returns the
        message only if it was there when the poll began, else raises Empty at its timeout."""
        if clock.monotonic() >= arrived:
            return {"msg": "reply"}
        await asyncio.sleep(timeout if timeout is not None else 3600)
        raise Empty

    start = clock.monotonic()
    got = asyncio.run(runner._in_slices(missing_wakeups)(timeout=30))
    assert got == {"msg": "reply"}
    assert clock.monotonic() - start < 0.2 + runner.POLL_SLICE + 0.5  # not the 30 s timeout

    async def silent(timeout: float | None = None) -> dict:
        await asyncio.sleep(timeout or 0)
        raise Empty

    start = clock.monotonic()
    with pytest.raises(Empty):  # nothing ever arrives: Empty at the timeout, as before
        asyncio.run(runner._in_slices(silent)(timeout=1.5))
    assert 1.4 < clock.monotonic() - start < 3.0
