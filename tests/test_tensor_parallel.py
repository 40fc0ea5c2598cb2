"""Lesson 09a: DTensor, tensor parallelism by hand and with the API, and its two exercises.

The code is the lesson's own, read from its notebook (``load_lesson_code``), on a smaller model
(WIDTH=32, HEADS=4, DEPTH=2, SEQ=8) so that the tests stay fast. One launch per world size (2
and 4 gloo processes) runs section 1's tour (every change of placement, counted), section 2's
tour (the hand-written splits and MLP; ``apply_tp`` with q, k, v apart, with their input shared
through ``PrepareModuleOutput``, and with sequence parallelism, each against one device with
Adam steps) and exercise 1's trial. ``test_..._on_two_gpus`` runs the same launch over NCCL on 2
GPUs (skipped without them): there ``Shard -> Shard`` must be an all-to-all, and the column
split is held to the tolerance, not to bit equality.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.exercises import check
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code
from mgpu_helpers.placement import place

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = {
    **lesson_imports("09a", ROOT / "notebooks"),  # the lesson's own imports
    # the head's parameters, smaller: default arguments are bound when the code is loaded
    "WIDTH": 32, "HEADS": 4, "DEPTH": 2, "SEQ": 8, "BATCH_SIZE": 4, "LR": 1e-3, "SEED": 0,
    "IN_FEATURES": 16, "CLASSES": 10, "TIMEOUT": 60,
    "placement": place(2, "cpu"), "placement_for": lambda n: place(n, "cpu"),
    "tour1": [],  # section 1's per-rank results, which exercise 2 reads
}  # fmt: skip
NAMES = (
    "Attention", "FeedForward", "Layer", "Net", "make_model", "make_batch",  # the head
    "make_mesh", "SOURCES", "TARGETS", "dtensor_tour",  # section 1
    "column_parallel_linear", "row_parallel_linear", "CopyToParallel", "ReduceFromParallel",
    "tp_mlp", "by_hand", "apply_tp", "TP_ATOL", "PARAM_ATOL", "NOISE", "PLANS", "full",
    "tp_tour",  # section 2
    "LlamaAttention", "SwiGLU", "LlamaLayer", "llama_layer_plan", "llama_trial",
    "test_llama_layer_plan",  # exercise 1
    "matmul_placement", "test_matmul_placement",  # exercise 2
)  # fmt: skip
lesson = load_lesson_code("09a", NAMES, NAMESPACE, folder=ROOT / "notebooks")
DEPTH, STEPS = NAMESPACE["DEPTH"], 2


def plan_apart(layer, tp):  # noqa: ANN001, ANN201
    """A right plan without PrepareModuleOutput: each column-parallel layer reduces its input
    gradient, so the backward pass all-reduces 5 times."""
    plan, _ = lesson.llama_layer_plan(layer, tp)
    plan = {k: v for k, v in plan.items() if not k.endswith("norm")}
    return plan, {"forward": {"all-reduce": 2}, "backward": {"all-reduce": 5}}


def everything(env: DistEnv, steps: int, foreach: bool | None = None) -> dict:
    """Sections 1 and 2 and exercise 1's trials on this rank: one launch. ``foreach=True``: Adam's
    foreach path, the default on GPUs, on a mix of DTensor and plain parameters."""
    return {
        "dtensor": lesson.dtensor_tour(env),
        "tp": lesson.tp_tour(env, steps, foreach),
        # exercise 1's layer has 2 key/value heads: 2 ranks only
        "llama": {
            "solution": lesson.llama_trial(env, lesson.llama_layer_plan),
            "apart": lesson.llama_trial(env, plan_apart),
        }
        if env.world_size == 2
        else None,
        "device": str(env.device),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    # foreach Adam here (it raised on the mixed parameters before implicit_replication), the
    # single-tensor one, the CPU's default, with 4 ranks and in the lesson's own run
    return launch(everything, 2, STEPS, True, device="cpu", echo=False, timeout=90)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return launch(everything, 4, STEPS, device="cpu", echo=False, timeout=150)


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


def expected_collective(change: str, device_type: str) -> dict[str, int]:
    """Section 1.2's rule, written out for every change the tour runs."""
    source, target = change.split(" -> ")
    if source == "Replicate":
        return {}
    if source == "Partial":
        return {"all-reduce" if target == "Replicate" else "reduce-scatter": 1}
    if target == "Replicate" or device_type == "cpu":  # DTensor's CPU fallback for Shard -> Shard
        return {"all-gather": 1}
    return {"all-to-all": 1}


def check_redistributions(ranks: list[dict], device_type: str) -> None:
    """Section 1's claims: each redistribute runs one claimed collective; the data is right."""
    for result in ranks:
        changes = result["dtensor"]["changes"]
        assert len(changes) == 9
        for name, (counts, right) in changes.items():
            assert counts == expected_collective(name, device_type) and right, (
                len(ranks),
                name,
                counts,
            )
        if device_type == "cpu":  # the fallback's note was caught (not printed to stderr)
            assert any("allgather" in note for note in result["dtensor"]["notes"])
    for placement_name in ("Shard(0)", "Shard(1)"):  # every element on exactly one rank
        values = torch.cat([r["dtensor"]["local"][placement_name].flatten() for r in ranks])
        assert sorted(values.tolist()) == list(range(32))


def test_redistributions_run_the_claimed_collectives(ranks: list[dict]) -> None:
    check_redistributions(ranks, "cpu")


def check_hand_written_splits(ranks: list[dict], device_type: str) -> None:
    """Section 2: the splits and the split MLP equal the unsplit ones; an all-reduce each way."""
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
    """Sections 2.2-2.6: every plan equals one device: logits, gradients, parameters after Adam."""
    n, lr = len(ranks), NAMESPACE["LR"]
    for result in ranks:
        for plan in lesson.PLANS:
            run = result["tp"][plan]
            assert run["forward"] <= lesson.TP_ATOL and run["grads"] <= lesson.TP_ATOL, (
                n,
                plan,
                run,
            )
            assert len(run["losses"]) == (0 if plan == "apart" else STEPS)
            assert run["param_gap"] <= lesson.PARAM_ATOL, (n, plan, run)
            assert run["noise_gap"] <= 2 * lr * STEPS, (n, plan, run)
        held = result["tp"]["shared"]["held"]
        whole = 4 * sum(p.numel() for p in lesson.make_model().parameters())
        assert whole / n < held < whole
        # with SP only: the optimizer sums the Partial gradients (norms, row-parallel biases):
        # 6 per layer, each read twice by torch 2.14's Adam, single-tensor and foreach alike
        sent = result["tp"]["sequence"]["optimizer"]
        if device_type == "cpu":
            assert sent == {"all-reduce": 12 * DEPTH}, sent
        assert set(sent) == {"all-reduce"}, sent
        assert (
            result["tp"]["shared"]["optimizer"] == {} and result["tp"]["apart"]["optimizer"] == {}
        )


def test_apply_tp_equals_one_device_and_trains_alike(ranks: list[dict]) -> None:
    check_apply_tp(ranks, "cpu")


def test_the_noise_rule_is_needed_and_the_parameters_are_compared(two_ranks: list[dict]) -> None:
    # the key biases' gradients are rounding noise (below NOISE on one device): Adam moves them
    # further apart than PARAM_ATOL; every other element stays within it, with none excused
    run = two_ranks[0]["tp"]["shared"]
    assert run["param_gap"] < lesson.PARAM_ATOL < run["noise_gap"], run
    model = lesson.make_model()  # one device's first gradients, as tp_tour's reference
    x, y = lesson.make_batch(0, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():  # the key biases: every element below NOISE
        assert (p.grad.abs() < lesson.NOISE).all() == name.endswith("attn.k.bias"), name


def test_apply_tp_communication_per_layer(ranks: list[dict]) -> None:
    apart, shared, sp = (ranks[0]["tp"][p] for p in ("apart", "shared", "sequence"))
    assert apart["layer"]["attn"] == {"forward": {"all-reduce": 1}, "backward": {"all-reduce": 3}}
    assert apart["all"] == {"all-reduce": 6 * DEPTH}
    # PrepareModuleOutput on the norm: Megatron's 2 forward + 2 backward per layer
    assert shared["layer"]["attn"] == {"forward": {"all-reduce": 1}, "backward": {"all-reduce": 1}}
    assert shared["layer"]["ff"] == {"forward": {"all-reduce": 1}, "backward": {"all-reduce": 1}}
    assert shared["total"] == {
        "forward": {"all-reduce": 2 * DEPTH},
        "backward": {"all-reduce": 2 * DEPTH},
    }
    # PrepareModuleOutput on attention's norm: one all-gather for q, k and v, one reduce-scatter
    once = {"all-gather": 1, "reduce-scatter": 1}
    for block in ("attn", "ff"):
        assert sp["layer"][block] == {"forward": once, "backward": once}, (block, sp["layer"])
    assert "all-reduce" not in sp["total"]["forward"]
    assert set(sp["all"]) == {"all-gather", "reduce-scatter"}


def test_apply_tp_refuses_heads_that_do_not_split() -> None:
    env = DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), backend="gloo")

    class Mesh:  # apply_tp refuses before it touches the mesh
        def size(self) -> int:
            return env.world_size

    with pytest.raises(ValueError, match="3 heads do not split over 2 tensor-parallel ranks"):
        lesson.apply_tp(lesson.make_model(width=24, heads=3), Mesh())


def check_exercise_1_trials(ranks: list[dict]) -> None:
    """Exercise 1's trial: both right plans equal one device, with 4 and 7 all-reduces."""
    for result in ranks:
        solution, apart = result["llama"]["solution"], result["llama"]["apart"]
        assert solution["error"] <= lesson.TP_ATOL and apart["error"] <= lesson.TP_ATOL
        assert solution["counts"] == {"forward": {"all-reduce": 2}, "backward": {"all-reduce": 2}}
        assert apart["counts"] == {"forward": {"all-reduce": 2}, "backward": {"all-reduce": 5}}


def test_exercise_1_trials(two_ranks: list[dict]) -> None:
    check_exercise_1_trials(two_ranks)


def test_exercise_1_check_passes_the_solution_and_fails_wrong_plans(
    two_ranks: list[dict], capsys: pytest.CaptureFixture[str]
) -> None:
    solution, real_launch = lesson.llama_layer_plan, NAMESPACE["launch"]

    def stub(layer, tp):  # noqa: ANN001, ANN202
        raise NotImplementedError()

    def heads_not_divided(layer, tp):  # noqa: ANN001, ANN202
        plan, predicted = solution(layer, tp)
        layer.attn.n_heads *= tp  # undo the division: the view would ask for all heads
        layer.attn.n_kv_heads *= tp
        return plan, predicted

    def wrong_count(layer, tp):  # noqa: ANN001, ANN202
        plan, _ = solution(layer, tp)
        return plan, {"forward": {"all-reduce": 2}, "backward": {"all-reduce": 5}}

    try:
        # the ranks' real results of each plan, from the module's launch (the check's own launch
        # runs in lesson 09a's quick run, in both editions)
        NAMESPACE["launch"] = lambda *a, **k: [r["llama"]["solution"] for r in two_ranks]
        lesson.test_llama_layer_plan()  # the solution passes
        NAMESPACE["llama_layer_plan"] = stub
        assert not check("exercise 1", lesson.test_llama_layer_plan, hint="h")
        assert "FAIL  exercise 1: not implemented yet" in capsys.readouterr().out
        NAMESPACE["llama_layer_plan"] = heads_not_divided  # refused before any rank starts
        NAMESPACE["launch"] = lambda *a, **k: pytest.fail(
            "launched a plan that does not divide the heads"
        )
        with pytest.raises(AssertionError, match="expected \\(2, 1\\)"):
            lesson.test_llama_layer_plan()
        # a wrong prediction: the ranks' real counts of this very plan (from the module's launch)
        NAMESPACE["llama_layer_plan"] = wrong_count
        NAMESPACE["launch"] = lambda *a, **k: [r["llama"]["solution"] for r in two_ranks]
        with pytest.raises(AssertionError, match="you predict"):
            lesson.test_llama_layer_plan()
        NAMESPACE["llama_layer_plan"] = plan_apart  # right plan, right count: passes
        NAMESPACE["launch"] = lambda *a, **k: [r["llama"]["apart"] for r in two_ranks]
        lesson.test_llama_layer_plan()
    finally:
        NAMESPACE["llama_layer_plan"], NAMESPACE["launch"] = solution, real_launch


def plan_wo_colwise(layer, tp):  # noqa: ANN001, ANN201
    """A plausible wrong plan: attention's output projection column-parallel. Its input is cut
    by features already, so DTensor's sharding propagation refuses the product on the ranks."""
    plan, predicted = lesson.llama_layer_plan(layer, tp)
    return plan | {"attn.wo": ColwiseParallel()}, predicted


def test_exercise_1_a_plan_that_fails_on_the_ranks_gives_one_verdict(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A real launch of the wrong plan: the verdict names the sharding error in one line, and the
    ranks' logs and tracebacks (torch's fake-tensor errors) stay out of the output."""
    NAMESPACE["llama_layer_plan"] = plan_wo_colwise
    try:
        assert not check("exercise 1", lesson.test_llama_layer_plan, hint="h")
    finally:
        NAMESPACE["llama_layer_plan"] = lesson.llama_layer_plan
    out, err = capfd.readouterr()
    assert "a rank failed:\nSharding propagation failed for aten.mm" in out, out
    assert "Traceback" not in out + err and "fake_tensor" not in err, err


def check_products(ranks: list[dict], device_type: str) -> None:
    """Exercise 2's data: nine products, right on every rank; DTensor sends only where the
    solution says None (on the CPU one all-gather of an input), else the solution's placement."""
    for result in ranks:
        products = result["dtensor"]["products"]
        assert len(products) == 9
        for pair, (placement, counts, right) in products.items():
            a, b = (lesson.TARGETS[name] for name in pair.split(" @ "))
            assert right, pair
            want = lesson.matmul_placement(a, b)
            if want is None:  # an input gathered first (GPUs: its collective not pinned)
                assert counts == {"all-gather": 1} if device_type == "cpu" else counts, pair
            else:
                assert counts == {} and placement == want, (pair, counts, placement)


def test_exercise_2_products_on_the_ranks(ranks: list[dict]) -> None:
    check_products(ranks, "cpu")


def test_exercise_2_check_passes_the_solution_and_fails_wrong_answers(
    two_ranks: list[dict], capsys: pytest.CaptureFixture[str]
) -> None:
    NAMESPACE["tour1"] = [r["dtensor"] for r in two_ranks]
    lesson.test_matmul_placement()
    solution = lesson.matmul_placement

    def stub(a, b):  # noqa: ANN001, ANN202
        raise NotImplementedError()

    def row_parallel_is_whole(a, b):  # noqa: ANN001, ANN202
        """Forgets the partial sums: Shard(1) @ Shard(0) gives the whole product."""
        got = solution(a, b)
        return Replicate() if isinstance(got, Partial) else got

    def replicated_is_not_cut(a, b):  # noqa: ANN001, ANN202
        """Thinks a replicated input must be sent before it can meet a cut one on the summed dim."""
        one_replicated = isinstance(a, Replicate) != isinstance(b, Replicate)
        return None if one_replicated and isinstance(solution(a, b), Partial) else solution(a, b)

    try:
        NAMESPACE["matmul_placement"] = stub
        assert not check("exercise 2", lesson.test_matmul_placement, hint="h")
        assert "FAIL  exercise 2: not implemented yet" in capsys.readouterr().out
        for wrong, message in (
            (row_parallel_is_whole, r"you say Replicate\(\); DTensor gave Partial"),
            (replicated_is_not_cut, "you say None; DTensor gave Partial"),
        ):
            NAMESPACE["matmul_placement"] = wrong
            with pytest.raises(AssertionError, match=message):
                lesson.test_matmul_placement()
    finally:
        NAMESPACE["matmul_placement"] = solution
    assert solution(Shard(0), Replicate()) == Shard(0) and solution(Shard(0), Shard(1)) is None


def test_llama_plan_classes_without_a_mesh() -> None:
    layer = lesson.LlamaLayer()
    plan, _ = lesson.llama_layer_plan(layer, 2)
    assert isinstance(plan["attn.wq"], ColwiseParallel) and isinstance(
        plan["ffn.w2"], RowwiseParallel
    )
    x = torch.randn(2, 8, 32)
    whole = lesson.LlamaLayer()
    assert whole(x).shape == x.shape  # the unsplit layer runs on one device


@pytest.mark.multigpu
def test_sections_1_2_and_exercise_1_on_two_gpus() -> None:
    """The same launch, one rank per GPU over NCCL: the same checks, with the GPU's claims."""
    results = launch(everything, place(2, "cuda"), STEPS, echo=False, timeout=180)
    assert all(r["device"].startswith("cuda") for r in results), [r["device"] for r in results]
    check_redistributions(results, "cuda")  # Shard -> Shard: a real all-to-all here
    check_products(results, "cuda")
    check_hand_written_splits(results, "cuda")
    check_apply_tp(results, "cuda")
    check_exercise_1_trials(results)
    hand, shared = results[0]["tp"]["by_hand"], results[0]["tp"]["shared"]
    print(
        f"2 GPUs, NCCL: column {hand['column']:.1e}, row {hand['row']:.1e}; apply_tp logits"
        f" {shared['forward']:.1e}, grads {shared['grads']:.1e}, params {shared['param_gap']:.1e}"
    )
