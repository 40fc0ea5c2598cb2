"""mgpu_helpers.run_control: the torchrun pieces lessons 07 and 11 share (train_ddp.py and
train_lm.py use them; their torchrun tests kill, restart and stop real jobs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import torch

from mgpu_helpers import run_control
from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.run_control import (
    maybe_die,
    node_name,
    restart_count,
    retries_refuse_alike,
    sibling,
    torchrun_hint,
)


def test_sibling_names_a_file_or_folder_next_to_the_snapshot():
    assert sibling(Path("/runs/snapshot.pt"), ".prev") == Path("/runs/snapshot.pt.prev")
    assert sibling(Path("ck"), ".tmp") == Path("ck.tmp")


def test_restart_counts_and_the_retry_note_read_torchruns_variables(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    assert restart_count() == 0 and retries_refuse_alike() == ""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert restart_count() == 2
    assert retries_refuse_alike() == " (torchrun's --max-restarts=3 retries refuse alike)"


def test_node_name_says_the_node_rank_and_host(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "1")
    assert node_name().startswith("node 1 (") and node_name().endswith(")")


def test_torchrun_hint_quotes_the_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "scripts" / "train.py"
    hint = torchrun_hint(script, ["--out", "my runs"], nproc=4)
    assert hint == "torchrun --standalone --nproc-per-node=4 scripts/train.py --out 'my runs'"


def test_stop_signal_is_noted_not_fatal(monkeypatch):
    monkeypatch.setattr(run_control, "_stop_signal", [])
    before = signal.signal(signal.SIGTERM, run_control.on_stop_signal)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this process: noted, nothing ends
    finally:
        signal.signal(signal.SIGTERM, before)
    assert run_control._stop_signal == [signal.SIGTERM]


def test_maybe_die_kills_only_the_chosen_rank_on_the_first_attempt(capsys):
    def options(restarts: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(kill_at_step=3, kill_rank=1, restarts=restarts)

    def env(rank: int) -> DistEnv:
        return DistEnv(rank, rank, 2, torch.device("cpu"), "gloo")

    maybe_die(env(0), options(0))  # another rank lives on
    maybe_die(env(1), options(1))  # and so does a restarted attempt
    code = textwrap.dedent("""
        import types, torch
        from mgpu_helpers.dist_env import DistEnv
        from mgpu_helpers.run_control import maybe_die
        env = DistEnv(1, 1, 2, torch.device("cpu"), "gloo")
        maybe_die(env, types.SimpleNamespace(kill_at_step=3, kill_rank=1, restarts=0))
        print("alive")
    """)
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "SIGKILL to myself after 3" in killed.stdout and "alive" not in killed.stdout
