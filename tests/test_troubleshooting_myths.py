"""Lesson 10a: NCCL's behaviour shown with gloo, the tools, the myths and both exercises.

The code is read from the notebook (``load_lesson_code``). The myths run in one launch of two
CPU ranks over gloo: each claim is checked on what the ranks return. NCCL's behaviour is checked
as the lesson shows it on gloo (a queued collective, a barrier done by hand as NCCL does it); the
same mistake over real NCCL, the watchdog, ``device_id`` without ``set_device``, a device-side
assert, out of memory and exercise 2's check on ``cuda:0`` need GPUs (``gpu``, ``multigpu``).
The last test checks that every entry the package's error messages point to
(``mgpu_helpers.troubleshooting.ENTRIES``) is an entry heading of the part it names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mgpu_helpers.devices import gpu_count
from mgpu_helpers.exercises import check
from mgpu_helpers.failures import caught
from mgpu_helpers.launch import WorkerError, launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code
from mgpu_helpers.memory import tensor_bytes
from mgpu_helpers.placement import place
from mgpu_helpers.troubleshooting import ENTRIES, PARTS

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
NAMESPACE = {
    **lesson_imports("10a", ROOT / "notebooks"),  # the lesson's own imports
    "SEED": 0, "hang_timeout": 2, "QUICK": True,
    "n_gpus": 0,  # exercise 2's check on the CPU; the gpu test below sets the real count
    "myths": [],  # section 4's per-rank results, which exercise 3's check reads (set below)
}  # fmt: skip
NAMES = (
    "MYTH_IN", "MYTH_HIDDEN", "MYTH_CLASSES", "MYTH_BATCH", "MYTH_LR",
    "myth_model", "myth_batch", "flat_grads", "flat_params", "myths_worker",
    "bench_model", "ddp_step_times", "dataparallel_seconds",  # myth 5
    "ddp_gradient", "test_ddp_gradient",  # exercise 1
    "dataparallel_gradient", "test_dataparallel_gradient",  # exercise 2
    "queued_all_reduce", "barrier_meets_all_reduce", "ones_total", "late_for_the_barrier",
)  # fmt: skip
lesson = load_lesson_code("10a", NAMES, NAMESPACE, folder=ROOT / "notebooks")
CPU = place(2, "cpu")


def outcomes_of(name: str, test, answers: dict, capsys) -> dict:
    """Each answer put in place of the lesson's ``name``: whether its check passed, what it said."""
    solution, outcomes = NAMESPACE[name], {}
    try:
        for label, answer in answers.items():
            NAMESPACE[name] = answer
            outcomes[label] = check(name, test, hint="")
            outcomes[label + " says"] = capsys.readouterr().out
    finally:
        NAMESPACE[name] = solution
    return outcomes


@pytest.fixture(scope="module")
def myths() -> list[dict]:
    results = launch(lesson.myths_worker, 2, STEPS, device="cpu", timeout=60, echo=False)
    NAMESPACE["myths"] = results
    return results


def test_a_ddp_rank_holds_the_whole_model(myths: list[dict]) -> None:
    whole = tensor_bytes(lesson.myth_model().parameters())
    assert [m["ddp_bytes"] for m in myths] == [whole, whole]


def test_losses_differ_per_rank_while_ddp_gradients_are_equal_and_the_global_batchs(
    myths: list[dict],
) -> None:
    assert abs(myths[0]["loss"] - myths[1]["loss"]) > 1e-6
    assert torch.equal(myths[0]["ddp_grads"], myths[1]["ddp_grads"])
    reference = lesson.myth_model()
    batches = [lesson.myth_batch(r, 0) for r in range(2)]
    x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
    F.cross_entropy(reference(x), y).backward()
    torch.testing.assert_close(
        myths[0]["ddp_grads"], lesson.flat_grads(reference), atol=1e-6, rtol=0
    )
    mean = (myths[0]["plain_grads"] + myths[1]["plain_grads"]) / 2
    torch.testing.assert_close(myths[0]["ddp_grads"], mean, atol=1e-7, rtol=0)


def test_unwrapped_replicas_drift_and_ddp_replicas_do_not(myths: list[dict]) -> None:
    drift = myths[0]["drift"]
    assert len(drift["unwrapped"]) == len(drift["DDP"]) == STEPS + 1
    assert drift["unwrapped"][0] == 0 and min(drift["unwrapped"][1:]) > 1e-4
    assert drift["DDP"] == [0.0] * (STEPS + 1)
    assert myths[1]["drift"] == drift  # every rank measured the same spread


def test_backward_alone_combines_nothing_and_ddp_all_reduces(myths: list[dict]) -> None:
    assert (myths[0]["plain_grads"] - myths[1]["plain_grads"]).abs().max() > 1e-3
    assert myths[0]["comm"]["unwrapped"] == 0
    assert myths[0]["comm"]["DDP"] >= 1  # gloo, torch 2.14: the reducer's c10d.allreduce_


def test_exercise_1_solution_passes_stub_and_wrong_answers_fail(myths: list[dict], capsys) -> None:
    solution = lesson.ddp_gradient
    flat = lesson.flat_grads

    def stub(model, batches):
        raise NotImplementedError()

    def per_rank(model, batches) -> list[torch.Tensor]:
        grads = []
        for x, y in batches:
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append(flat(model))
        return grads

    def summed(model, batches):  # the sum of the ranks' gradients, not their average
        return torch.stack(per_rank(model, batches)).sum(0)

    def rank_0_only(model, batches):
        return per_rank(model, batches)[0]

    def pooled(model, batches):  # one loss over all the samples: "combine the losses"
        x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
        F.cross_entropy(model(x), y).backward()
        return flat(model)

    answers = {"solution": solution, "stub": stub, "sum": summed, "rank 0": rank_0_only,
               "pooled": pooled}  # fmt: skip
    outcomes = outcomes_of("ddp_gradient", lesson.test_ddp_gradient, answers, capsys)
    assert outcomes["solution"], outcomes["solution says"]
    assert not outcomes["stub"] and "not implemented yet" in outcomes["stub says"]
    for wrong in ("sum", "rank 0", "pooled"):
        assert not outcomes[wrong], f"{wrong} passed"
        assert "differs from yours by up to" in outcomes[wrong + " says"]


def test_exercise_2_dataparallel_gradient_solution_stub_and_ddps_answer(
    myths: list[dict], capsys
) -> None:
    solution = lesson.dataparallel_gradient
    ddp_answer = lesson.ddp_gradient  # right for DDP, wrong for DataParallel on unequal slices

    def stub(model, batches):
        raise NotImplementedError()

    answers = {"solution": solution, "stub": stub, "ddp": ddp_answer}
    outcomes = outcomes_of(
        "dataparallel_gradient", lesson.test_dataparallel_gradient, answers, capsys
    )
    assert outcomes["solution"], outcomes["solution says"]
    assert not outcomes["stub"] and "not implemented yet" in outcomes["stub says"]
    assert not outcomes["ddp"] and "differs from yours" in outcomes["ddp says"]


@pytest.mark.gpu
def test_exercise_2_check_runs_dataparallel_on_cuda_0(
    myths: list[dict], capsys, monkeypatch
) -> None:
    # The check's GPU path: nn.DataParallel on cuda:0 (and scattered over 2+ GPUs), compared with
    # the learner's CPU answer. A model left on the CPU would raise here (DataParallel's own check
    # with 2+ GPUs, cross_entropy's device check with 1).
    monkeypatch.setitem(NAMESPACE, "n_gpus", gpu_count())
    answers = {"solution": lesson.dataparallel_gradient, "ddp": lesson.ddp_gradient}
    outcomes = outcomes_of(
        "dataparallel_gradient", lesson.test_dataparallel_gradient, answers, capsys
    )
    assert outcomes["solution"], outcomes["solution says"]
    assert not outcomes["ddp"] and "differs from yours" in outcomes["ddp says"]


def test_a_queued_collective_returns_before_the_late_rank_calls_it() -> None:
    delay = 1.0
    ranks = launch(lesson.queued_all_reduce, CPU, delay, timeout=60, echo=False)
    assert ranks[0]["issued"] < delay / 4 and ranks[0]["done"] > delay / 2, ranks
    assert [r["total"] for r in ranks] == [2.0, 2.0]


def test_nccls_barrier_by_hand_pairs_with_rank_1s_all_reduce(tmp_path: Path) -> None:
    with pytest.raises(WorkerError) as caught_error:
        launch(lesson.barrier_meets_all_reduce, CPU, True, timeout=2, log_dir=tmp_path, echo=False)
    exc = caught_error.value
    assert "rank 1: all_reduce gave 1\n" in (tmp_path / "rank1.log").read_text()
    assert exc.rank == 0 and exc.collective == "all_reduce" and "Timed out" in exc.details


def test_monitored_barrier_names_the_late_rank() -> None:
    said = launch(lesson.late_for_the_barrier, CPU, 1.0, timeout=60, echo=False)
    # wait_all_ranks=True: every missing rank listed, "Ranks"; the timeout in milliseconds
    assert said[0] == "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 1000 ms", said
    assert said[1] == ""


@pytest.mark.slow  # make test-long: a torchrun job (lesson 10b's notebook prints the same)
def test_torchrun_sets_async_error_handling_to_1_for_its_workers(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text(
        "import os\nprint('sees', os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    done = subprocess.run(
        [*command, "1", str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0 and "sees 1" in done.stdout, done.stdout + done.stderr


def test_an_index_out_of_range_is_named_at_its_line_on_the_cpu() -> None:
    error = caught(lambda: torch.nn.Embedding(10, 4)(torch.tensor([3, 7, 10])))
    assert error == ("IndexError", "index out of range in self")


@pytest.mark.multigpu
def test_nccl_barrier_pairs_with_an_all_reduce_and_the_watchdog_ends_rank_0(
    tmp_path: Path, monkeypatch
) -> None:
    # as the lesson does: the watchdog sleeps 4 x this after the timeout (60 s by default)
    monkeypatch.setenv("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "500")
    with pytest.raises(WorkerError) as caught_error:
        launch(lesson.barrier_meets_all_reduce, place(2, "cuda"), False, timeout=5,
               log_dir=tmp_path, echo=False)  # fmt: skip
    logs = {r: (tmp_path / f"rank{r}.log").read_text(errors="replace") for r in (0, 1)}
    assert "rank 1: all_reduce gave 1\n" in logs[1] and caught_error.value.rank == 0
    assert "Watchdog caught collective operation timeout" in logs[0]
    assert "OpType=ALLREDUCE" in logs[0]


DEVICE_ID_ONLY = """\
import os
import torch
import torch.distributed as dist

rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))  # no set_device
bare = torch.zeros(1, device="cuda")
print(f"rank {rank}: current {torch.cuda.current_device()}, bare {bare.device}")
dist.destroy_process_group()
"""


@pytest.mark.multigpu
def test_device_id_does_not_set_the_current_device(tmp_path: Path) -> None:
    script = tmp_path / "device_id_only.py"
    script.write_text(DEVICE_ID_ONLY)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    done = subprocess.run([*command, "2", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 1: current 0, bare cuda:0" in done.stdout, done.stdout


@pytest.mark.gpu
def test_a_device_side_assert_points_at_its_line_with_cuda_launch_blocking() -> None:
    code = textwrap.dedent(
        """
        import torch
        index = torch.tensor([3, 7, 10], device="cuda")
        rows = torch.nn.Embedding(10, 4).cuda()(index)  # the culprit
        torch.cuda.synchronize()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"},
    )  # fmt: skip
    assert done.returncode != 0 and "device-side assert triggered" in done.stderr, done.stderr
    assert "the culprit" in done.stderr  # the traceback's last frame is the embedding's line


@pytest.mark.gpu
def test_entry_15_out_of_memory_names_the_allocation_and_empty_cache_runs() -> None:
    free, _ = torch.cuda.mem_get_info(0)
    oom = caught(lambda: torch.empty(free + 2**30, dtype=torch.uint8, device="cuda:0"))
    assert oom is not None and oom[0] == "OutOfMemoryError" and "Tried to allocate" in oom[1]
    assert issubclass(torch.OutOfMemoryError, RuntimeError)
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info(0)[0] >= 0.9 * free  # nothing of the refused allocation stayed


@pytest.mark.multigpu
def test_myth_5_times_ddp_and_dataparallel_on_two_gpus() -> None:
    # Both timings are taken and finite; which is faster is measured in the lesson, not asserted
    # here (speed claims belong to benchmarks, not to timed tests).
    bench = {"width": 256, "depth": 2, "batch": 64, "warmup": 1, "repeats": 3}
    ranks = launch(lesson.myths_worker, place(2, "cuda"), 1, bench, timeout=120, echo=False)
    ddp = [max(step) for step in zip(*(r["ddp_seconds"] for r in ranks), strict=True)]
    dp = lesson.dataparallel_seconds([0, 1], **bench)
    assert len(ddp) == len(dp) == bench["repeats"], (ddp, dp)
    assert all(0 < t < 60 for t in ddp + dp), (ddp, dp)


def test_every_entry_the_messages_point_to_is_a_heading_of_its_part() -> None:
    headings: dict[int, tuple[str, str]] = {}
    for part, path in PARTS.items():
        notebook = json.loads((ROOT / path).read_text())
        markdown = "\n".join(
            "".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown"
        )
        for n, title in re.findall(r"^### (\d+)\. (.+)$", markdown, re.MULTILINE):
            assert int(n) not in headings, f"entry {n} is a heading of two parts"
            headings[int(n)] = (part, title.strip())

    def same(a: str, b: str) -> bool:  # "A port taken" in a heading, "a port taken" in a message
        return a[:1].lower() + a[1:] == b[:1].lower() + b[1:]

    wrong = {
        n: (entry, headings.get(n))
        for n, entry in ENTRIES.items()
        if n not in headings or headings[n][0] != entry[0] or not same(entry[1], headings[n][1])
    }
    assert not wrong, f"ENTRIES against the parts' headings (entry: (ENTRIES, heading)): {wrong}"
    assert sorted(headings) == sorted(ENTRIES)
