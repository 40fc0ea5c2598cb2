"""Lesson 09b, section 1 and exercise 1: pipeline parallelism with torch.distributed.pipelining.

The code is the lessons' own, read from the notebooks (``load_lesson_code``: part 09a's model,
part 09b's pipeline), on a narrower model (WIDTH=16) so that the tests stay fast. One launch per
world size runs section 1's worker for both schedules (``ScheduleGPipe`` and ``Schedule1F1B``):
2 ranks with M=4 micro-batches and 4 ranks with M=8 (4 stages need DEPTH >= 4; M > S so that
1F1B's saving shows on stage 0). Each rank builds only its stage, on the meta device. Cutting
the model (``make_stage``, ``build_stage`` and ``pipeline()``) runs in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.exercises import check
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code

ROOT = Path(__file__).resolve().parents[1]
DEPTH, STEPS, BATCH = 4, 2, 8
NAMESPACE = {
    **lesson_imports("09a", ROOT / "notebooks"),  # the lessons' own imports
    **lesson_imports("09b", ROOT / "notebooks"),
    # the head's parameters, smaller: default arguments are bound when the code is loaded
    "WIDTH": 16, "HEADS": 2, "DEPTH": DEPTH, "SEQ": 8, "BATCH_SIZE": BATCH, "LR": 1e-3, "SEED": 0,
    "IN_FEATURES": 8, "CLASSES": 4,  # the head's `IN_FEATURES, CLASSES = 16, 10`
    "pp": [], "peaks": {}, "MICROBATCHES": 4,  # section 1's results and M, which exercise 1 reads
}  # fmt: skip
PART_A = (
    "Attention", "FeedForward", "Layer", "Net", "make_model", "make_batch", "PARAM_ATOL", "NOISE",
)  # fmt: skip
NAMES = (
    "make_stage", "build_stage", "make_pipeline", "pipeline_step", "pipeline_worker", "SCHEDULES",
    "GRAD_RTOL", "LOSS_ATOL",  # section 1
    "pipeline_costs", "test_pipeline_costs",  # exercise 1
)  # fmt: skip
load_lesson_code("09a", PART_A, NAMESPACE, folder=ROOT / "notebooks")
lesson = load_lesson_code("09b", NAMES, NAMESPACE, folder=ROOT / "notebooks")
for name in PART_A:
    setattr(lesson, name, NAMESPACE[name])
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


def run(n_ranks: int, microbatches: int, device: str = "cpu") -> list[dict]:
    """Section 1's worker on ``n_ranks`` stages: both schedules, one launch."""
    return launch(
        lesson.pipeline_worker, n_ranks, SCHEDULES, STEPS, 1, microbatches,
        device=device, echo=False, timeout=90,
    )  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run(2, 4)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run(4, 8)


def assert_like_one_device(results: list[dict]) -> None:
    """Section 1.3's checks: gradients, losses and parameters after STEPS Adam steps."""
    full = sorted(n for n, _ in lesson.make_model().named_parameters())
    lr = NAMESPACE["LR"]
    for name in SCHEDULES:
        assert sorted(n for r in results for n in r[name]["names"]) == full  # every tensor once
        scale = max(r[name]["grad_scale"] for r in results)
        assert max(r[name]["grad_diff"] for r in results) <= lesson.GRAD_RTOL * scale, name
        losses, ref = results[-1][name]["losses"], results[-1][name]["ref_losses"]
        assert len(losses) == STEPS
        assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < lesson.LOSS_ATOL
        assert max(r[name]["param_diff"] for r in results) <= 2 * lr * STEPS, name
        for r in results:  # beyond PARAM_ATOL only where one device's gradient is below NOISE
            assert not r[name]["param_outliers"], (name, r[name]["param_outliers"])
        assert all(r[name]["losses"] == [] for r in results[:-1])  # only the last stage has them


def test_both_schedules_train_like_one_device_on_two_ranks(two_ranks: list[dict]) -> None:
    assert_like_one_device(two_ranks)


@pytest.mark.slow  # 4 ranks: make test-long (the notebook and 2 ranks run in make test)
def test_both_schedules_train_like_one_device_on_four_ranks(four_ranks: list[dict]) -> None:
    assert_like_one_device(four_ranks)


def test_gpipe_and_1f1b_compute_the_same_gradients(two_ranks: list[dict]) -> None:
    for r in two_ranks:  # the same micro-batches, summed in the same order: bit for bit
        assert r["GPipe"]["grads"].keys() == r["1F1B"]["grads"].keys()
        assert all(torch.equal(g, r["1F1B"]["grads"][n]) for n, g in r["GPipe"]["grads"].items())
        assert r["GPipe"]["param_diff"] == r["1F1B"]["param_diff"]


@pytest.mark.parametrize(
    "fixture, micro", [("two_ranks", 4), pytest.param("four_ranks", 8, marks=pytest.mark.slow)]
)
def test_activation_peaks_follow_the_schedules(
    fixture: str, micro: int, request: pytest.FixtureRequest
) -> None:
    results = request.getfixturevalue(fixture)
    n = len(results)
    assert [r["GPipe"]["peak_micro"] for r in results] == [micro] * n
    assert [r["1F1B"]["peak_micro"] for r in results] == [min(micro, n - s) for s in range(n)]
    # M > S: on stage 0, GPipe holds more micro-batches' activations, and more bytes
    stage0 = results[0]
    assert stage0["GPipe"]["peak_micro"] > stage0["1F1B"]["peak_micro"]
    assert stage0["GPipe"]["peak_bytes"] > stage0["1F1B"]["peak_bytes"]
    # the bytes follow the counts: about the count times one micro-batch's saved tensors
    for r in results:
        for name in SCHEDULES:
            per_micro = r[name]["micro_bytes"]
            assert 0.9 * r[name]["peak_micro"] * per_micro <= r[name]["peak_bytes"]
            assert r[name]["peak_bytes"] <= 1.1 * r[name]["peak_micro"] * per_micro


@pytest.mark.slow
def test_timelines_hold_a_forward_and_a_backward_per_micro_batch(four_ranks: list[dict]) -> None:
    for name in SCHEDULES:
        for r in four_ranks:
            (timeline,) = r[name]["timelines"]  # one timed step
            boxes = sorted((kind, micro) for kind, micro, _, _ in timeline)
            assert boxes == sorted((k, m) for k in "FB" for m in range(8))
            assert all(start <= end for _, _, start, end in timeline)


def test_make_stage_splits_evenly_with_the_remainder_first() -> None:
    cases = ((4, 2, [2, 2]), (5, 2, [3, 2]), (5, 3, [2, 2, 1]), (4, 4, [1] * 4))
    for depth, n_stages, sizes in cases:
        full = [n for n, _ in lesson.make_model(depth=depth).named_parameters()]
        names, layers = [], []
        for s in range(n_stages):
            stage = lesson.make_stage(lesson.make_model(depth=depth), s, n_stages)
            names += [n for n, _ in stage.named_parameters()]
            layers.append(list(stage.layers))
            assert (stage.embed is not None) == (s == 0)
            assert (stage.head is not None) == (s == n_stages - 1)
        assert [len(k) for k in layers] == sizes
        assert sum(layers, []) == [str(i) for i in range(depth)]  # in order, each once
        assert sorted(names) == sorted(full) and len(names) == len(set(names))


def test_make_stage_refuses_what_cannot_be_split() -> None:
    with pytest.raises(ValueError, match=f"pass n_stages from 1 to {DEPTH}"):
        lesson.make_stage(lesson.make_model(), 0, DEPTH + 1)
    with pytest.raises(ValueError, match="at least one layer"):
        lesson.make_stage(lesson.make_model(), 0, 0)
    with pytest.raises(ValueError, match="pass a stage index from 0 to 1"):
        lesson.make_stage(lesson.make_model(), 2, 2)
    with pytest.raises(ValueError, match="stage index"):
        lesson.make_stage(lesson.make_model(), -1, 2)


def test_the_stage_of_one_stage_is_the_whole_model() -> None:
    whole = lesson.make_stage(lesson.make_model(), 0, 1)
    x, _ = lesson.make_batch(0, 0)
    assert torch.equal(whole(x), lesson.make_model()(x))


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_build_stage_on_meta_equals_make_model_bit_for_bit(n_stages: int) -> None:
    full = lesson.make_model().state_dict()
    seen = []
    for s in range(n_stages):
        stage = lesson.build_stage(s, n_stages, torch.device("cpu"))
        state = stage.state_dict()
        assert all(t.device.type == "cpu" for t in state.values())  # allocated, not meta
        assert all(torch.equal(t, full[n]) for n, t in state.items()), (n_stages, s)
        seen += list(state)
    assert sorted(seen) == sorted(full)


def test_build_stage_would_notice_a_wrong_seed() -> None:
    stage = lesson.build_stage(0, 2, torch.device("cpu"))
    NAMESPACE["SEED"] = 1
    try:
        other = lesson.build_stage(0, 2, torch.device("cpu"))
    finally:
        NAMESPACE["SEED"] = 0
    assert not torch.equal(stage.embed.weight, other.embed.weight)


@pytest.mark.slow  # a trace of a few seconds; lesson 09b's quick run checks the same cut
def test_pipeline_split_points_give_make_stages_parameters() -> None:
    from torch.distributed.pipelining import SplitPoint, pipeline

    with torch.device("meta"):
        model = lesson.Net()
    micro = lesson.make_batch(0, 0, 2)[0].to("meta")
    pipe = pipeline(model, mb_args=(micro,), split_spec={"layers.2": SplitPoint.BEGINNING})
    assert pipe.num_stages == 2
    for s in range(2):
        traced = sorted(n for n, _ in pipe.get_stage_module(s).named_parameters())
        cut = sorted(n for n, _ in lesson.make_stage(lesson.make_model(), s, 2).named_parameters())
        assert traced == cut


def test_exercise_1_passes_the_solution_and_fails_the_stub_and_wrong_answers(
    two_ranks: list[dict], capsys: pytest.CaptureFixture[str]
) -> None:
    NAMESPACE["pp"], NAMESPACE["MICROBATCHES"] = two_ranks, 4
    NAMESPACE["peaks"] = {name: [r[name]["peak_micro"] for r in two_ranks] for name in SCHEDULES}
    lesson.test_pipeline_costs()  # the solution passes, on the ranks' real counts too
    solution = lesson.pipeline_costs

    def stub(schedule: str, n_stages: int, n_micro: int) -> tuple[list[int], float]:
        raise NotImplementedError()

    def one_too_few(schedule: str, n_stages: int, n_micro: int) -> tuple[list[int], float]:
        held, idle = solution(schedule, n_stages, n_micro)  # S - s - 1 for 1F1B
        return ([h - 1 for h in held] if schedule == "1F1B" else held), idle

    def all_m(schedule: str, n_stages: int, n_micro: int) -> tuple[list[int], float]:
        return solution("GPipe", n_stages, n_micro)  # 1F1B holding all M, like GPipe

    def s_everywhere(schedule: str, n_stages: int, n_micro: int) -> tuple[list[int], float]:
        held, idle = solution(schedule, n_stages, n_micro)  # S on every stage for 1F1B
        return ([n_stages] * n_stages if schedule == "1F1B" else held), idle

    def smaller_bubble(schedule: str, n_stages: int, n_micro: int) -> tuple[list[int], float]:
        held, _ = solution(schedule, n_stages, n_micro)  # "1F1B shrinks the bubble"
        return held, (n_stages - 1) / (n_micro + n_stages - 1) / (2 if schedule == "1F1B" else 1)

    try:
        NAMESPACE["pipeline_costs"] = stub
        assert not check("exercise 1", lesson.test_pipeline_costs, hint="h")
        assert "FAIL  exercise 1: not implemented yet" in capsys.readouterr().out
        for wrong in (one_too_few, all_m, s_everywhere, smaller_bubble):
            NAMESPACE["pipeline_costs"] = wrong
            with pytest.raises(AssertionError):
                lesson.test_pipeline_costs()
    finally:
        NAMESPACE["pipeline_costs"] = solution


def memory_worker(env: DistEnv, microbatches: int) -> dict[str, int]:
    """Each schedule's allocator peak during one step on this GPU, above what it held before."""
    x, y = lesson.make_batch(0, 0, 64)
    peaks = {}
    for name, schedule_cls in SCHEDULES.items():
        model = lesson.make_stage(lesson.make_model(256).to(env.device), env.rank, env.world_size)
        stage, schedule = lesson.make_pipeline(env, model, schedule_cls, microbatches)
        lesson.pipeline_step(stage, schedule, x, y)  # warm-up: shapes, buffers, gradients
        torch.cuda.synchronize(env.device)
        before = torch.cuda.memory_allocated(env.device)
        torch.cuda.reset_peak_memory_stats(env.device)
        lesson.pipeline_step(stage, schedule, x, y)
        torch.cuda.synchronize(env.device)
        peaks[name] = torch.cuda.max_memory_allocated(env.device) - before
        del stage, schedule, model
    return peaks


@pytest.mark.gpu
def test_one_stage_pipeline_on_a_gpu_holds_one_micro_batch_under_1f1b() -> None:
    # one process, one stage: both schedules on cuda:0 (NCCL needs a GPU per rank, so one rank)
    results = run(1, 8, device="cuda")
    assert_like_one_device(results)
    assert results[0]["GPipe"]["peak_micro"] == 8 and results[0]["1F1B"]["peak_micro"] == 1
    peaks = launch(memory_worker, 1, 8, device="cuda", echo=False, timeout=120)[0]
    assert peaks["1F1B"] < 0.5 * peaks["GPipe"], peaks  # the allocator agrees: 1 of 8 micro-batches


@pytest.mark.multigpu
def test_pipeline_on_two_gpus_trains_like_one_and_1f1b_holds_less() -> None:
    results = run(2, 8, device="cuda")
    assert_like_one_device(results)
    assert [r["1F1B"]["peak_micro"] for r in results] == [2, 1]
    peaks = launch(memory_worker, 2, 8, device="cuda", echo=False, timeout=120)
    assert peaks[0]["1F1B"] < peaks[0]["GPipe"], peaks  # stage 0: 2 of 8 micro-batches alive
