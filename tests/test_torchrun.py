"""scripts/train_ddp.py under real torchrun, on CPU processes over gloo (lesson 07).

Every torchrun costs seconds (an agent, two workers importing torch), so the runs are shared
by module-scoped fixtures: the uninterrupted reference run is what the resumed,
two-node and recovered runs must equal, bitwise. Every run is bounded by a timeout that kills
its whole process tree (mgpu_helpers.jobs). The snapshot decisions themselves (corrupt,
partial, missing, mismatch, atomic write) are also tested without torchrun, by importing the
script's functions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import sys
import types
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import sigterm_once_written

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.jobs import JobResult, free_port, run_job, run_jobs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_ddp.py"
# One store per attempt (the script's docstring says why), and one CPU thread per rank in
# every run, so that the two-node job (torchrun only sets it with several ranks per agent)
# sums in the same order as the standalone one.
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
TIMEOUT = 120  # seconds for one torchrun; a run takes about 5-10 s on an idle 2-core machine
QUICK = ["--device", "cpu", "--quick"]  # 1024 digits, 16 steps an epoch with the batch of 64


def torchrun(*args: str, restarts: int = 0, nproc: int = 2) -> list[str]:
    """A one-machine torchrun of the script (``python -m torch.distributed.run`` is torchrun)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", str(SCRIPT), *QUICK, *args,
    ]  # fmt: skip


def run(cmd: list[str], timeout: float = TIMEOUT) -> JobResult:
    return run_job(cmd, timeout=timeout, env=ENV, cwd=ROOT, echo=False)


def result_of(out: Path, job: JobResult) -> dict:
    assert job.ok, f"exit status {job.returncode}:\n{job.tail()}"
    return json.loads((out / "result.json").read_text())


def differing(a: Path, b: Path) -> list[str]:
    """Names of the tensors in which two model.pt files differ (bitwise)."""
    ma = torch.load(a / "model.pt", weights_only=True)
    mb = torch.load(b / "model.pt", weights_only=True)
    assert ma.keys() == mb.keys()
    return [name for name in ma if not torch.equal(ma[name], mb[name])]


# --- shared runs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Two jobs side by side: the 2-epoch reference, and 1 epoch with snapshots every 5 steps."""
    tmp = tmp_path_factory.mktemp("torchrun")
    ref, one = tmp / "ref", tmp / "one"
    jobs = run_jobs(
        [
            torchrun("--epochs", "2", "--snapshot", str(ref / "snap.pt"), "--out", str(ref)),
            torchrun("--epochs", "1", "--snapshot", str(one / "snap.pt"), "--snapshot-every", "5",
                     "--out", str(one)),
        ],
        timeout=TIMEOUT,
        env=ENV,
        cwd=ROOT,
        echo=False,
    )  # fmt: skip
    return {"tmp": tmp, "ref": ref, "one": one, "jobs": jobs}


@pytest.mark.slow  # make test-long
def test_standalone_run_and_two_jobs_side_by_side(runs):
    ref_job, one_job = runs["jobs"]
    ref, one = result_of(runs["ref"], ref_job), result_of(runs["one"], one_job)
    assert ref["world_size"] == 2 and ref["backend"] == "gloo" and ref["device"] == "cpu"
    assert ref["restart_count"] == 0 and ref["resumed_from"] is None
    assert ref["steps"] == 32 and ref["history"]["epoch"] == [1, 2]
    assert ref["history"]["test_acc"][-1] > 0.5, "the reference run did not learn"
    assert ref["snapshots_written"] == 2  # after each epoch's last step
    assert one["snapshots_written"] == 4  # steps 5, 10, 15 and 16 (the end of the epoch)
    assert ref["history"]["train_loss"][0] == one["history"]["train_loss"][0]
    # a missing snapshot: a fresh start, said as such
    assert "no usable snapshot" in ref_job.output and "fresh start" in ref_job.output
    assert {p.name for p in runs["one"].iterdir()} >= {"snap.pt", "snap.pt.prev", "model.pt"}


@pytest.mark.slow  # make test-long
def test_resume_on_two_nodes_without_shared_storage(runs):
    """Two agents on 127.0.0.1 (two "nodes"), each with its own snapshot folder; only node 1
    holds the 1-epoch snapshot. The job resumes from it to 2 epochs: the reference, bitwise."""
    tmp = runs["tmp"]
    node0, node1, out = tmp / "node0", tmp / "node1", tmp / "two_nodes"
    node0.mkdir()
    node1.mkdir()
    shutil.copy(runs["one"] / "snap.pt", node1 / "snap.pt")
    endpoint, job_id = f"127.0.0.1:{free_port()}", f"test-{uuid.uuid4().hex[:8]}"

    def agent(folder: Path) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}",
            "--rdzv-conf=join_timeout=30",  # a missing agent fails the job in 30 s, not 10 min
            "--local-addr=127.0.0.1",  # this "node"'s address for the others: loopback here
            str(SCRIPT), *QUICK, "--epochs", "2", "--snapshot", str(folder / "snap.pt"),
            "--out", str(out),
        ]  # fmt: skip

    jobs = run_jobs([agent(node0), agent(node1)], timeout=TIMEOUT, env=ENV, cwd=ROOT, echo=False)
    assert all(j.ok for j in jobs), "\n\n".join(j.tail() for j in jobs)
    result = result_of(out, jobs[0])
    assert result["world_size"] == 2 and result["resumed_from"] is not None
    assert result["resumed_from"]["path"] == str(node1 / "snap.pt")
    assert result["resumed_from"]["epoch"] == 1 and result["resumed_from"]["step"] == 16
    assert differing(runs["ref"], out) == []
    assert result["history"] == result_of(runs["ref"], runs["jobs"][0])["history"]


@pytest.mark.slow  # make test-long
def test_partial_snapshot_falls_back_to_prev_without_a_crash_loop(runs):
    """A snapshot cut short (a copy or a disk that failed mid-way), a valid .prev and the temp
    file of a killed write; two restarts allowed, which a crash loop would use up."""
    folder = runs["tmp"] / "partial"
    folder.mkdir()
    whole = (runs["one"] / "snap.pt").read_bytes()
    (folder / "snap.pt").write_bytes(whole[: len(whole) // 2])  # truncated
    shutil.copy(runs["one"] / "snap.pt", folder / "snap.pt.prev")  # end of epoch 1
    (folder / "snap.pt.tmp").write_bytes(whole[:1000])  # a write that was killed
    job = run(torchrun("--epochs", "2", "--snapshot", str(folder / "snap.pt"), "--out",
                       str(folder), restarts=2))  # fmt: skip
    result = result_of(folder, job)
    assert result["restart_count"] == 0, "an unreadable snapshot must not make the ranks crash"
    assert "snap.pt is unreadable" in job.output and "moved aside" in job.output
    assert "leftover of an interrupted write: ignored" in job.output
    assert result["resumed_from"]["path"] == str(folder / "snap.pt.prev")
    assert (folder / "snap.pt.corrupt").exists() and not (folder / "snap.pt.tmp").exists()
    assert differing(runs["ref"], folder) == []


@pytest.mark.slow  # make test-long
def test_sigterm_to_torchrun_stops_after_a_step_with_a_snapshot_and_resumes_bitwise(runs):
    """SIGTERM to the agent (a clean stop: scancel, SLURM's time limit, kill -TERM): torchrun
    passes it to every worker, the ranks agree on one step, rank 0 snapshots it, no result.json
    is written; the same command then resumes and ends with the reference's weights."""
    folder = runs["tmp"] / "sigterm"
    cmd = torchrun("--epochs", "2", "--snapshot", str(folder / "snap.pt"), "--snapshot-every", "5",
                   "--out", str(folder))  # fmt: skip
    # once step 5's snapshot exists, training is under way
    text = sigterm_once_written(cmd, folder / "snap.pt", runs["tmp"] / "sigterm.log", ROOT, ENV,
                                TIMEOUT)  # fmt: skip
    stops = re.findall(r"stopped by a signal after step (\d+): snapshot", text)
    assert len(stops) == 1, text
    snap = torch.load(folder / "snap.pt", weights_only=True)
    assert snap["step"] == int(stops[0]) and 5 <= snap["step"] < 32, text
    assert not (folder / "result.json").exists(), "a stopped run wrote a result"
    resumed = run(cmd)
    result = result_of(folder, resumed)
    assert result["resumed_from"]["step"] == snap["step"] and result["steps"] == 32
    assert differing(runs["ref"], folder) == []
    assert result["history"] == result_of(runs["ref"], runs["jobs"][0])["history"]


@pytest.mark.slow  # make test-long
def test_augmented_data_resumes_bitwise(tmp_path_factory):
    """CIFAR-10 (small files made here) on the CPU: random crops and flips draw from each
    rank's global random generator, which the snapshot must give back. The digits runs above
    draw nothing at random, so they would pass even if it did not."""
    from fake_data import write_cifar10, write_md5_bypass

    tmp = tmp_path_factory.mktemp("cifar")
    write_cifar10(tmp / "data", per_batch=13, n_test=20, learnable=True)  # 65 training images
    site = write_md5_bypass(tmp / "site").parent  # the made-up files pass torchvision's check
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    env = {**ENV, "MGPU_DATA": str(tmp / "data"), "PYTHONPATH": path}
    # 2 ranks x 8 images: 5 steps an epoch; snapshots at steps 3, 5 (epoch 1's end) and 6
    args = ["--dataset", "cifar10", "--batch-size", "16", "--epochs", "2"]
    ref, out = tmp / "ref", tmp / "killed"
    jobs = run_jobs(
        [
            torchrun(*args, "--out", str(ref)),
            torchrun(*args, "--snapshot", str(out / "snap.pt"), "--snapshot-every", "3",
                     "--kill-at-step", "7", "--out", str(out), restarts=1),
        ],
        timeout=TIMEOUT,
        env=env,
        cwd=ROOT,
        echo=False,
    )  # fmt: skip
    assert result_of(ref, jobs[0])["config"]["augment"], "CIFAR-10 without its augmentation"
    result = result_of(out, jobs[1])
    # A rank killed mid-run (the only killed-rank test here: lesson 07 kills one on digits too).
    assert "SIGKILL to myself after 7 optimizer steps" in jobs[1].output
    assert result["restart_count"] == 1 and result["steps"] == 10
    # the newest snapshot before the kill: step 6, 1 of epoch 2's 5 steps of 16 samples
    assert result["resumed_from"]["step"] == 6 and result["resumed_from"]["epoch"] == 2
    assert result["resumed_from"]["position"] == 16
    assert differing(ref, out) == [], "the restarted job draws other crops and flips"
    assert result["history"] == result_of(ref, jobs[0])["history"]


# --- without torchrun: the script's functions ----------------------------------------------------
@pytest.fixture(scope="module")
def script() -> types.ModuleType:
    """scripts/train_ddp.py as a module (its top level runs, main() does not)."""
    spec = importlib.util.spec_from_file_location("train_ddp_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def fake_snapshot(script: types.ModuleType, step: int, **settings: object) -> dict:
    base = {"dataset": "digits", "model": "auto", "batch_size": 64, "epochs": 2, "lr": 0.05,
            "momentum": 0.9, "seed": 0, "train_samples": 1024, "test_samples": 256,
            "augment": True, "amp": False, "sync_bn": False}  # fmt: skip
    return {
        "version": script.SNAPSHOT_VERSION, "settings": {**base, **settings}, "world_size": 2,
        "epoch": 0, "position": 64 * step, "step": step, "model": {}, "optimizer": {},
        "scaler": {}, "history": {}, "ranks": [],
    }  # fmt: skip


def test_atomic_write_keeps_the_previous_snapshot(script, tmp_path):
    path = tmp_path / "deep" / "snap.pt"
    script.write_atomically(path, fake_snapshot(script, 5))
    script.write_atomically(path, fake_snapshot(script, 10))
    assert torch.load(path, weights_only=True)["step"] == 10
    assert torch.load(tmp_path / "deep" / "snap.pt.prev", weights_only=True)["step"] == 5
    assert not (tmp_path / "deep" / "snap.pt.tmp").exists()


def test_probe_decisions(script, tmp_path):
    path = tmp_path / "snap.pt"
    assert script.probe(path) == (None, None, [])  # missing: nothing, nothing to say
    script.write_atomically(path, fake_snapshot(script, 5))
    script.write_atomically(path, fake_snapshot(script, 10))
    # a complete, newer snapshot in the temp file is still never read
    torch.save(fake_snapshot(script, 99), tmp_path / "snap.pt.tmp")
    summary, data, notes = script.probe(path)
    assert summary["step"] == 10 and summary["path"] == str(path) and data == path.read_bytes()
    assert "interrupted write" in notes[0] and not (tmp_path / "snap.pt.tmp").exists()
    path.write_bytes(path.read_bytes()[:100])  # partial
    summary, _, notes = script.probe(path)
    assert summary["step"] == 5 and summary["path"] == str(tmp_path / "snap.pt.prev")
    assert "unreadable" in notes[0] and (tmp_path / "snap.pt.corrupt").exists()
    torch.save({"model": {}}, tmp_path / "snap.pt.prev")  # loads, but is no snapshot
    summary, _, notes = script.probe(path)  # nothing usable left: a fresh start
    assert summary is None and "not a snapshot" in notes[0]
    assert (tmp_path / "snap.pt.prev.corrupt").exists()
    path.write_bytes(b"\x00garbage" * 50)  # corrupt from the first byte
    assert script.probe(path)[0] is None and not path.exists()


def test_unreadable_snapshot_is_an_error_and_stays(script, tmp_path):
    path = tmp_path / "snap.pt"
    path.mkdir()  # no file to read, as with no read permission or a failing disk
    with pytest.raises(RuntimeError, match="cannot read .*snap.pt"):
        script.probe(path)
    assert path.is_dir() and not (tmp_path / "snap.pt.corrupt").exists()
    # shared storage: another node's probe renamed the same bad file a moment earlier
    assert "another node moved it aside" in script.move_aside(tmp_path / "gone.pt")


def test_config_mismatch_is_refused_naming_the_field(script, monkeypatch):
    # in-process: under torchrun this is the same function on every rank, after the ranks
    # agreed on the snapshot (the runs above go through that part)
    env = DistEnv(0, 0, 2, torch.device("cpu"), "gloo")
    snap = fake_snapshot(script, 16)
    now = {**snap["settings"], "epochs": 5}  # epochs may grow
    script.refuse_if_different(snap, now, Path("s.pt"), env)
    with pytest.raises(SystemExit, match=r"lr was 0.05 in the snapshot's run and is 0.1 now.*"
                       r"another --snapshot path, or delete"):  # fmt: skip
        script.refuse_if_different(snap, {**now, "lr": 0.1}, Path("s.pt"), env)
    with pytest.raises(SystemExit, match="past --epochs 1"):
        script.refuse_if_different({**snap, "epoch": 1}, {**now, "epochs": 1}, Path("s.pt"), env)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")  # every attempt refuses: say so
    with pytest.raises(SystemExit, match=r"--max-restarts=3 retries refuse alike"):
        script.refuse_if_different(snap, {**now, "lr": 0.1}, Path("s.pt"), env)
    other_rank = DistEnv(1, 1, 2, torch.device("cpu"), "gloo")
    with pytest.raises(SystemExit) as quiet:  # one message per node, the others exit quietly
        script.refuse_if_different(snap, {**now, "amp": True}, Path("s.pt"), other_rank)
    assert quiet.value.code == 1


def test_rng_states_survive_weights_only_loading(script, tmp_path):
    env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo")
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    torch.save([{"rng": script.rng_states(env.device)}], tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    script.set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True), env)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2] == again[2]


def test_resumable_sampler_skips_global_samples(script):
    data = list(range(50))
    full = [list(script.ResumableSampler(data, 2, r, seed=3)) for r in range(2)]
    order = [i for pair in zip(*full, strict=True) for i in pair]  # the global order
    rest = []
    for rank in range(2):
        sampler = script.ResumableSampler(data, 2, rank, seed=3)
        sampler.skip(20)  # 20 global samples done: 10 per rank
        assert len(sampler) == 15
        rest.append(list(sampler))
        assert len(list(sampler)) == 25, "only the next pass is shortened"
    assert sorted(rest[0] + rest[1]) == sorted(order[20:])


def test_help_and_a_start_without_torchrun(script, monkeypatch, capsys):
    # main without torch's @record wrapper, which turns SystemExit(0) into a return and
    # installs a fault handler in this process
    main = script.main.__wrapped__
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "--snapshot-every" in capsys.readouterr().out
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match=r"Start it with torchrun:\n  torchrun --standalone "
                       r"--nproc-per-node=2 .*train_ddp.py --epochs 3"):  # fmt: skip
        main(["--epochs", "3"])
