"""Lesson 08c: a sharded checkpoint (torch.distributed.checkpoint) saved on 2 ranks
loads on 3 ranks and on 1 (one process without a process group: the model for inference, and
model and Adam together, exercise 1's solution), with the saved state bit for bit and training
going on as on 2 ranks; the rank-0 full state dict, broadcast from rank 0, loads on 3 ranks too;
a checkpoint of another model, of a model that is not the lesson's, and a folder without a
checkpoint are refused with a clear message; exercise 1's check tells its solution from a stub
and from two plausible wrong answers; exercise 2's check from three (torch.tensor_split's
rows among them).

The code is the lesson's own, read from its notebook (``load_lesson_code``), on a narrow model
(WIDTH=32, DEPTH=2): two launches (save on 2 ranks, load on 3). Real processes over gloo, real
``fully_shard`` and real DCP files in a temporary folder.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.exercises import check
from mgpu_helpers.launch import launch
from mgpu_helpers.lesson_code import load_lesson_code
from mgpu_helpers.placement import Placement, place
from mgpu_helpers.sharding import differing_tensors, explain_load_failure, save_fsynced
from mgpu_helpers.timing import measure_alternating

ROOT = Path(__file__).resolve().parents[1]
PART_A = ("Block", "Net", "make_model", "make_batch")  # from part 08a
PART_B = ("make_mesh", "apply_fsdp")  # from part 08b
NAMES = (
    "FULL_ON_RANK0", "FROM_RANK0", "RESUME_ATOL", "batch_share", "train_steps", "save_worker",
    "load_worker", "saved_model_shape", "load_for_inference",
    "resume_in_one_process", "test_resume_in_one_process", "chunks_read", "test_chunks_read",
)  # fmt: skip
# The head's parameters are set here, before the code is read, so that default arguments
# (make_model(width=WIDTH)) take the small sizes.
NAMESPACE = {
    "WIDTH": 32, "DEPTH": 2, "BATCH_SIZE": 8, "LR": 1e-3, "SEED": 0, "IN_FEATURES": 64,
    "CLASSES": 10, "torch": torch, "nn": nn, "F": F, "dist": dist, "DistEnv": DistEnv,
    "Path": Path, "copy": copy, "itertools": itertools, "os": os, "warnings": warnings, "dcp": dcp,
    "TensorStorageMetadata": TensorStorageMetadata,
    "CheckpointException": CheckpointException, "StateDictOptions": StateDictOptions,
    "get_model_state_dict": get_model_state_dict, "get_state_dict": get_state_dict,
    "set_state_dict": set_state_dict, "init_device_mesh": init_device_mesh,
    "set_model_state_dict": set_model_state_dict,
    "set_optimizer_state_dict": set_optimizer_state_dict,
    "fully_shard": fully_shard, "measure_alternating": measure_alternating, "math": math,
    "DeviceMesh": DeviceMesh, "MixedPrecisionPolicy": MixedPrecisionPolicy,
    "differing_tensors": differing_tensors, "explain_load_failure": explain_load_failure,
    "save_fsynced": save_fsynced,
    # what the exercises' checks read from the notebook's cells; the fixture below fills them in
    "dcp_dir": None, "saved_state": None, "save_run": None, "steps": 0, "resume_steps": 0,
    "world_size": 0, "dcp_entries": None, "load_world_size": 0,
}  # fmt: skip
lesson = types.SimpleNamespace(
    **vars(load_lesson_code("08a", PART_A, NAMESPACE, folder=ROOT / "notebooks")),
    **vars(load_lesson_code("08b", PART_B, NAMESPACE, folder=ROOT / "notebooks")),
    **vars(load_lesson_code("08c", NAMES, NAMESPACE, folder=ROOT / "notebooks")),
    differing_tensors=differing_tensors,
)
STEPS, RESUME = 2, 2  # steps before the checkpoint, steps after it


def save_then_load(folder: Path, saving: Placement, loading: Placement, timeout: float = 60):
    """Section 5's two launches: train and save on `saving`'s ranks, load and train on `loading`'s.

    Returns the checkpoint folder, the probe batch, rank 0's results of both launches and the
    rank-0 full state dict saved beside the sharded checkpoint.
    """
    dcp_dir, full_path = folder / "sharded", folder / "full.pt"
    probe = lesson.make_batch(0, 1000)[0]
    saved = launch(
        lesson.save_worker, saving, dcp_dir, full_path, STEPS, RESUME, probe, 1, echo=False,
        timeout=timeout,
    )[0]  # fmt: skip
    resumed = launch(
        lesson.load_worker, loading, dcp_dir, full_path, STEPS, RESUME, 2, echo=False,
        timeout=timeout,
    )[0]  # fmt: skip
    return dcp_dir, probe, saved, resumed, torch.load(full_path, weights_only=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Saved on 2 ranks (with the rank-0 full state dict beside it), then loaded on 3 (both)."""
    folder = tmp_path_factory.mktemp("lesson08")
    dcp_dir, probe, saved, resumed, state = save_then_load(folder, place(2, "cpu"), place(3, "cpu"))
    # what the exercises' checks read from the notebook's cells
    NAMESPACE.update(
        dcp_dir=dcp_dir, saved_state=state, save_run=saved, steps=STEPS, resume_steps=RESUME,
        world_size=2, load_world_size=3,
        dcp_entries=dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata,
    )  # fmt: skip
    return {"dcp_dir": dcp_dir, "saved": saved, "state": state, "resumed": resumed, "probe": probe}


def test_each_rank_wrote_its_shards_and_the_metadata(run: dict) -> None:
    names = sorted(p.name for p in run["dcp_dir"].iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    entries = dcp.FileSystemReader(run["dcp_dir"]).read_metadata().state_dict_metadata
    up = entries["model.blocks.0.up.weight"]  # 128 rows, sharded on dim 0 over 2 ranks
    assert [list(c.offsets) for c in up.chunks] == [[0, 0], [64, 0]]
    assert "optim.state.blocks.0.up.weight.exp_avg_sq" in entries


def test_loads_on_three_ranks_and_trains_on_alike(run: dict) -> None:
    resumed = run["resumed"]
    # parameters, exp_avg, exp_avg_sq and step: bit for bit the state saved on 2 ranks
    assert lesson.differing_tensors(resumed["loaded"], run["state"]) == []
    assert resumed["loaded"]["optim"]["state"]["head.bias"]["step"].item() == STEPS
    # the rank-0 file, broadcast onto 3 ranks by set_state_dict: the same state, bit for bit
    assert lesson.differing_tensors(resumed["from_full"], run["state"]) == []
    for key, value in run["saved"]["continued"].items():
        gap = (resumed["continued"][key] - value).abs().max().item()
        assert gap <= lesson.RESUME_ATOL, f"{key}: {gap:.1e} after resuming on 3 ranks"
    moved = max(
        (run["saved"]["continued"][k] - run["state"]["model"][k]).abs().max().item()
        for k in run["state"]["model"]
    )
    assert moved > 100 * lesson.RESUME_ATOL  # the steps after the checkpoint really trained


def test_loads_in_one_process_without_a_process_group(run: dict) -> None:
    assert not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the one-process warning is silenced by the lesson
        model = lesson.load_for_inference(run["dcp_dir"])
    assert lesson.differing_tensors(dict(model.state_dict()), run["state"]["model"]) == []
    with torch.no_grad():
        logits = model(run["probe"])
    torch.testing.assert_close(logits, run["saved"]["logits"], rtol=1e-5, atol=1e-6)


def test_model_and_adam_load_in_one_process_and_train_on_alike(run: dict) -> None:
    """One process, no group: exercise 1's solution, against the state saved on 2 ranks."""
    model, optimizer = lesson.resume_in_one_process(run["dcp_dir"])
    _, optim_state = get_state_dict(model, optimizer)
    assert lesson.differing_tensors(dict(model.state_dict()), run["state"]["model"]) == []
    assert lesson.differing_tensors(optim_state["state"], run["state"]["optim"]["state"]) == []
    for step in range(STEPS, STEPS + RESUME):  # both ranks' samples at once
        xs, ys = zip(*(lesson.make_batch(rank, step) for rank in range(2)), strict=True)
        optimizer.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        optimizer.step()
    for key, value in run["saved"]["continued"].items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=lesson.RESUME_ATOL)


@pytest.mark.parametrize(
    ("width", "depth", "cause"), [(64, 2, "Size mismatch"), (32, 3, "Missing key")]
)
def test_a_checkpoint_of_another_model_is_refused_clearly(
    run: dict, width: int, depth: int, cause: str
) -> None:
    assert lesson.saved_model_shape(run["dcp_dir"]) == (32, 2)
    with pytest.raises(ValueError) as refused:
        lesson.load_for_inference(run["dcp_dir"], width=width, depth=depth)
    message = str(refused.value)
    assert cause in message and "Traceback" not in message  # DCP's cause, not its traceback wall
    assert f"this one is the lesson's Net with width {width} and depth {depth}" in message
    assert "Build the model with width=32, depth=2" in message


def test_a_foreign_checkpoint_or_an_empty_folder_is_refused_clearly(tmp_path: Path) -> None:
    """Not the lesson's Net (a plain nn.Linear, saved in this process), and no checkpoint."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group: the one-process warning
        dcp.save({"model": nn.Linear(4, 3).state_dict()}, checkpoint_id=tmp_path / "linear")
    assert lesson.saved_model_shape(tmp_path / "linear") is None
    with pytest.raises(ValueError) as refused:
        lesson.load_for_inference(tmp_path / "linear")
    message = str(refused.value)
    assert "not a checkpoint of the lesson's Net" in message and "Traceback" not in message
    assert "Missing key" in message and "model.bias, model.weight" in message
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "absent"):
        with pytest.raises(ValueError, match="no finished DCP checkpoint"):
            lesson.load_for_inference(folder)


def _verdict(capsys: pytest.CaptureFixture[str], answer) -> tuple[bool, str]:
    """Exercise 3's check run against ``answer`` in place of the learner's function."""
    NAMESPACE["resume_in_one_process"] = answer
    try:
        passed = check("exercise 1", lesson.test_resume_in_one_process, hint="h")
    finally:
        NAMESPACE["resume_in_one_process"] = lesson.resume_in_one_process
    return passed, capsys.readouterr().out


def test_exercise_3_passes_the_solution_and_fails_a_stub_and_a_wrong_answer(
    run: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    passed, out = _verdict(capsys, lesson.resume_in_one_process)
    assert passed, out

    def stub(dcp_dir: Path):
        raise NotImplementedError()

    passed, out = _verdict(capsys, stub)
    assert not passed and "not implemented yet" in out

    def model_only(dcp_dir: Path):  # the inference load, with a fresh Adam: a plausible mistake
        model = lesson.load_for_inference(dcp_dir)
        return model, torch.optim.Adam(model.parameters(), lr=NAMESPACE["LR"])

    passed, out = _verdict(capsys, model_only)
    assert not passed and "Adam's state differs" in out

    def flat(dcp_dir: Path):  # the model's state dict, not nested under "model": DCP refuses it
        model = lesson.make_model()
        state = model.state_dict()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-process warning
            dcp.load(state, checkpoint_id=dcp_dir)
        return model, torch.optim.Adam(model.parameters(), lr=NAMESPACE["LR"])

    passed, out = _verdict(capsys, flat)  # a CheckpointException (a BaseException) escaped before
    assert not passed and "dcp.load refused your template" in out
    assert "Missing key in checkpoint state_dict: " in out and "'model' and 'optim'" in out


@pytest.mark.gpu
def test_saved_on_a_gpu_it_loads_in_one_cpu_process(tmp_path: Path) -> None:
    """One rank on cuda:0 (NCCL): the shards come off the GPU; the CPU load gives the same."""
    probe = lesson.make_batch(0, 1000)[0]
    saved = launch(
        lesson.save_worker, place(1, "cuda"), tmp_path / "sharded", tmp_path / "full.pt", STEPS,
        RESUME, probe, 1, echo=False, timeout=120,
    )[0]  # fmt: skip
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    model = lesson.load_for_inference(tmp_path / "sharded")  # on the CPU
    assert lesson.differing_tensors(dict(model.state_dict()), state["model"]) == []
    with torch.no_grad():
        logits = model(probe)
    # the GPU's kernels and the CPU's add in other orders: float rounding only
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-4, atol=1e-5)


@pytest.mark.multigpu
def test_saved_on_two_gpus_it_loads_on_one(tmp_path: Path) -> None:
    """Two GPU ranks (NCCL) save, one GPU rank loads: the state bit for bit, training alike."""
    _, _, saved, resumed, state = save_then_load(
        tmp_path, place(2, "cuda"), place(1, "cuda"), timeout=120
    )
    assert lesson.differing_tensors(resumed["loaded"], state) == []
    assert lesson.differing_tensors(resumed["from_full"], state) == []  # broadcast from rank 0
    for key, value in saved["continued"].items():
        torch.testing.assert_close(
            resumed["continued"][key], value, rtol=0, atol=lesson.RESUME_ATOL
        )


def test_exercise_2s_check_passes_the_solution_and_fails_the_stub_and_wrong_answers(
    run: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    lesson.test_chunks_read()  # the solution passes, on the real checkpoint's metadata too
    solution = lesson.chunks_read

    def stub(rows: int, saved_ranks: int, load_ranks: int, rank: int) -> list[int]:
        raise NotImplementedError()

    def floor_rows(rows: int, saved_ranks: int, load_ranks: int, rank: int) -> list[int]:
        solution(rows, saved_ranks, load_ranks, rank)  # the same errors for bad input
        want, have = rows // load_ranks, rows // saved_ranks  # np.array_split-like, not torch.chunk
        first, end = rank * want, (rank + 1) * want
        return [r for r in range(saved_ranks) if r * have < end and (r + 1) * have > first]

    def split_rows(rows: int, saved_ranks: int, load_ranks: int, rank: int) -> list[int]:
        solution(rows, saved_ranks, load_ranks, rank)  # torch.tensor_split's rows: 3, 3, 2, 2

        def bounds(n: int, r: int) -> tuple[int, int]:
            q, m = divmod(rows, n)
            return r * q + min(r, m), (r + 1) * q + min(r + 1, m)

        first, end = bounds(load_ranks, rank)
        saved = [bounds(saved_ranks, r) for r in range(saved_ranks)]
        return [r for r, (a, b) in enumerate(saved) if first < end and a < end and b > first]

    def own_rank_only(rows: int, saved_ranks: int, load_ranks: int, rank: int) -> list[int]:
        solution(rows, saved_ranks, load_ranks, rank)
        return [rank] if rank < saved_ranks else []

    try:
        NAMESPACE["chunks_read"] = stub
        assert not check("exercise 2", lesson.test_chunks_read, hint="h")
        assert "FAIL  exercise 2: not implemented yet" in capsys.readouterr().out
        for wrong in (floor_rows, split_rows, own_rank_only):
            NAMESPACE["chunks_read"] = wrong
            with pytest.raises(AssertionError):
                lesson.test_chunks_read()
    finally:
        NAMESPACE["chunks_read"] = solution
