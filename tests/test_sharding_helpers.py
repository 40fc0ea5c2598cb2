"""mgpu_helpers.sharding: lesson 08's schematics, plots and checkpoint helpers.

trace_fsdp_step runs on real FSDP2 processes in tests/test_fsdp.py (through the lesson's
fsdp_tour); the rest is checked here in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.sharding import (
    _holdings,
    counted_reduce_scatters,
    differing_tensors,
    explain_load_failure,
    plot_checkpointing,
    plot_fsdp_traces,
    plot_loss_agreement,
    plot_rank_holdings,
    plot_state_per_rank,
    save_fsynced,
)
from mgpu_helpers.timing import Timing


def test_the_schematic_says_what_each_rank_holds() -> None:
    before, after = _holdings("reduce-scatter", 3)
    assert all(all(c is not None for c in row) for row in before)  # every rank: its whole vector
    assert [[c is not None for c in row] for row in after] == [
        [True, False, False], [False, True, False], [False, False, True]]  # rank r: slice r
    before, after = _holdings("all-gather", 3)
    assert [sum(c is not None for c in row) for row in before] == [1, 1, 1]
    assert all(len(set(row)) == 3 for row in after)  # every slice, each in its owner's colour
    _, after = _holdings("all-reduce", 2)
    assert after[0] == after[1] and len(set(after[0])) == 1  # the same sum everywhere
    with pytest.raises(ValueError, match="choose from"):
        _holdings("broadcast", 2)


def test_the_schematic_draws_a_cell_per_rank_and_slice() -> None:
    fig = plot_rank_holdings(3)
    assert isinstance(fig, Figure) and len(fig.axes) == 6  # 3 collectives, before and after
    for ax in fig.axes:
        assert sum(isinstance(p, Rectangle) for p in ax.patches) == 9
    assert len(plot_rank_holdings(2, ("all-gather",)).axes) == 2
    for bad in (1, 9, 2.0):
        with pytest.raises(ValueError, match="draw 2 to 8 ranks"):
            plot_rank_holdings(bad)


def test_differing_tensors_finds_every_difference() -> None:
    def state(b: float, count: int) -> dict:
        return {"model": {"w": torch.ones(2), "b": torch.full((1,), b)},
                "optim": {"state": [torch.ones(1), count]}}

    a, same, other = state(0.0, 3), state(0.0, 3), state(1.0, 4)
    assert differing_tensors(a, same) == []
    assert differing_tensors(a, other) == ["model.b", "optim.state[1]"]
    assert differing_tensors({"w": torch.ones(2)}, {"w": torch.ones(3)}) == ["w"]  # shapes too
    assert differing_tensors({"w": 1}, {"v": 1}) == ["the top level: keys ['v', 'w'] in one only"]
    assert differing_tensors(torch.zeros(1), torch.tensor([-0.0])) == []  # torch.equal: -0 == 0


def test_save_fsynced_writes_a_file_torch_load_reads(tmp_path: Path) -> None:
    state = {"w": torch.arange(5.0)}
    save_fsynced(state, tmp_path / "s.pt")
    assert torch.equal(torch.load(tmp_path / "s.pt", weights_only=True)["w"], state["w"])


def test_a_refused_load_is_explained_with_the_fix() -> None:
    wrong_shape = explain_load_failure("ckpt", ValueError("Size mismatch for x."), "Net(8)",
                                       "Net(4)", ["model.x"], "Build Net(4).")
    assert wrong_shape.splitlines() == [
        "the checkpoint in ckpt does not fit this model:", "Size mismatch for x.",
        "It was saved from Net(4);", "this one is Net(8).", "Build Net(4)."]
    foreign = explain_load_failure("ckpt", "Missing key", "Net(8)", None, ["b", "a"], "Load it.")
    assert foreign.startswith("the checkpoint in ckpt is not a checkpoint of Net(8):")
    assert "Its entries start: a, b." in foreign and foreign.endswith("Load it.")


def test_the_plots_draw_what_they_are_given() -> None:
    traces = {True: [("forward", "root", 0.0, 1.0), ("all-gather", "blocks.0", 0.1, 0.2),
                     ("backward", "root", 1.0, 2.0), ("reduce-scatter", "blocks.0", 1.5, 1.6)]}
    fig = plot_fsdp_traces(traces, ["root", "blocks.0"], "t")
    assert len(fig.axes[0].patches) >= 2  # a bar per collective
    losses = {"DDP": [2.0, 1.9], "FSDP2": [2.0, 1.9], "bf16": [2.01, 1.9]}
    fig = plot_loss_agreement(losses, "DDP", 0.01)
    assert [len(ax.lines) for ax in fig.axes] == [3, 4]  # 3 losses; 2 gaps and 2 reference lines
    with pytest.raises(ValueError, match="is not one of"):
        plot_loss_agreement({"a": [1.0]}, "b", 0.01)
    fig = plot_state_per_rank({1: {"DDP": 16, "FSDP2": 16}, 2: {"DDP": 16, "FSDP2": 8}})
    assert len(fig.axes[0].lines) == 3  # two methods and DDP / N
    timing = Timing(times=(0.01, 0.02, 0.03))
    fig = plot_checkpointing({"none": [1.0, 2.0]}, {"none": [timing, timing]}, [8, 16])
    assert len(fig.axes) == 2


def reduce_scatter_counts(env: DistEnv) -> dict:
    """Reduce-scatters in float32 and bf16, counted, then one outside the block (not counted)."""
    import torch.distributed as dist

    def rs(*args: object, **kwargs: object) -> None:  # looked up at each call, as FSDP2 does
        newer = hasattr(dist, "reduce_scatter_single")
        name = "reduce_scatter_single" if newer else "reduce_scatter_tensor"
        getattr(dist, name)(*args, **kwargs)

    before = dist.reduce_scatter_tensor
    out = {}
    with counted_reduce_scatters() as seen:
        for dtype in (torch.float32, torch.bfloat16):
            full = torch.ones(6 * env.world_size, dtype=dtype)
            mine = torch.empty(6, dtype=dtype)
            rs(mine, full)  # positional, as the lesson's ZeroTrainer calls it
            rs(output=mine, input=full)  # by keyword, as FSDP2 calls it
            out[str(dtype)] = mine.tolist()
    rs(torch.empty(6), torch.ones(6 * env.world_size))
    out["seen"] = [(size, str(dtype)) for size, dtype in seen]
    out["restored"] = dist.reduce_scatter_tensor is before
    return out


def test_counted_reduce_scatters_counts_the_bytes_each_sends() -> None:
    for rank in launch(reduce_scatter_counts, 2, device="cpu", echo=False, timeout=60):
        assert rank["seen"] == [(48, "torch.float32")] * 2 + [(24, "torch.bfloat16")] * 2
        assert rank["torch.float32"] == [2.0] * 6  # the sums still arrive: counting, not replacing
        assert rank["restored"]
