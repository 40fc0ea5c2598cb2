"""Lesson 10c: DDP's errors and silent mistakes (entries 9 to 14, 18 and 19), both exercises.

The code is the lesson's own, read from its notebook (``load_lesson_code``): one launch of two
CPU ranks over gloo runs every in-rank demonstration (entries 10 to 14 and 18) and the tests
check the error class and a fragment of each message, or the numbers of each silent mistake, and
that each fix works. Entries 9 and 12 need one process. GPU-marked tests run entry 9 on CUDA,
entry 19's checkpoint loaded on two GPUs, and entries 10 to 14 and 18 (SyncBatchNorm included)
with NCCL on two GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.utils.data import DistributedSampler

from mgpu_helpers.exercises import check
from mgpu_helpers.failures import caught
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code
from mgpu_helpers.placement import place

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = {
    **lesson_imports("10c", ROOT / "notebooks"),  # the lesson's own imports
    "SEED": 0, "WORLD_SIZE": 2, "JOB_TIMEOUT": 60,  # the head's parameters
    "cpu_placement": place(2, "cpu"),
    "wrapped_state": None, "inner_state": None,  # entry 12's checkpoints, which exercise 2 reads
}  # fmt: skip
NAMES = (
    "device_ids_for",
    "case_device_ids", "Skipping", "SharedCheckpointed", "two_steps", "case_unused",
    "case_ready_twice", "case_checkpoint", "case_sampler", "bn_model", "bn_train_eval",
    "case_batchnorm", "ddp_cases", "load_on_rank", "shared_fraction",  # the entries
    "load_plain", "test_load_plain",  # exercise 1
    "ranks_share_samples", "sharing_on_three_loaders", "test_ranks_share_samples",  # exercise 2
)  # fmt: skip
lesson = load_lesson_code("10c", NAMES, NAMESPACE, folder=ROOT / "notebooks")
PLAIN_MODEL = lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # noqa: E731


def stub_and_wrong_answers_fail(
    name: str, test: Callable[[], None], stub: Callable, wrong: list[Callable], capsys
) -> None:
    """The exercise's check says "not implemented yet" for ``stub`` and fails each ``wrong``."""
    solution = NAMESPACE[name]
    try:
        NAMESPACE[name] = stub
        assert not check(name, test, hint="h")
        assert "not implemented yet" in capsys.readouterr().out
        for answer in wrong:
            NAMESPACE[name] = answer
            with pytest.raises(AssertionError):
                test()
    finally:
        NAMESPACE[name] = solution


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return launch(lesson.ddp_cases, 2, device="cpu", echo=False, timeout=30)


def check_cases(cases: list[dict]) -> None:
    """The lesson's assertions for entries 10 to 14 (but SyncBatchNorm), on any placement."""
    for result in cases:
        kind, message = result[10]["broken"]
        assert kind == "ValueError"
        assert "only work with single-device/multiple-device GPU modules or CPU modules" in message
        assert "module parameters {device(type='cpu')}" in message
        kind, message = result[11]["broken"]
        assert kind == "RuntimeError"
        assert "Expected to have finished reduction in the prior iteration" in message
        # the names need the debug level
        assert "Parameters which did not receive grad" not in message
        assert "Parameters which did not receive grad for rank" in result[11]["named"][1]
        assert "spare.weight" in result[11]["named"][1] and "spare.bias" in result[11]["named"][1]
        for option in ("find_unused_parameters", "static_graph"):
            assert result[11][option]["spare_grad"] is None
            torch.testing.assert_close(
                result[11][option]["body_grad"], cases[0][11][option]["body_grad"]
            )
        torch.testing.assert_close(result[10]["grad"], cases[0][10]["grad"])
        kind, message = result[18]["broken"]
        assert kind == "RuntimeError" and "Expected to mark a variable ready only once" in message
        for fix in ("use_reentrant=False", "static_graph=True"):
            torch.testing.assert_close(result[18][fix], cases[0][18][fix])
        torch.testing.assert_close(
            result[18]["use_reentrant=False"], result[18]["static_graph=True"]
        )
        assert result[13]["no_set_epoch"][0] == result[13]["no_set_epoch"][1]
        assert result[13]["set_epoch"][0] != result[13]["set_epoch"][1]
    for way, shared in (("plain", 1.0), ("no_set_epoch", 0.0), ("set_epoch", 0.0)):
        for epoch in (0, 1):
            fraction = lesson.shared_fraction([r[13][way][epoch] for r in cases])
            assert fraction == shared, (way, epoch)
    means = [r[14]["plain"]["running_mean"] for r in cases]
    evals = [r[14]["plain"]["eval"] for r in cases]
    assert (means[1] - means[0]).abs().max() > 1e-3 and (evals[1] - evals[0]).abs().max() > 1e-3
    assert torch.equal(cases[1][14]["broadcast_eval"], cases[0][14]["broadcast_eval"])


def test_entry_9_meta_and_cpu_raise_the_same_class_with_another_text() -> None:
    mismatch = caught(lambda: nn.Linear(4, 2).to("meta")(torch.randn(3, 4)))
    assert mismatch is not None and mismatch[0] == "RuntimeError"
    assert "is not on the expected device" in mismatch[1]  # the fragment the lesson checks
    assert caught(lambda: nn.Linear(4, 2)(torch.randn(3, 4))) is None


@pytest.mark.gpu
def test_entry_9_cuda_and_cpu_say_expected_all_tensors_on_the_same_device() -> None:
    mismatch = caught(lambda: nn.Linear(4, 2).to("cuda:0")(torch.randn(3, 4)))
    assert mismatch is not None and mismatch[0] == "RuntimeError"
    assert "Expected all tensors to be on the same device" in mismatch[1]
    assert caught(lambda: nn.Linear(4, 2).to("cuda:0")(torch.randn(3, 4).to("cuda:0"))) is None


def test_entries_10_to_14_on_two_cpu_ranks(cases: list[dict]) -> None:
    check_cases(cases)
    kind, message = cases[0][14]["sync_error"]
    assert kind == "ValueError" and "SyncBatchNorm layers only work with GPU modules" in message
    assert "sync" not in cases[0][14]


def test_entry_12_prefix_error_and_both_fixes(cases: list[dict]) -> None:
    wrapped, inner = cases[0][12]["wrapped"], cases[0][12]["inner"]
    assert all(k.startswith("module.") for k in wrapped) and not any(
        k.startswith("module.") for k in inner
    )
    kind, message = caught(lambda: PLAIN_MODEL().load_state_dict(wrapped))
    assert kind == "RuntimeError"
    assert (
        "Missing key(s) in state_dict" in message
        and 'Unexpected key(s) in state_dict: "module.' in message
    )
    fixed = dict(wrapped)
    consume_prefix_in_state_dict_if_present(fixed, "module.")
    model = PLAIN_MODEL()
    model.load_state_dict(fixed)
    assert all(torch.equal(v, inner[k]) for k, v in model.state_dict().items())
    torch.testing.assert_close(
        cases[1][12]["inner"], inner, rtol=0, atol=0
    )  # DDP's broadcast at the wrap


def test_exercise_1_passes_the_solution_and_fails_the_stub_and_wrong_answers(
    cases: list[dict], capsys: pytest.CaptureFixture[str]
) -> None:
    NAMESPACE["wrapped_state"], NAMESPACE["inner_state"] = (
        cases[0][12]["wrapped"],
        cases[0][12]["inner"],
    )
    lesson.test_load_plain()

    def stub(model: nn.Module, state: dict) -> None:
        raise NotImplementedError()

    def blind_slice(model: nn.Module, state: dict) -> None:  # cuts 7 characters off every key
        model.load_state_dict({k[7:]: v for k, v in state.items()})

    def not_strict(model: nn.Module, state: dict) -> None:  # silences the error, loads nothing
        model.load_state_dict(state, strict=False)

    def replace_everywhere(model: nn.Module, state: dict) -> None:  # submodule.weight: subweight
        model.load_state_dict({k.replace("module.", ""): v for k, v in state.items()})

    stub_and_wrong_answers_fail(
        "load_plain",
        lesson.test_load_plain,
        stub,
        [blind_slice, not_strict, replace_everywhere],
        capsys,
    )


@pytest.mark.multigpu
def test_entries_10_to_14_with_nccl_and_syncbatchnorm_on_two_gpus() -> None:
    results = launch(lesson.ddp_cases, place(2), echo=False, timeout=60)
    check_cases(results)
    means = [r[14]["sync"]["running_mean"] for r in results]
    torch.testing.assert_close(means[1], means[0])  # SyncBatchNorm: the global batch's statistics
    assert "sync_error" not in results[0][14]


def test_exercise_2_passes_the_solution_and_fails_the_stub_and_wrong_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert check("exercise 2", lesson.test_ranks_share_samples, hint="h")

    def stub(env, loader) -> bool:
        raise NotImplementedError()

    def own_batch_only(env, loader) -> bool:  # looks at this rank's batch alone: repeated ids?
        (first,) = next(iter(loader))
        return len(set(first.tolist())) < len(first)

    def always(env, loader) -> bool:
        return True

    def no_distributed_sampler(env, loader) -> bool:  # trusts the sampler's type, not the indices
        return not isinstance(loader.sampler, DistributedSampler)

    wrong = [own_batch_only, always, no_distributed_sampler]
    stub_and_wrong_answers_fail(
        "ranks_share_samples", lesson.test_ranks_share_samples, stub, wrong, capsys
    )


@pytest.mark.multigpu
def test_entry_19_a_checkpoint_saved_on_cuda0_loads_there_without_map_location(
    tmp_path: Path,
) -> None:
    saved = tmp_path / "checkpoint.pt"
    torch.save({"weight": torch.ones(4, device="cuda:0")}, saved)
    gpus = place(2, "cuda")
    unmapped = launch(lesson.load_on_rank, gpus, str(saved), False, timeout=60, echo=False)
    mapped = launch(lesson.load_on_rank, gpus, str(saved), True, timeout=60, echo=False)
    assert unmapped == ["cuda:0", "cuda:0"] and mapped == ["cuda:0", "cuda:1"]
