"""The harness of lesson 10's live failures (mgpu_helpers.failures), with real processes."""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.failures import (
    caught,
    first_failure,
    key_lines,
    report,
    show,
    start_like_mp_spawn,
    tidy,
    where_ranks_waited,
)
from mgpu_helpers.launch import WorkerError, launch


def test_tidy_drops_source_places_emoji_and_log_paths_and_cuts_long_lines() -> None:
    line = "  [/pytorch/third_party/gloo/pair.cc:561] Connection closed by peer \u2753; its log: /x"
    assert tidy(line) == "Connection closed by peer"
    assert tidy("x" * 120, width=20) == "x" * 17 + "..."
    gloo = "what():  [enforce fail at /w/gloo/tcp/pair.cc:464] op.preamble.length <= op.nbytes."
    assert tidy(gloo) == "what():  [enforce fail at pair.cc:464] op.preamble.length <= op.nbytes."
    assert key_lines("a\nb error\nc error\n", "error", limit=1) == ["b error"]


def test_caught_and_show(capsys: pytest.CaptureFixture[str]) -> None:
    assert caught(lambda: 1) is None
    error = caught(lambda: int("x"))
    assert error is not None and error[0] == "ValueError" and "invalid literal" in error[1]
    show("parse", error, lines=1)
    show("fine", None)
    out = capsys.readouterr().out
    assert out.startswith("parse: ValueError\n    invalid literal") and "fine: no error" in out


def rank1_raises(env: DistEnv) -> None:
    if env.rank == 1:
        raise KeyError("the missing key")
    dist.barrier()


def test_report_names_the_first_failing_rank_and_ends_with_its_error() -> None:
    with pytest.raises(WorkerError) as info:
        launch(rank1_raises, 2, device="cpu", timeout=30, echo=False)
    lines = report(info.value)
    assert lines[0].startswith("rank 1 failed"), lines
    assert lines[-1].startswith("its error: KeyError: 'the missing key'"), lines
    assert all(len(line) <= 100 for line in lines)
    whole = first_failure(info.value, width=40)  # an exercise's check: nothing cut, one prefix
    assert whole.startswith("rank 1 failed") and whole.count("rank 1 failed") == 1, whole
    assert whole.endswith("its error: KeyError: 'the missing key'"), whole
    assert all(len(line) <= 40 for line in whole.splitlines()) and "..." not in whole
    first = tidy(str(info.value).splitlines()[0], 10_000)
    assert " ".join(whole.split()).startswith(first), whole


def dumps_then_waits(env: DistEnv, after: float) -> None:
    faulthandler.dump_traceback_later(after)
    if env.rank == 0:
        time.sleep(3 * after)  # rank 0 is still sleeping when its dump comes
    faulthandler.cancel_dump_traceback_later()


def test_where_ranks_waited_reads_each_ranks_dump(tmp_path: Path) -> None:
    launch(dumps_then_waits, 2, 0.5, device="cpu", timeout=30, log_dir=tmp_path, echo=False)
    where = where_ranks_waited(tmp_path, "dumps_then_waits")
    assert where == {0: "time.sleep(3 * after)  # rank 0 is still sleeping when its dump comes"}


def test_start_like_mp_spawn_keeps_the_childrens_stderr_and_the_parents_verdict() -> None:
    # A function of a file-less __main__ (python -c), as in a notebook: the children cannot find it.
    code = textwrap.dedent(
        """
        from mgpu_helpers.failures import start_like_mp_spawn
        def hello(rank, world_size):
            return rank
        raised, said = start_like_mp_spawn(hello, 2, 60)
        print(type(raised).__name__)
        print(said.count("Can't get attribute 'hello' on <module '__main__'"))
        """
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.stdout.split() == ["ProcessExitedException", "2"], done.stdout + done.stderr
    with pytest.raises(ValueError, match="must be positive"):
        start_like_mp_spawn(print, 0, 1)
