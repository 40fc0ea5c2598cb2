"""Lesson 10, section 4 (the article's myths) and exercise 3, with the lesson's own code.

The code is read from the notebook (``load_lesson_code``) and runs in one launch of two CPU
ranks over gloo: each demonstration's claim is checked on what the ranks return. The
DataParallel measurement needs two GPUs (``multigpu``). The last test checks that every entry
the package's error messages point to (``mgpu_helpers.troubleshooting.ENTRIES``) is an entry
heading of the lesson.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mgpu_helpers.exercises import check
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code
from mgpu_helpers.memory import tensor_bytes
from mgpu_helpers.placement import place
from mgpu_helpers.troubleshooting import ENTRIES

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
NAMESPACE = {
    **lesson_imports("10", ROOT / "notebooks"),  # the lesson's own imports
    "SEED": 0,
    "myths": [],  # section 4's per-rank results, which exercise 3's check reads (set below)
}  # fmt: skip
NAMES = (
    "MYTH_IN", "MYTH_HIDDEN", "MYTH_CLASSES", "MYTH_BATCH", "MYTH_LR",
    "myth_model", "myth_batch", "flat_grads", "flat_params", "myths_worker",
    "bench_model", "ddp_step_times", "dataparallel_seconds",  # myth 5
    "ddp_gradient", "test_ddp_gradient",  # exercise 3
)  # fmt: skip
lesson = load_lesson_code("10", NAMES, NAMESPACE, folder=ROOT / "notebooks")


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


def test_exercise_3_solution_passes_stub_and_wrong_answers_fail(myths: list[dict], capsys) -> None:
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

    outcomes = {}
    try:
        for name, fn in [("solution", solution), ("stub", stub), ("sum", summed),
                         ("rank 0", rank_0_only), ("pooled", pooled)]:  # fmt: skip
            NAMESPACE["ddp_gradient"] = fn
            outcomes[name] = check("exercise 3", lesson.test_ddp_gradient, hint="")
            outcomes[name + " says"] = capsys.readouterr().out
    finally:
        NAMESPACE["ddp_gradient"] = solution
    assert outcomes["solution"], outcomes["solution says"]
    assert not outcomes["stub"] and "not implemented yet" in outcomes["stub says"]
    for wrong in ("sum", "rank 0", "pooled"):
        assert not outcomes[wrong], f"{wrong} passed"
        assert "differs from yours by up to" in outcomes[wrong + " says"]


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


def test_every_entry_the_messages_point_to_is_a_heading_of_the_lesson() -> None:
    notebook = json.loads((ROOT / "notebooks" / "10_troubleshooting.ipynb").read_text())
    markdown = "\n".join(
        "".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown"
    )
    found = re.findall(r"^### (\d+)\. (.+)$", markdown, re.MULTILINE)
    headings = {int(n): title.strip() for n, title in found}

    def same(a: str, b: str) -> bool:  # "A port taken" in a heading, "a port taken" in a message
        return a[:1].lower() + a[1:] == b[:1].lower() + b[1:]

    wrong = {
        n: (t, headings.get(n)) for n, t in ENTRIES.items() if not same(t, headings.get(n, ""))
    }
    assert not wrong, f"ENTRIES against the lesson's headings (entry: (ENTRIES, heading)): {wrong}"
    assert sorted(headings) == sorted(ENTRIES)
