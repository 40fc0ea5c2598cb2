"""Lesson 08a, section 2: ZeRO-1 and ZeRO-2 written by hand equal DDP, and hold what they should.

The trainers are the lesson's own code, read from its notebook (``load_lesson_code``), run on a
small model (WIDTH=7, DEPTH=2: 1,417 parameters, a count that neither 2 nor 3 ranks divide, so
the flat vector is padded). One launch per world size serves every test of that size: the
lesson's lockstep comparison (with a ZeRO that forgets to divide by N, which it must reject),
train_worker's runs, and a step without a backward. The exercises' checks are tested against
their solutions, stubs and plausible wrong answers (exercise 1 in launches of its own).
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.exercises import check
from mgpu_helpers.launch import WorkerError, launch
from mgpu_helpers.lesson_code import load_lesson_code
from mgpu_helpers.memory import optimizer_state_bytes, tensor_bytes
from mgpu_helpers.placement import place

ROOT = Path(__file__).resolve().parents[1]
NAMES = (
    "WIDTH", "DEPTH", "BATCH_SIZE", "LR", "SEED",
    "Block", "Net", "make_model", "make_batch", "shard_layout",
    "DDPTrainer", "ZeroTrainer", "NOISE", "train_worker", "lockstep_worker",
)  # fmt: skip
NAMESPACE = {
    "DDP": DDP, "DistEnv": DistEnv, "F": F, "dist": dist, "functools": functools, "nn": nn,
    "time": time, "torch": torch, "tensor_bytes": tensor_bytes,
    "optimizer_state_bytes": optimizer_state_bytes,
    "IN_FEATURES": 64, "CLASSES": 10,  # the head's `IN_FEATURES, CLASSES = 64, 10`
}  # fmt: skip
lesson = load_lesson_code("08a", NAMES, NAMESPACE, folder=ROOT / "notebooks")
WIDTH, DEPTH, PER_RANK, STEPS = 7, 2, 4, 3
N_PARAMS = 1417  # 64·7+7 (embed) + 2·(2·7 + 7·28+28 + 28·7+7) (blocks) + 7·10+10 (head)
TRAINERS = {
    "DDP": lesson.DDPTrainer,
    "ZeRO-1": functools.partial(lesson.ZeroTrainer, stage=1),
    "ZeRO-2": functools.partial(lesson.ZeroTrainer, stage=2),
}


class NoDivision(lesson.ZeroTrainer):
    """A wrong ZeRO, the negative control: the gradient Adam reads is the sum, not the average."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer.register_step_pre_hook(self.undo_division)

    def undo_division(self, *_: object) -> None:
        """Just before Adam reads the gradient: times N, as if the division had been forgotten."""
        self.shard.grad.mul_(self.env.world_size)


LOCKSTEP = {
    **TRAINERS,
    "no division 1": functools.partial(NoDivision, stage=1),
    "no division 2": functools.partial(NoDivision, stage=2),
}


def run(env: DistEnv) -> dict:
    sizes = {"width": WIDTH, "depth": DEPTH, "per_rank": PER_RANK}
    result = {
        "lockstep": lesson.lockstep_worker(env, LOCKSTEP, STEPS, **sizes),
        "runs": lesson.train_worker(env, TRAINERS, STEPS, **sizes),
    }
    trainer = lesson.ZeroTrainer(lesson.make_model(WIDTH, DEPTH).to(env.device), env, 1e-3)
    try:
        trainer.step()  # no backward before: no gradients to exchange
    except RuntimeError as error:  # raised before any collective, so on every rank
        result["no backward"] = str(error)
    return result


class TinyAttention(nn.Module):
    """Eight tokens of 8 inputs each, one self-attention layer with biases, mean-pooled, a head.

    The gradient of an attention key's bias is zero in exact arithmetic (softmax does not change
    when one number is added to every score of a row); in float32 it is rounding noise. That is
    the case the lesson's noise-level tolerance is for."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.attention = nn.MultiheadAttention(width, num_heads=2, batch_first=True)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.view(x.shape[0], 8, 8))
        mixed, _ = self.attention(tokens, tokens, tokens, need_weights=False)
        return self.head((tokens + mixed).mean(dim=1))


def make_attention_model(width: int = 16, depth: int = 1) -> TinyAttention:
    torch.manual_seed(0)
    return TinyAttention(width)


# The lesson's trainers and lockstep comparison once more, with the attention model in place of
# the lesson's MLP (make_model is the one name the comparison builds its models with).
attention = load_lesson_code(
    "08a", ("make_batch", "DDPTrainer", "ZeroTrainer", "NOISE", "lockstep_worker"),
    {**NAMESPACE, "make_model": make_attention_model}, folder=ROOT / "notebooks",
)
ATTENTION_WIDTH = 16


def attention_lockstep(env: DistEnv) -> dict:
    trainers = {
        "DDP": attention.DDPTrainer,
        "ZeRO-1": functools.partial(attention.ZeroTrainer, stage=1),
        "ZeRO-2": functools.partial(attention.ZeroTrainer, stage=2),
    }
    return attention.lockstep_worker(env, trainers, STEPS, ATTENTION_WIDTH, 1, per_rank=PER_RANK)


def test_on_an_attention_model_with_3_ranks_the_gradient_is_the_proof() -> None:
    """Issue 24, finding 3: with 3 ranks the averages differ in their last bits, and where a
    gradient is zero in exact arithmetic (the key biases) Adam turns that noise into steps of
    about +-LR. The lesson's criterion: the gradient Adam reads within 0.1%, the parameters
    within LR / 100 except elements whose gradient is at noise level, within 2 LR per step."""
    lr = lesson.LR
    for rank in launch(attention_lockstep, 3, device="cpu", echo=False, timeout=60):
        for name in ("ZeRO-1", "ZeRO-2"):
            report = rank[name]
            assert report["gradient ok"] == [True] * STEPS, (name, report["gradient"])
            assert report["noisy"] >= ATTENTION_WIDTH, report  # at least the key biases
            assert max(report["parameter"]) <= lr / 100, (name, report["parameter"])
            assert max(report["noise"]) <= 2 * lr * STEPS, (name, report["noise"])


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def launched(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, launch(run, request.param, device="cpu", echo=False, timeout=60)


@pytest.fixture(scope="module")
def runs(launched: tuple[int, list[dict]]) -> tuple[int, list[dict[str, dict]]]:
    world_size, per_rank = launched
    return world_size, [rank["runs"] for rank in per_rank]


def test_the_model_has_a_count_that_does_not_divide() -> None:
    assert sum(p.numel() for p in lesson.make_model(WIDTH, DEPTH).parameters()) == N_PARAMS
    assert lesson.shard_layout(N_PARAMS, 2) == (709, 1)
    assert lesson.shard_layout(N_PARAMS, 3) == (473, 2)
    assert lesson.shard_layout(12, 4) == (3, 0)


def test_the_gradient_adam_reads_equals_ddps_and_a_missing_division_is_caught(
    launched: tuple[int, list[dict]],
) -> None:
    """After every step, each ZeRO trainer's shard gradient against DDP's averaged .grad cut
    the same way: bit for bit on 2 CPU ranks, otherwise within 0.1% of the largest gradient
    (rounding gives 1e-7 in the first step; later steps start from weights that differ a
    little, about 2e-6 at the lesson's size). A ZeRO without the division by N fails it at
    every step, on every rank, by (N - 1) x the largest gradient, although its parameters
    end within the 3-rank tolerance here, 2e-7 from DDP's (Adam hides the scale)."""
    world_size, per_rank = launched
    for rank in per_rank:
        lockstep = rank["lockstep"]
        assert set(lockstep) == set(LOCKSTEP) - {"DDP"}
        for name in ("ZeRO-1", "ZeRO-2"):
            ok = lockstep[name]["gradient ok"]
            assert ok == [True] * STEPS, (name, lockstep[name]["gradient"])
            if world_size == 2:
                assert lockstep[name]["gradient"] == lockstep[name]["parameter"] == [0.0] * STEPS
                assert lockstep[name]["noise"] == [0.0] * STEPS
            else:
                assert max(lockstep[name]["parameter"]) <= lesson.LR / 100
                assert max(lockstep[name]["noise"]) <= 2 * lesson.LR * STEPS
        for name in ("no division 1", "no division 2"):
            assert lockstep[name]["gradient ok"] == [False] * STEPS, name
            assert min(lockstep[name]["gradient"]) > 0.5  # N times the average: off by (N - 1) x


def test_a_step_without_gradients_fails_on_every_rank_instead_of_hanging(
    launched: tuple[int, list[dict]],
) -> None:
    _, per_rank = launched
    for rank in per_rank:
        assert "call loss.backward() before step()" in rank["no backward"]


def test_zero_1_and_2_equal_ddp(runs: tuple[int, list[dict[str, dict]]]) -> None:
    """Two ranks on the CPU: bit for bit (DDP scales each rank's gradient by 1/2 before the
    sum, ZeRO halves the sum: halving is exact but for subnormals, and a sum of two numbers
    has one order). Three: DDP scales by 1/3 before summing and adds in its own order, so the
    averages differ in the terms' last bits; where the ranks' gradients nearly cancel to a sum
    near eps, Adam's step, about lr·g/(|g| + eps), turns that into a visible fraction of lr. The
    lesson allows 1% of one step, LR / 100, and so does this test."""
    world_size, per_rank = runs
    ddp = per_rank[0]["DDP"]
    for name in ("ZeRO-1", "ZeRO-2"):
        mine = per_rank[0][name]
        assert mine["state"].keys() == ddp["state"].keys()
        for key, value in ddp["state"].items():
            if world_size == 2:
                assert torch.equal(mine["state"][key], value), (name, key)
            else:
                torch.testing.assert_close(mine["state"][key], value, rtol=0, atol=lesson.LR / 100)
        if world_size == 2:
            assert mine["losses"] == ddp["losses"]
        else:
            assert mine["losses"] == pytest.approx(ddp["losses"], abs=1e-5)
    assert all(rank[n]["state"] is None for rank in per_rank[1:] for n in TRAINERS)  # rank 0's only
    initial = dict(lesson.make_model(WIDTH, DEPTH).named_parameters())
    for key, value in ddp["state"].items():  # every parameter moved: the trainers stepped
        assert not torch.equal(value, initial[key]), key


def test_each_rank_holds_what_was_predicted(runs: tuple[int, list[dict[str, dict]]]) -> None:
    """Per rank: DDP all of it; ZeRO-1 Adam's state of its padded slice; ZeRO-2 also only its
    slice's gradient. ZeRO keeps the whole model plus its float32 slice as parameters."""
    world_size, per_rank = runs
    shard, pad = lesson.shard_layout(N_PARAMS, world_size)
    expected = {
        "DDP": {"parameters": 4 * N_PARAMS, "gradients": 4 * N_PARAMS, "optimizer": 8 * N_PARAMS},
        "ZeRO-1": {"parameters": 4 * (N_PARAMS + shard), "gradients": 4 * (N_PARAMS + pad),
                   "optimizer": 8 * shard},
        "ZeRO-2": {"parameters": 4 * (N_PARAMS + shard), "gradients": 4 * shard,
                   "optimizer": 8 * shard},
    }  # fmt: skip
    for rank in per_rank:
        for name, memory in expected.items():
            assert rank[name]["memory"] == memory, (name, rank[name]["memory"])
            assert rank[name]["peak_cuda"] is None  # CPU ranks: no allocator to ask
            assert rank[name]["allocated_cuda"] is None
            assert len(rank[name]["seconds"]) == STEPS
    # the predicted ratios: optimizer / N (+ padding), ZeRO-2's gradients / N (+ padding)
    ddp, z2 = per_rank[0]["DDP"]["memory"], per_rank[0]["ZeRO-2"]["memory"]
    assert z2["optimizer"] * world_size == ddp["optimizer"] + 8 * pad
    assert z2["gradients"] * world_size == ddp["gradients"] + 4 * pad


def test_exercise_1s_check_passes_the_solution_and_fails_a_stub_and_wrong_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exercise 1, zero2_step, on 2 CPU ranks and the small model: the solution passes its
    check (bit for bit); a stub fails as not implemented; so do a step that forgets the
    division by N, one that never copies the gathered parameters into the model, and one that
    keeps the full gradients."""
    namespace = {
        **NAMESPACE, "DDPTrainer": lesson.DDPTrainer, "NOISE": lesson.NOISE, "LR": lesson.LR,
        "make_model": functools.partial(lesson.make_model, WIDTH, DEPTH),
        "make_batch": functools.partial(lesson.make_batch, per_rank=PER_RANK),
        "launch": launch, "WorkerError": WorkerError, "placement": place(2, "cpu"),
        "steps": 2, "TIMEOUT": 60, "exact": True, "tolerance": 0.0,
    }  # fmt: skip
    names = ("zero2_step", "zero2_worker", "test_zero2_step")
    exercise = load_lesson_code("08a", names, namespace, folder=ROOT / "notebooks")
    solution = exercise.zero2_step
    exercise.test_zero2_step()

    def no_division(params, shards, optimizer, world_size: int) -> None:  # Adam reads the sum
        def times_n(*_: object) -> None:  # just before Adam reads them
            for shard in shards:
                shard.grad.mul_(world_size)

        hook = optimizer.register_step_pre_hook(times_n)
        solution(params, shards, optimizer, world_size)
        hook.remove()

    def not_copied_back(params, shards, optimizer, world_size: int) -> None:  # the model stays
        copies = [nn.Parameter(p.detach().clone()) for p in params]
        for copy, p in zip(copies, params, strict=True):
            copy.grad, p.grad = p.grad, None
        solution(copies, shards, optimizer, world_size)

    def keeps_gradients(params, shards, optimizer, world_size: int) -> None:  # ZeRO-1's memory
        grads = [p.grad for p in params]
        solution(params, shards, optimizer, world_size)
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad

    def stub(params, shards, optimizer, world_size: int) -> None:
        raise NotImplementedError()

    expected = {no_division: "the gradient Adam read", not_copied_back: "the parameters are",
                keeps_gradients: "kept a full gradient", stub: "not implemented yet"}  # fmt: skip
    try:
        for wrong, message in expected.items():
            namespace["zero2_step"] = wrong
            assert not check("exercise 1: zero2_step", exercise.test_zero2_step, hint="-")
            assert message in capsys.readouterr().out, wrong.__name__
    finally:
        namespace["zero2_step"] = solution


def test_exercise_2s_check_passes_the_solution_and_fails_a_stub_and_wrong_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exercise 2, sent_per_step (section 2.4 names the collectives, not their bytes): the
    solution passes; a stub fails as not implemented; so do ZeRO-1 counted as the ZeRO paper's
    (a reduce-scatter, not an all-reduce) and ZeRO's collectives counted without the padding."""
    namespace = {"math": math, "shard_layout": lesson.shard_layout, "n_params": N_PARAMS,
                 "world_size": 3}  # fmt: skip
    names = ("sent_per_step", "test_sent_per_step")
    exercise = load_lesson_code("08a", names, namespace, folder=ROOT / "notebooks")
    solution = exercise.sent_per_step
    exercise.test_sent_per_step()

    def papers_zero1(n: int, ranks: int, method: str) -> float:
        return solution(n, ranks, "zero2" if method == "zero1" else method)

    def no_padding(n: int, ranks: int, method: str) -> float:
        return solution(n, ranks, method) if method == "ddp" else solution(n, ranks, "ddp") * (
            1.5 if method == "zero1" else 1.0)

    def stub(n: int, ranks: int, method: str) -> float:
        raise NotImplementedError()

    try:
        for wrong in (papers_zero1, no_padding):
            namespace["sent_per_step"] = wrong
            with pytest.raises(AssertionError):
                exercise.test_sent_per_step()
        namespace["sent_per_step"] = stub
        assert not check("exercise 2: sent_per_step", exercise.test_sent_per_step, hint="-")
        assert "not implemented yet" in capsys.readouterr().out
    finally:
        namespace["sent_per_step"] = solution


def test_a_bad_stage_is_refused_with_the_fix() -> None:
    env = DistEnv(0, 0, 2, torch.device("cpu"), "gloo")
    with pytest.raises(ValueError, match="use FSDP"):
        lesson.ZeroTrainer(lesson.make_model(WIDTH, DEPTH), env, 1e-3, stage=3)


@pytest.mark.multigpu
def test_zero_equals_ddp_over_nccl() -> None:
    """One GPU per rank: NCCL's collectives. The gradient check (with the tolerance, NCCL
    sums in its own order) passes and rejects the missing division; per trainer, the
    allocator's own peak (above what existed before the trainer) holds at least the counted
    model state, and ZeRO-2 still holds less than DDP after its step."""
    per_rank = launch(run, place(2, "cuda"), echo=False, timeout=120)
    ddp = per_rank[0]["runs"]["DDP"]
    for name in ("ZeRO-1", "ZeRO-2"):
        for key, value in ddp["state"].items():
            mine = per_rank[0]["runs"][name]["state"][key]
            torch.testing.assert_close(mine, value, rtol=0, atol=1e-5)
    shard, _ = lesson.shard_layout(N_PARAMS, 2)
    for rank in per_rank:
        runs = rank["runs"]
        assert runs["ZeRO-2"]["memory"]["gradients"] == 4 * shard
        for name in TRAINERS:
            assert runs[name]["peak_cuda"] >= sum(runs[name]["memory"].values()), (name, runs[name])
        assert runs["ZeRO-2"]["allocated_cuda"] < runs["DDP"]["allocated_cuda"]
        for name in ("ZeRO-1", "ZeRO-2"):
            assert rank["lockstep"][name]["gradient ok"] == [True] * STEPS, rank["lockstep"][name]
        for name in ("no division 1", "no division 2"):
            assert rank["lockstep"][name]["gradient ok"] == [False] * STEPS, name
