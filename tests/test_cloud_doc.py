"""docs/cloud.md and scripts/slurm/ (lesson 07): what the page says runs, runs.

Every code block of the page carries a comment saying where it runs (``<!-- runs-here -->``,
``<!-- slow -->``, ``<!-- needs: gpu, internet -->``, ...); an unmarked block fails. Each
``runs-here`` block is run on this machine (CPU only, no network), among them the SLURM
rehearsal: the real batch script with stand-ins for ``srun`` and ``scontrol``, training on two
CPU "nodes". The batch script's requeue trap, its defaults and its refusals are checked with a
stand-in for Python (no torch), and every option the page and the script give ``torchrun`` or
``scripts/train_ddp.py`` is checked against their parsers.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from mgpu_helpers.jobs import JobResult, free_port, run_job, run_jobs

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cloud.md"
SLURM = ROOT / "scripts" / "slurm"
SBATCH = SLURM / "train_ddp.sbatch"
TRAIN = ROOT / "scripts" / "train_ddp.py"
NEEDS = {"gpu", "internet", "instance", "cluster", "notebook"}
MARK = re.compile(r"<!--\s*(runs-here|slow|needs:\s*[a-z]+(?:\s*,\s*[a-z]+)*)\s*-->")
FENCE = re.compile(r"```(\w*)")
BLOCK_TIMEOUT = 240  # seconds for one block; the rehearsal takes ~15 s on an idle 2-core machine


@dataclass(frozen=True)
class Block:
    """One fenced code block of the page and the comment before it."""

    line: int  # line number of its opening fence (1-based)
    lang: str  # the fence's language: bash, python, ...
    code: str
    mark: str | None  # "runs-here", "slow" or "needs: a, b"; None when the comment is missing

    @property
    def needs(self) -> set[str]:
        if not self.mark or not self.mark.startswith("needs:"):
            return set()
        return {part.strip() for part in self.mark.removeprefix("needs:").split(",")}

    def __str__(self) -> str:
        return f"docs/cloud.md line {self.line} ({self.lang or 'no language'})"


def read_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, each with the classification comment before it."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.fullmatch(lines[i].strip())
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"line {i + 1}: a code block that is never closed")
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        found = MARK.fullmatch(before)
        mark = re.sub(r"\s+", " ", found.group(1)) if found else None
        blocks.append(Block(i + 1, opening.group(1), "\n".join(lines[i + 1 : end]), mark))
        i = end + 1
    return blocks


BLOCKS = read_blocks(DOC.read_text())
RUNS_HERE = [b for b in BLOCKS if b.mark == "runs-here"]
REHEARSAL = next(b for b in RUNS_HERE if "rehearse.sh" in b.code)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without SLURM's variables or the batch script's settings."""
    settings = {"NPROC_PER_NODE", "DEVICE", "RDZV_HOST", "RDZV_PORT", "RUN_DIR", "COURSE_DIR",
                "PYTHON", "MAX_RESTARTS", "SNAPSHOT_EVERY", "TRAIN_SCRIPT", "EXTRA_ARGS",
                "OMP_NUM_THREADS", "NCCL_DEBUG", "REHEARSAL_DIR"}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SLURMD_", "FAKE_")) and k not in settings}
    # the course's environment first, as after `source .venv/bin/activate`
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def run_clean(cmd: list[str], env: dict[str, str], *, timeout: float, cwd: Path) -> JobResult:
    """run_job with exactly ``env`` (run_job adds to this process's environment; ``env -i``
    starts from nothing, so a variable left out of ``env`` is unset, as when SLURM is absent)."""
    pairs = [f"{k}={v}" for k, v in {**env, "PYTHONUNBUFFERED": "1"}.items()]
    return run_job(["env", "-i", *pairs, *cmd], timeout=timeout, cwd=cwd, echo=False)


# --- the page's blocks ------------------------------------------------------------------------


def test_every_block_says_where_it_runs() -> None:
    assert RUNS_HERE, "no runs-here block found: the page's commands would go untested"
    for block in BLOCKS:
        assert block.mark, (
            f"{block} has no classification comment on the line before it: add "
            "<!-- runs-here --> (tests/test_cloud_doc.py runs it), <!-- slow --> or "
            f"<!-- needs: ... --> with some of {sorted(NEEDS)}"
        )
        assert block.needs <= NEEDS, f"{block}: unknown needs {block.needs - NEEDS}"
        if block.mark == "runs-here":
            assert block.lang in ("bash", "python"), f"{block}: runs-here blocks are bash or python"


def test_an_unmarked_block_is_caught() -> None:
    text = "<!-- runs-here -->\n```bash\necho hi\n```\n\nSome text.\n```bash\nrm -rf /\n```\n"
    first, second = read_blocks(text)
    assert (first.mark, first.code) == ("runs-here", "echo hi")
    assert second.mark is None and second.line == 7
    marked = read_blocks("<!--  needs:  gpu ,internet -->\n```python\npass\n```\n")[0]
    assert marked.needs == {"gpu", "internet"}
    with pytest.raises(ValueError, match="never closed"):
        read_blocks("```bash\necho\n")


@pytest.fixture(scope="module")
def doc_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the blocks' scripts and the rehearsal's results go."""
    return tmp_path_factory.mktemp("cloud-doc")


@pytest.fixture(scope="module")
def doc_runs(doc_folder: Path) -> dict[int, JobResult]:
    """Every runs-here block, run once from the course's folder with the course's Python first
    on PATH, all at the same time (the short ones fit in the rehearsal's waits); by line."""
    folder = doc_folder
    env = clean_env(REHEARSAL_DIR=str(folder / "rehearsal"), RDZV_PORT=str(free_port()),
                    FAKE_TIME_LIMIT=str(BLOCK_TIMEOUT - 40))
    pairs = [f"{k}={v}" for k, v in {**env, "PYTHONUNBUFFERED": "1"}.items()]
    cmds = []
    for block in RUNS_HERE:
        if block.lang == "python":
            script = folder / f"block{block.line}.py"
            script.write_text(block.code + "\n")
            cmd = [sys.executable, str(script)]
        else:
            cmd = ["bash", "-euo", "pipefail", "-c", block.code]
        cmds.append(["env", "-i", *pairs, *cmd])  # exactly env: no SLURM variable leaks in
    results = run_jobs(cmds, timeout=BLOCK_TIMEOUT, cwd=ROOT, echo=False)
    return {block.line: result for block, result in zip(RUNS_HERE, results, strict=True)}


@pytest.mark.slow  # make test-long
@pytest.mark.parametrize("block", RUNS_HERE, ids=[f"line{b.line}" for b in RUNS_HERE])
def test_runs_here_block_runs(block: Block, doc_runs: dict[int, JobResult]) -> None:
    result = doc_runs[block.line]
    assert result.ok, f"{block} exited with {result.returncode}:\n{result.tail()}"


@pytest.mark.slow  # make test-long
def test_doctor_block_reports_ok(doc_runs: dict[int, JobResult]) -> None:
    block = next(b for b in RUNS_HERE if "tooling.cli doctor" in b.code)
    assert "status: ok" in doc_runs[block.line].output


@pytest.mark.slow  # make test-long
def test_requirement_check_finds_nothing_missing_here(doc_runs: dict[int, JobResult]) -> None:
    """The hosted-notebook check against this course's .venv, which has every requirement."""
    block = next(b for b in RUNS_HERE if "requirements.txt" in b.code)
    output = doc_runs[block.line].output
    assert "nothing to install" in output, output
    assert "torch " in output and "the platform's own" in output


def test_requirement_check_runs_from_the_notebooks_folder(doc_folder: Path) -> None:
    """The hosted-notebook cell runs after the first cell's os.chdir into notebooks/."""
    block = next(b for b in RUNS_HERE if "requirements.txt" in b.code)
    script = doc_folder / "requirements_check_from_notebooks.py"
    script.write_text(block.code + "\n")
    result = run_clean([sys.executable, str(script)], clean_env(), timeout=60,
                       cwd=ROOT / "notebooks")
    assert result.ok and "nothing to install" in result.output, result.output


@pytest.mark.slow  # make test-long
def test_slurm_rehearsal_trains_on_two_nodes(
    doc_runs: dict[int, JobResult], doc_folder: Path
) -> None:
    """The real batch script, two "nodes" of one CPU worker each: a 2-rank job with a result."""
    result = doc_runs[REHEARSAL.line]
    assert result.ok, result.tail()
    lines = result.output.splitlines()
    assert "0: node 0 is 127.0.0.1: starting torchrun" in lines, result.tail()
    assert "1: node 1 is localhost: starting torchrun" in lines, result.tail()
    assert "srun ended with status 0" in lines
    out = doc_folder / "rehearsal"
    data = json.loads((out / "result.json").read_text())
    assert (data["world_size"], data["backend"], data["restart_count"]) == (2, "gloo", 0)
    assert data["history"]["epoch"] == [1] and data["snapshots_written"] >= 1
    assert (out / "snapshot.pt").is_file() and (out / "model.pt").is_file()


# --- the batch script alone: a stand-in Python, so no torch starts -----------------------------

FAKE_PYTHON = """#!/usr/bin/env bash
# torchrun passes SIGTERM to its workers, which snapshot and exit (scripts/train_ddp.py)
trap 'echo "fake python: SIGTERM on node ${SLURM_NODEID:-?}: snapshot written"; exit 0' TERM
echo "fake python: OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} NCCL_DEBUG=${NCCL_DEBUG:-unset} $*"
[ "${SLURM_NODEID:-}" = "${FAIL_NODE:-none}" ] && exit 5
for _ in $(seq 400); do [ -e "$STOP_FILE" ] && exit 0; sleep 0.05; done
exit 3
"""


def _submit_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A job as SLURM would start it: 2 nodes, 'a100:4' GPUs and 8 cores each, from a course
    folder in tmp_path whose training script is a stand-in, with a stand-in Python."""
    course = tmp_path / "course"
    (course / "scripts").mkdir(parents=True)
    (course / "scripts" / "train_ddp.py").write_text("")
    fake_python = tmp_path / "python"
    fake_python.write_text(FAKE_PYTHON)
    fake_python.chmod(0o755)
    env = clean_env(
        PATH=f"{SLURM / 'fake'}{os.pathsep}{clean_env()['PATH']}",
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="mgpu-ddp", SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="127.0.0.1,localhost", SLURM_GPUS_PER_NODE="a100:4",
        SLURM_CPUS_PER_TASK="8", SLURM_SUBMIT_DIR=str(course), PYTHON=str(fake_python),
        FAKE_SLURM_LOG=str(tmp_path / "slurm.log"), STOP_FILE=str(tmp_path / "stop"),
        EXTRA_ARGS="--epochs 2 --amp", FAKE_TIME_LIMIT="60",
    )
    return {**env, **extra}


def _lines(stream, into: queue.Queue[str]) -> None:
    for raw in iter(stream.readline, b""):
        into.put(raw.decode(errors="replace").rstrip("\n"))


def _wait_for(lines: queue.Queue[str], seen: list[str], test: Callable[[], bool], what: str,
              timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        try:
            seen.append(lines.get(timeout=max(0.01, min(0.2, deadline - time.monotonic()))))
        except queue.Empty:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:g} s; output:\n" +
                                     "\n".join(seen)) from None


@pytest.mark.parametrize("refused", [False, True], ids=["requeued", "requeue-refused"])
def test_sbatch_command_line_and_requeue_on_usr1(tmp_path: Path, refused: bool) -> None:
    """The torchrun line it builds from SLURM's variables, and USR1 (the --signal warning before
    the time limit): SIGTERM reaches every node's training first (rank 0 snapshots, the ranks
    exit), and only once the step has ended does the script ask SLURM to requeue the job; a
    requeue the cluster refuses is said, and the batch shell ends normally."""
    env = _submit_env(tmp_path, FAKE_REQUEUE_FAILS="1" if refused else "0")
    proc = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    log = tmp_path / "slurm.log"
    try:
        both = lambda: sum("fake python: OMP" in line for line in seen) == 2  # noqa: E731
        _wait_for(lines, seen, both, "output from both nodes' stand-in Python")
        proc.send_signal(signal.SIGUSR1)
        ended = lambda: any(line.startswith("srun ended") for line in seen)  # noqa: E731
        _wait_for(lines, seen, ended, "the end of srun after SIGTERM")
        assert proc.wait(timeout=30) == 0, "\n".join(seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    while not lines.empty():
        seen.append(lines.get())
    text = "\n".join(seen)
    run = tmp_path / "course" / "runs" / "slurm" / "mgpu-ddp"
    expected = (
        "fake python: OMP_NUM_THREADS=2 NCCL_DEBUG=WARN -m torch.distributed.run --nnodes=2 "
        "--nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29742 "
        f"--rdzv-id=4242 --max-restarts=3 scripts/train_ddp.py --device auto --snapshot "
        f"{run}/snapshot.pt --snapshot-every 0 --out {run} --epochs 2 --amp"
    )
    assert f"0: {expected}" in seen and f"1: {expected}" in seen, text
    order = [next(i for i, line in enumerate(seen) if want in line) for want in (
        "time limit near: stopping the training", "0: fake python: SIGTERM on node 0",
        "1: fake python: SIGTERM on node 1", "srun ended with status 0",
        "requeueing job 4242; it resumes from")]  # fmt: skip
    assert order[0] < min(order[1:3]) and max(order[1:3]) < order[3] < order[4], text
    assert "requeue 4242" in log.read_text(), "the script did not ask SLURM to requeue"
    assert ("scontrol requeue 4242 failed" in text) == refused, text
    assert run.is_dir()


def _fake_getent(tmp_path: Path, answer: str) -> str:
    """A PATH whose getent answers every name with ``answer`` (a line of getent ahostsv4)."""
    folder = tmp_path / "getent-bin"
    folder.mkdir()
    tool = folder / "getent"
    tool.write_text(f"#!/usr/bin/env bash\n[ -n '{answer}' ] && echo '{answer}' || exit 2\n")
    tool.chmod(0o755)
    return str(folder)


@pytest.mark.parametrize(
    ("answer", "endpoint", "message"),
    [
        ("10.1.2.3      STREAM node001", "10.1.2.3:29742", ""),
        ("127.0.1.1     STREAM node001", "", "resolves to 127.0.1.1, a loopback address"),
        ("", "", "cannot resolve the first node's name 'node001'"),
    ],
    ids=["resolved", "loopback-refused", "unresolved"],
)
def test_sbatch_resolves_the_first_nodes_address(
    tmp_path: Path, answer: str, endpoint: str, message: str
) -> None:
    """The rendezvous address is the first node's name resolved (getent), never a name the
    other nodes may not reach, nor a loopback address; RDZV_HOST overrides it."""
    env = _submit_env(tmp_path, FAKE_NODES="node001 node002", STOP_FILE=str(tmp_path / "go"))
    env["PATH"] = f"{_fake_getent(tmp_path, answer)}{os.pathsep}{env['PATH']}"
    (tmp_path / "go").touch()  # the stand-in Pythons end at once
    result = run_clean(["bash", str(SBATCH)], env, timeout=60, cwd=tmp_path)
    if endpoint:
        assert result.returncode == 0, result.output
        assert f"--rdzv-endpoint={endpoint} " in result.output, result.output
    else:
        assert result.returncode == 2 and message in result.output, result.output
        assert "RDZV_HOST" in result.output
        env["RDZV_HOST"] = "10.9.9.9"
        given = run_clean(["bash", str(SBATCH)], env, timeout=60, cwd=tmp_path)
        assert given.returncode == 0 and "--rdzv-endpoint=10.9.9.9:29742 " in given.output


def test_a_failing_node_stops_the_job(tmp_path: Path) -> None:
    """Node 1's torchrun fails while node 0's would wait for it: srun's --kill-on-bad-exit stops
    node 0 at once (the stand-in does as SLURM does), and the job fails with node 1's status."""
    env = _submit_env(tmp_path, FAIL_NODE="1")
    result = run_clean(["bash", str(SBATCH)], env, timeout=60, cwd=tmp_path)
    assert result.returncode == 5, result.output
    assert "a task exited with status 5: stopping the others" in result.output
    assert result.seconds < 30, f"node 0 was not stopped promptly ({result.seconds:.0f} s)"


@pytest.mark.parametrize(
    ("unset", "extra", "message"),
    [
        ("SLURM_JOB_ID", {}, "not inside a SLURM job"),
        ("SLURM_GPUS_PER_NODE", {}, "ask for GPUs with --gpus-per-node=N, or set NPROC_PER_NODE"),
        ("", {"NPROC_PER_NODE": "two"}, "cannot tell how many workers"),
        ("", {"COURSE_DIR": "/nonexistent-course"}, "COURSE_DIR=/nonexistent-course is not"),
        ("", {"TRAIN_SCRIPT": "scripts/missing.py"}, "scripts/missing.py not found"),
    ],
)
def test_sbatch_refuses_what_it_cannot_run(
    tmp_path: Path, unset: str, extra: dict[str, str], message: str
) -> None:
    env = _submit_env(tmp_path, **extra)
    env.pop(unset, None)
    result = run_clean(["bash", str(SBATCH)], env, timeout=30, cwd=tmp_path)
    assert result.returncode == 2, result.output
    assert message in result.output, result.output


# --- options the page and the script use exist -------------------------------------------------


def _logical_lines(code: str) -> list[str]:
    return code.replace("\\\n", " ").splitlines()


def _options(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


def test_torchrun_and_script_options_exist() -> None:
    torchrun_opts = set(get_args_parser()._option_string_actions)
    script_opts = set(re.findall(r'"(--[a-z][a-z0-9-]*)"', TRAIN.read_text()))
    pairs = []  # (where, text given to torchrun, text given to the script)
    for block in BLOCKS:
        for line in _logical_lines(block.code):
            if "train_ddp.py" in line and ("torchrun" in line or "torch.distributed.run" in line):
                launcher, _, script = line.partition("train_ddp.py")
                pairs.append((str(block), launcher.split("torchrun", 1)[-1], script))
    for line in _logical_lines(SBATCH.read_text()):
        if "torch.distributed.run" in line:
            launcher, _, script = line.partition('"$TRAIN_SCRIPT"')
            pairs.append(("train_ddp.sbatch", launcher.split("torch.distributed.run")[1], script))
    assert len(pairs) >= 3, pairs
    for where, launcher, script in pairs:
        assert _options(launcher) <= torchrun_opts, (where, _options(launcher) - torchrun_opts)
        assert _options(script) <= script_opts, (where, _options(script) - script_opts)


def test_paths_the_page_names_exist() -> None:
    named = set(re.findall(r"(?<![\w/.-])(?:scripts|docs|tests)/[\w./-]*[\w/]", DOC.read_text()))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/cloud.md names files that do not exist: {missing}"


def test_shell_scripts_pass_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (bash -n runs as one of the page's blocks)")
    scripts = [SBATCH, SLURM / "rehearse.sh", SLURM / "fake" / "scontrol"]
    result = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout
