"""Lesson 09, sections 1 and 2 and exercise 1: DTensor, tensor parallelism by hand and with the API.

The code is the lesson's own, read from its notebook (``load_lesson_code``), on a smaller model
(WIDTH=32, HEADS=4, DEPTH=2, SEQ=8) so that the tests stay fast. One launch per world size (2
and 4 gloo processes) runs section 1's tour, section 2's tour (the hand-written column- and
row-parallel layers and MLP, ``apply_tp`` with and without sequence parallelism against one
device, a few Adam steps, the refusal of 3 heads) and exercise 1's trial with the solution and
two wrong answers. ``test_..._on_two_gpus`` runs the same launch over NCCL on 2 GPUs (skipped
without them): there ``Shard -> Shard`` must be an all-to-all, and the column split is held to
the tolerance, not to bit equality.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.exercises import check
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code
from mgpu_helpers.placement import place

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = {
    **lesson_imports("09", ROOT / "notebooks"),  # the lesson's own imports
    # the head's parameters, smaller: default arguments are bound when the code is loaded
    "WIDTH": 32, "HEADS": 4, "DEPTH": 2, "SEQ": 8, "BATCH_SIZE": 4, "LR": 1e-3, "SEED": 0,
    "IN_FEATURES": 16, "CLASSES": 10, "TIMEOUT": 60,
    "placement": place(2, "cpu"),
    "tp_placement": place(2, "cpu"),  # exercise 1's check launches on it
}  # fmt: skip
NAMES = (
    "Attention", "FeedForward", "Layer", "Net", "make_model", "make_batch",  # the head
    "make_mesh", "collective_name", "counted", "REDISTRIBUTIONS", "dtensor_tour",
    "received_bytes",  # section 1
    "column_parallel_linear", "row_parallel_linear", "CopyToParallel", "ReduceFromParallel",
    "tp_mlp", "by_hand", "apply_tp", "TP_ATOL", "param_bytes", "layer_counts",
    "tp_tour",  # section 2
    "row_parallel_forward", "row_parallel_trial", "test_row_parallel_forward",  # exercise 1
)  # fmt: skip
lesson = load_lesson_code("09", NAMES, NAMESPACE, folder=ROOT / "notebooks")
DEPTH, STEPS = NAMESPACE["DEPTH"], 2


def bias_on_every_rank(x_local, w_local, bias, group=None):  # noqa: ANN001, ANN201
    """A plausible wrong answer: the bias added before the all-reduce, so N times."""
    y = x_local @ w_local.T + bias
    dist.all_reduce(y, group=group)
    return y


def no_all_reduce(x_local, w_local, bias, group=None):  # noqa: ANN001, ANN201
    """A plausible wrong answer: this rank's partial sum, never added up."""
    return x_local @ w_local.T + bias


def stub(x_local, w_local, bias, group=None):  # noqa: ANN001, ANN201
    raise NotImplementedError()


ANSWERS = {"solution": lesson.row_parallel_forward, "bias N times": bias_on_every_rank,
           "no all-reduce": no_all_reduce}  # fmt: skip


def everything(env: DistEnv, steps: int) -> dict:
    """Sections 1 and 2 and exercise 1's trials on this rank: one launch."""
    return {
        "dtensor": lesson.dtensor_tour(env),
        "tp": lesson.tp_tour(env, steps),
        "exercise": {name: lesson.row_parallel_trial(env, fn) for name, fn in ANSWERS.items()},
        "device": str(env.device),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return launch(everything, 2, STEPS, device="cpu", echo=False, timeout=60)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return launch(everything, 4, STEPS, device="cpu", echo=False, timeout=120)


@pytest.fixture(params=["two", pytest.param("four", marks=pytest.mark.slow)])  # slow: test-long
def ranks(request: pytest.FixtureRequest) -> list[dict]:
    return request.getfixturevalue(f"{request.param}_ranks")


def test_make_mesh_refuses_bad_shapes_naming_ones_that_fit() -> None:
    env = DistEnv(rank=0, local_rank=0, world_size=4, device=torch.device("cpu"), backend="gloo")
    for shape in ((3,), (2, 3), (0, 4), (4, 1.0), ()):
        with pytest.raises(ValueError, match=r"shapes that fit: \(4,\), \(2, 2\)"):
            lesson.make_mesh(env, shape, tuple(f"d{i}" for i in range(len(shape))))
    with pytest.raises(ValueError, match="one name per mesh dimension"):
        lesson.make_mesh(env, (2, 2), ("dp",))


def test_received_bytes_follow_the_ring_model() -> None:
    assert lesson.received_bytes("all-gather", 128, 4) == 96
    assert lesson.received_bytes("all-reduce", 128, 4) == 192
    assert lesson.received_bytes("all-to-all", 128, 4) == 24
    assert lesson.received_bytes("none", 128, 4) == 0


def check_redistributions(ranks: list[dict], device_type: str) -> None:
    """Section 1's claims: each redistribute runs one claimed collective; the data is right."""
    n = len(ranks)
    claims = {"Shard(0) -> Replicate": {"all-gather": 1}, "Replicate -> Shard(0)": {},
              # GPUs: DTensor's all-to-all; CPU: its fallback, an all-gather (and a logged note)
              "Shard(0) -> Shard(1)": {"all-gather" if device_type == "cpu" else "all-to-all": 1},
              "Partial -> Replicate": {"all-reduce": 1},
              "Partial -> Shard(0)": {"reduce-scatter": 1}}  # fmt: skip
    for result in ranks:
        for name, counts in claims.items():
            change = result["dtensor"]["changes"][name]
            assert change["counts"] == counts and change["right"], (n, name, change)
        if device_type == "cpu":  # the fallback's note was caught (not printed to stderr)
            notes = result["dtensor"]["notes"]
            assert any("allgather" in note for note in notes), notes
    # every element of the 4 x 8 matrix on exactly one rank under Shard(0) and Shard(1)
    for placement_name in ("Shard(0)", "Shard(1)"):
        values = torch.cat([r["dtensor"]["local"][placement_name].flatten() for r in ranks])
        assert sorted(values.tolist()) == list(range(32))
    pieces = [len(c) for c in torch.arange(5).chunk(n)]
    assert [r["dtensor"]["uneven_rows"] for r in ranks] == pieces + [0] * (n - len(pieces))


def test_redistributions_run_the_claimed_collectives(ranks: list[dict]) -> None:
    check_redistributions(ranks, "cpu")


def check_hand_written_splits(ranks: list[dict], device_type: str) -> None:
    """Section 2.1: the splits and the split MLP equal the unsplit ones; an all-reduce each way."""
    for result in ranks:
        hand = result["tp"]["by_hand"]
        # CPU: each element the same dot product, bit for bit (measured); GPUs: other kernels
        assert hand["column"] == 0.0 if device_type == "cpu" else hand["column"] <= lesson.TP_ATOL
        assert hand["row"] <= lesson.TP_ATOL and hand["mlp_forward"] <= lesson.TP_ATOL
        assert max(hand["mlp_grads"].values()) <= lesson.TP_ATOL
        assert set(hand["mlp_grads"]) == {"x", "up.weight", "up.bias", "down.weight", "down.bias"}
        assert hand["mlp_counts"] == ({"all-reduce": 1}, {"all-reduce": 1})


def test_hand_written_splits_equal_the_unsplit_layer(ranks: list[dict]) -> None:
    check_hand_written_splits(ranks, "cpu")


def check_apply_tp(ranks: list[dict], device_type: str) -> None:
    """Section 2.2-2.5: apply_tp with and without sequence parallelism equals one device."""
    n = len(ranks)
    for result in ranks:
        for kind in ("tp", "sp"):
            run = result["tp"][kind]
            assert run["forward"] <= lesson.TP_ATOL, (n, kind, run)
            assert run["grads"] <= lesson.TP_ATOL, (n, kind, run)
            losses = run["losses"]
            assert len(losses) == STEPS
            close = [abs(a - b) <= lesson.TP_ATOL * max(1.0, abs(b)) for a, b in losses]
            assert all(close), (n, kind, losses)
        held, whole = result["tp"]["tp"]["bytes"]
        assert whole / n < held < whole
        # with SP only: the optimizer sums the Partial gradients (norms, row-parallel biases)
        # 6 Partial gradients per layer, each read twice by torch 2.14's single-tensor Adam (CPU);
        # GPUs run the foreach Adam: all-reduces, how many not pinned
        sent = result["tp"]["sp"]["optimizer"]
        if device_type == "cpu":
            assert sent == {"all-reduce": 12 * DEPTH}, sent
        assert set(sent) == {"all-reduce"}, sent
        assert result["tp"]["tp"]["optimizer"] == {}


def test_apply_tp_equals_one_device_and_trains_alike(ranks: list[dict]) -> None:
    check_apply_tp(ranks, "cpu")


def test_apply_tp_communication_per_layer(ranks: list[dict]) -> None:
    tp = ranks[0]["tp"]["tp"]
    assert tp["layer"]["attn"] == {"forward": {"all-reduce": 1}, "backward": {"all-reduce": 3}}
    assert tp["layer"]["ff"] == {"forward": {"all-reduce": 1}, "backward": {"all-reduce": 1}}
    assert tp["total"]["forward"] == {"all-reduce": 2 * DEPTH}
    assert tp["total"]["backward"] == {"all-reduce": 4 * DEPTH}
    assert tp["all"] == {"all-reduce": 6 * DEPTH}
    sp = ranks[0]["tp"]["sp"]
    assert sp["layer"]["ff"]["forward"] == {"all-gather": 1, "reduce-scatter": 1}
    assert sp["layer"]["attn"]["forward"] == {"all-gather": 3, "reduce-scatter": 1}
    assert "all-reduce" not in sp["total"]["forward"]
    assert set(sp["all"]) == {"all-gather", "reduce-scatter"}


def test_layer_counts_falls_back_without_per_module_counts() -> None:
    class Bare:  # a CommDebugMode of a torch without comm_module_counts
        pass

    assert lesson.layer_counts(Bare(), "Global") is None


def test_apply_tp_refuses_heads_that_do_not_split(ranks: list[dict]) -> None:
    refusal = ranks[0]["tp"]["refusal"]
    assert f"do not split over {len(ranks)}" in refusal and "multiple of" in refusal


def check_exercise_1(ranks: list[dict]) -> None:
    """Exercise 1's trial: the solution within TP_ATOL, both wrong answers far outside."""
    for result in ranks:
        errors = result["exercise"]
        assert errors["solution"] <= lesson.TP_ATOL
        assert errors["bias N times"] > 10 * lesson.TP_ATOL
        assert errors["no all-reduce"] > 10 * lesson.TP_ATOL


def test_exercise_1_solution_passes_wrong_answers_fail(ranks: list[dict]) -> None:
    check_exercise_1(ranks)


@pytest.mark.multigpu
def test_sections_1_2_and_exercise_1_on_two_gpus() -> None:
    """The same launch, one rank per GPU over NCCL: the same checks, with the GPU's claims."""
    results = launch(everything, place(2, "cuda"), STEPS, echo=False, timeout=180)
    assert all(r["device"].startswith("cuda") for r in results), [r["device"] for r in results]
    check_redistributions(results, "cuda")  # Shard -> Shard: a real all-to-all here
    check_hand_written_splits(results, "cuda")
    check_apply_tp(results, "cuda")
    check_exercise_1(results)
    hand, tp, sp = results[0]["tp"]["by_hand"], results[0]["tp"]["tp"], results[0]["tp"]["sp"]
    print(
        f"2 GPUs, NCCL: column {hand['column']:.1e}, row {hand['row']:.1e}, MLP grads (relative)"
        f" {max(hand['mlp_grads'].values()):.1e}; apply_tp logits {tp['forward']:.1e}, grads"
        f" {tp['grads']:.1e}; SP logits {sp['forward']:.1e}, grads {sp['grads']:.1e}"
    )


def test_exercise_1_check_says_not_implemented_for_the_stub(capsys: pytest.CaptureFixture) -> None:
    solution = lesson.row_parallel_forward
    try:
        NAMESPACE["row_parallel_forward"] = stub
        assert not check("exercise 1", lesson.test_row_parallel_forward, hint="h")
        assert "FAIL  exercise 1: not implemented yet" in capsys.readouterr().out
    finally:
        NAMESPACE["row_parallel_forward"] = solution
