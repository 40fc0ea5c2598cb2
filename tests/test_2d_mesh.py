"""Lesson 09b, section 2 and exercise 2: FSDP2 x tensor parallelism on a 2-D mesh, choosing a mesh.

The code is the lessons' own, read from the notebooks (``load_lesson_code``: part 09a's model and
``apply_tp``, part 09b's mesh code), on a smaller model (WIDTH=32, DEPTH=2, SEQ=8) so that the
test stays fast. One launch of 4 gloo processes trains the 2 x 2 mesh three times: as the lesson
does (each dp row its own batch), and wrongly twice: with both rows given the same batch, and
with FSDP2 summing the rows' gradients instead of averaging them (every gradient doubled). The
first must train like one device on the global batch within the lesson's tolerances, the others
must fail the same check: the second by orders of magnitude, the third through its gradients,
which the losses and parameters after Adam do not show.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mgpu_helpers.devices import gpu_count
from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.exercises import check
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code
from mgpu_helpers.placement import place
from mgpu_helpers.tensor_parallel import locate

ROOT = Path(__file__).resolve().parents[1]
WIDTH, DEPTH, STEPS = 32, 2, 2
NAMESPACE = {
    **lesson_imports("09a", ROOT / "notebooks"),  # the lessons' own imports
    **lesson_imports("09b", ROOT / "notebooks"),
    # the head's parameters, smaller: default arguments are bound when the code is loaded
    "WIDTH": WIDTH, "HEADS": 4, "DEPTH": DEPTH, "SEQ": 8, "BATCH_SIZE": 4, "LR": 1e-3, "SEED": 0,
    "IN_FEATURES": 16, "CLASSES": 10,
}  # fmt: skip
PART_A = ("Attention", "FeedForward", "Layer", "Net", "make_model", "make_batch", "make_mesh",
          "apply_tp", "full", "PARAM_ATOL", "NOISE")  # fmt: skip
NAMES = (
    "GRAD_RTOL",  # section 1
    "apply_2d", "SHOWN", "BLOCKS", "gathered", "train_2d", "LOSS_RTOL", "one_device",
    "compare_runs",  # section 2
    "choose_mesh", "test_choose_mesh",  # exercise 2
)  # fmt: skip
part_a = load_lesson_code("09a", PART_A, NAMESPACE, folder=ROOT / "notebooks")
lesson = load_lesson_code("09b", NAMES, NAMESPACE, folder=ROOT / "notebooks")


def apply_2d_summed(model: torch.nn.Module, mesh: object) -> torch.nn.Module:
    """The lesson's apply_2d, then FSDP2 told to sum over dp instead of averaging: gradients x2."""
    lesson.apply_2d(model, mesh)
    for module in (*model.layers.values(), model):
        module.set_gradient_divide_factor(1.0)
    return model


def right_and_wrong(env: DistEnv, steps: int) -> dict:
    """The lesson's training, then the two wrong set-ups: one launch."""
    out = {"right": lesson.train_2d(env, steps), "same batch": lesson.train_2d(env, steps, True)}
    right = NAMESPACE["apply_2d"]
    try:
        NAMESPACE["apply_2d"] = apply_2d_summed  # what train_2d calls
        out["summed"] = lesson.train_2d(env, steps)
    finally:
        NAMESPACE["apply_2d"] = right
    return out


@pytest.fixture(scope="module")
def mesh_runs() -> list[dict]:
    return launch(right_and_wrong, 4, STEPS, device="cpu", echo=False, timeout=120)


@pytest.fixture(scope="module")
def reference() -> dict:
    return lesson.one_device(STEPS)


@pytest.mark.slow  # make test-long (CI): 4 ranks; lesson 09b's quick run checks the right mesh
def test_the_2d_mesh_trains_like_one_device_within_the_tolerance(
    mesh_runs: list[dict], reference: dict
) -> None:
    runs = [r["right"] for r in mesh_runs]
    assert [r["coords"] for r in runs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["losses"] == runs[0]["losses"] for r in runs)  # every rank: the global loss
    result = lesson.compare_runs(runs[0], reference, STEPS)
    assert result["within"], result
    assert result["grad_rel"] <= lesson.GRAD_RTOL and result["loss_rel"] <= lesson.LOSS_RTOL
    # the elements excused (one device's gradient below NOISE) are needed: they drift further
    assert result["largest"] < part_a.PARAM_ATOL < result["noise"]
    assert runs[0]["state"] is not None and runs[1]["state"] is None  # rank 0 keeps them


@pytest.mark.slow  # make test-long (CI): 4 ranks; lesson 09b's quick run checks the right mesh
def test_the_check_fails_when_both_dp_rows_get_the_same_batch(
    mesh_runs: list[dict], reference: dict
) -> None:
    wrong = lesson.compare_runs(mesh_runs[0]["same batch"], reference, STEPS)
    assert not wrong["within"]
    assert wrong["loss_rel"] > 100 * lesson.LOSS_RTOL and wrong["grad_rel"] > 0.1


@pytest.mark.slow  # make test-long (CI): 4 ranks; lesson 09b's quick run checks the right mesh
def test_the_check_fails_when_fsdp2_sums_the_gradients_over_dp(
    mesh_runs: list[dict], reference: dict
) -> None:
    wrong = lesson.compare_runs(mesh_runs[0]["summed"], reference, STEPS)
    assert not wrong["within"]
    assert 0.9 < wrong["grad_rel"] < 1.1  # twice the gradient: one largest gradient apart
    # the losses stay within LOSS_RTOL: the gradients miss GRAD_RTOL by five orders of magnitude
    assert wrong["loss_rel"] <= lesson.LOSS_RTOL


@pytest.mark.slow  # make test-long (CI): 4 ranks; lesson 09b's quick run checks the right mesh
def test_what_each_rank_holds(mesh_runs: list[dict]) -> None:
    runs = [r["right"] for r in mesh_runs]
    layout = runs[0]["layout"]
    colwise, rowwise = layout["layers.0.attn.q.weight"], layout["layers.0.attn.out.weight"]
    assert colwise[0][1] == "Shard(dim=0)" and "(dim=0" in colwise[0][0]  # dp: a strided shard
    assert colwise[1:] == ((WIDTH, WIDTH), (WIDTH // 4, WIDTH))
    assert rowwise == (("Shard(dim=0)", "Shard(dim=1)"), (WIDTH, WIDTH), (WIDTH // 2, WIDTH // 2))
    assert layout["layers.0.attn.out.bias"][0] == ("Shard(dim=0)", "Replicate()")
    assert layout["embed.weight"][0] == ("Shard(dim=0)",)  # untouched by apply_tp: dp only
    assert layout["layers.0.attn.norm.weight"][0] == ("Shard(dim=0)",)
    # bytes: a quarter of the layers and a little more (norms, row-parallel biases: dp only)
    layers = 4 * sum(p.numel() for p in lesson_model_layers())
    w = WIDTH
    expected = (3 * w * w + 4.75 * w) / (12 * w * w + 13 * w)
    for r in runs:
        assert r["bytes"] / layers == pytest.approx(expected)
    # the blocks of one matrix, found by value, tile it without overlap
    full = runs[0]["state"]["layers.0.ff.down.weight"]
    owner = torch.full(full.shape, -1)
    for rank, r in enumerate(runs):
        block = r["blocks"]["layers.0.ff.down.weight"]
        rows, col = locate(full, block)
        assert (owner[rows, col : col + block.shape[1]] == -1).all()
        owner[rows, col : col + block.shape[1]] = rank
    assert (owner >= 0).all()


def lesson_model_layers() -> list[torch.nn.Parameter]:
    return list(part_a.make_model().layers.parameters())


@pytest.mark.slow  # make test-long (CI): 4 ranks; lesson 09b's quick run checks the right mesh
def test_tensor_parallel_all_reduces_are_counted(mesh_runs: list[dict]) -> None:
    comms = mesh_runs[0]["right"]["comms"]
    assert comms["all-reduce"] == 4 * DEPTH  # forward: out, down; backward: the norms' outputs
    assert comms["reduce-scatter"] == DEPTH + 1  # FSDP2: a group per layer and the root
    assert comms["all-gather"] == 2 * DEPTH + 1


def test_make_mesh_refuses_3_by_2_on_4_ranks() -> None:
    env = DistEnv(rank=0, local_rank=0, world_size=4, device=torch.device("cpu"), backend="gloo")
    fits = r"(?s)\(3, 2\) does not fit 4 ranks.*shapes that fit: \(4,\), \(2, 2\)"
    with pytest.raises(ValueError, match=fits):
        part_a.make_mesh(env, (3, 2), ("dp", "tp"))


def test_exercise_2_passes_the_solution_and_fails_the_stub_and_wrong_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lesson.test_choose_mesh()  # the solution passes
    solution = lesson.choose_mesh

    def stub(*args: object) -> dict:
        raise NotImplementedError()

    def tp_across_nodes(n_gpus, per_node, kv_heads, layers, batch, state, gpu):  # noqa: ANN001, ANN202
        """The rules but the node's: tensor parallel may span nodes."""
        return solution(n_gpus, n_gpus, kv_heads, layers, batch, state, gpu)

    def without_fsdp(n_gpus, per_node, kv_heads, layers, batch, state, gpu):  # noqa: ANN001, ANN202
        """The old rule: a whole copy of the state per model replica, no dp_shard term."""
        for copy in (c for c in range(1, n_gpus + 1) if n_gpus % c == 0):
            for tp in (t for t in range(copy, 0, -1) if copy % t == 0):
                fits = per_node % tp == 0 and kv_heads % tp == 0 and copy // tp <= layers
                if fits and batch % (n_gpus // copy) == 0 and state / copy <= gpu:
                    return {
                        "pp": copy // tp,
                        "dp_replicate": n_gpus // copy,
                        "dp_shard": 1,
                        "tp": tp,
                    }
        raise ValueError("nothing fits")

    def every_gpu_a_replica(*args):  # noqa: ANN002, ANN202
        """The right split, and dp_replicate = n_gpus as well: the product is too large."""
        got = dict(solution(*args))
        got["dp_replicate"] = args[0]
        return got

    try:
        NAMESPACE["choose_mesh"] = stub
        assert not check("exercise 2", lesson.test_choose_mesh, hint="h")
        assert "FAIL  exercise 2: not implemented yet" in capsys.readouterr().out
        wrongs = {tp_across_nodes: "crosses nodes", without_fsdp: "preference gives",
                  every_gpu_a_replica: "multiply to"}  # fmt: skip
        for wrong, message in wrongs.items():
            NAMESPACE["choose_mesh"] = wrong
            with pytest.raises(AssertionError, match=message):
                lesson.test_choose_mesh()
    finally:
        NAMESPACE["choose_mesh"] = solution


def test_choose_mesh_example_in_gib() -> None:
    gib = 2**30
    state = 70e9 * 16  # 70 billion parameters, 16 bytes each
    assert (
        round(state / gib) == 1043
        and round(state / gib / 8) == 130
        and round(state / gib / 16) == 65
    )
    got = lesson.choose_mesh(64, 8, 8, 80, 8, state, 80 * gib)
    assert got == {"pp": 1, "dp_replicate": 4, "dp_shard": 2, "tp": 8}


@pytest.mark.multigpu
@pytest.mark.skipif(gpu_count() < 4, reason="the 2 x 2 mesh on GPUs needs 4 of them")
def test_the_2d_mesh_trains_like_one_device_on_four_gpus(reference: dict) -> None:
    runs = launch(lesson.train_2d, place(4, "cuda"), STEPS, echo=False, timeout=120)
    result = lesson.compare_runs(runs[0], reference, STEPS)  # the reference: one CPU process
    assert result["within"], result
