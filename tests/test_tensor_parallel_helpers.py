"""mgpu_helpers.tensor_parallel and lesson 09b's pipeline helpers in model_parallel and plots.

The counting helpers run on 2 real gloo processes (CommDebugMode around a column- then
row-parallel pair); the checks, the pictures and StageProbe run in this process. StageProbe also
runs on real pipeline stages in tests/test_pipelining.py (through lesson 09b's worker).
"""

from __future__ import annotations

import logging

import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import nn

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.model_parallel import (
    StageProbe,
    as_events,
    bubble_fraction,
    bubble_verdict,
    unequal_idle,
)
from mgpu_helpers.plots import plot_activation_peaks
from mgpu_helpers.tensor_parallel import (
    caught_log_notes,
    check_heads,
    check_microbatches,
    check_positive,
    check_whole,
    collective_name,
    comm_table,
    counted,
    largest_tp,
    locate,
    module_counts,
    plot_mesh_blocks,
    plot_placements,
    plot_tp_schematic,
    plot_tp_split,
)


def test_collective_names_are_readable() -> None:
    assert collective_name("_c10d_functional.all_reduce.default") == "all-reduce"
    assert collective_name("c10d.allreduce_.default") == "all-reduce"
    assert collective_name("_c10d_functional.all_gather_into_tensor.default") == "all-gather"
    assert collective_name("_c10d_functional.reduce_scatter_tensor.default") == "reduce-scatter"
    assert collective_name("_c10d_functional.all_to_all_single.default") == "all-to-all"
    assert collective_name("aten.mm.default") == "aten.mm.default"


def counting_worker(env: DistEnv) -> dict:
    """A column- then row-parallel pair under CommDebugMode: what the helpers read from it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (env.world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x = torch.randn(3, 4, requires_grad=True)
    with CommDebugMode() as mode:
        model(x).sum().backward()
    return {"all": counted(mode), "global": module_counts(mode, "Global"),
            "missing": module_counts(mode, "Sequential.7")}  # fmt: skip


def test_counting_helpers_on_two_gloo_processes() -> None:
    for result in launch(counting_worker, 2, device="cpu", echo=False, timeout=60):
        assert result["all"] == {"all-reduce": 2}  # g forward, f backward
        assert result["global"] == {"forward": {"all-reduce": 1}, "backward": {"all-reduce": 1}}
        assert result["missing"] is None


def test_module_counts_without_per_module_counts_is_none() -> None:
    class Bare:  # a CommDebugMode of a torch without comm_module_counts
        pass

    assert module_counts(Bare(), "Global") is None


def test_comm_table_lines() -> None:
    attn = {"forward": {"all-reduce": 1}, "backward": {"all-reduce": 3}}
    lines = comm_table(
        {"attn": attn, "ff": {"forward": {}, "backward": {"all-gather": 1}}, "norm": None}
    )
    assert len(lines) == 4 and "forward" in lines[0]
    assert "all-reduce x1" in lines[1] and "all-reduce x3" in lines[1]
    assert lines[2].split()[1] == "-" and "all-gather x1" in lines[2]
    assert "not counted" in lines[3]


def test_caught_log_notes_keeps_them_and_restores_the_logger(capsys: pytest.CaptureFixture) -> None:
    log = logging.getLogger("mgpu.test.notes")
    before = (log.propagate, list(log.handlers))
    with caught_log_notes("mgpu.test.notes") as notes:
        log.warning("falling back to %s", "allgather")
        log.info("below the level")
    assert notes == ["falling back to allgather"]
    assert (log.propagate, list(log.handlers)) == before
    assert "falling back" not in capsys.readouterr().err


def test_parameter_checks_name_what_is_wrong() -> None:
    check_whole(A=1, B=8)
    check_positive(LR=1e-3, TIMEOUT=5)
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match=r"WIDTH=.*whole number >= 1"):
            check_whole(WIDTH=bad)
    for bad in (0, -1e-3, True, "1"):
        with pytest.raises(ValueError, match=r"LR=.*number > 0"):
            check_positive(LR=bad)


def test_check_heads_refuses_what_does_not_split() -> None:
    check_heads(4, 2)
    check_heads(8, 4, n_kv_heads=4, width=64)
    with pytest.raises(ValueError, match=r"3 heads do not split over 2 tensor-parallel ranks"):
        check_heads(3, 2)
    with pytest.raises(ValueError, match=r"2 key/value heads do not split over 4"):
        check_heads(8, 4, n_kv_heads=2)
    with pytest.raises(ValueError, match="share 3 key/value heads"):
        check_heads(8, 2, n_kv_heads=3)
    with pytest.raises(ValueError, match="width=30 is not a multiple of n_heads=4"):
        check_heads(4, 2, width=30)
    with pytest.raises(ValueError, match=r"divides 2 \(1, 2\)"):
        check_heads(8, 4, n_kv_heads=2)


def test_check_heads_names_every_broken_rule_and_a_change_that_mends_them() -> None:
    lesson = ("HEADS", "WIDTH", "WORLD_SIZE")
    with pytest.raises(ValueError) as both:  # lesson 09a's HEADS = 3: both rules at once
        check_heads(3, 2, width=64, names=lesson)
    lines = str(both.value).splitlines()
    assert lines[0].startswith("WIDTH=64 is not a multiple of HEADS=3")
    assert lines[1].startswith("3 heads do not split over 2 tensor-parallel ranks (WORLD_SIZE)")
    assert lines[2] == "for example HEADS=4 (WIDTH=64 fits), or WORLD_SIZE=3 and WIDTH=63"
    check_heads(4, 2, width=64)  # the first suggestion passes both rules
    check_heads(3, 3, width=63)  # and so does the second
    with pytest.raises(ValueError, match="for example HEADS=4 and WIDTH=60, or WORLD_SIZE=3$"):
        check_heads(3, 2, width=63, names=lesson)  # no even head count divides 63
    check_heads(4, 2, width=60)
    fixed = ("HEADS", "WIDTH", None)  # lesson 09b: the mesh's tp size is not a parameter
    with pytest.raises(ValueError, match=r"ranks: each rank computes whole heads;\n.*fits\)$"):
        check_heads(3, 2, width=64, names=fixed)


def test_check_microbatches_gives_each_rule_its_own_message() -> None:
    check_microbatches(4, 8, 2)
    check_microbatches(2, 8, 2)
    with pytest.raises(ValueError) as odd:  # enough micro-batches, but 8 samples do not cut in 3
        check_microbatches(3, 8, 2)
    assert str(odd.value) == (
        "BATCH_SIZE=8 does not cut into 3 equal micro-batches: choose a BATCH_SIZE that is a "
        "multiple of 3 or MICROBATCHES in [2, 4, 8]"
    )
    with pytest.raises(ValueError) as few:  # too few micro-batches, and they cut the batch evenly
        check_microbatches(2, 8, 4)
    assert "at least one micro-batch per stage; choose MICROBATCHES >= 4" in str(few.value)
    assert "BATCH_SIZE" not in str(few.value)
    with pytest.raises(ValueError, match="MICROBATCHES=0"):
        check_microbatches(0, 8, 2)


def test_largest_tp() -> None:
    assert largest_tp(4, 8) == 4 and largest_tp(4, 3) == 2 and largest_tp(3, 2) == 1
    assert largest_tp(8, 8, n_kv_heads=2) == 2
    with pytest.raises(ValueError):
        largest_tp(4, 0)


def test_plot_placements_draws_each_holder() -> None:
    matrix = torch.arange(32.0).reshape(4, 8)
    local = [{"Shard(0)": matrix[2 * r : 2 * r + 2], "Replicate": matrix} for r in range(2)]
    fig = plot_placements(local, "t")
    shard, replicate = fig.axes[:2]
    assert sum(isinstance(p, Rectangle) for p in shard.patches) == 32  # one holder each
    assert sum(isinstance(p, Rectangle) for p in replicate.patches) == 64  # a stripe per rank
    with pytest.raises(ValueError):
        plot_placements([], "t")


def test_plot_tp_split_draws_every_panel_at_one_scale() -> None:
    fig = plot_tp_split(2, 16)
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    assert all(ax.get_ylim() == (64, 0) for ax in fig.axes)  # the tallest matrix: 4 x 16 rows
    pixels = [ax.get_position().width * fig.get_figwidth() / ax.get_xlim()[1] for ax in fig.axes]
    assert max(pixels) / min(pixels) < 1.05  # inches per feature: the same in every panel
    assert all(sum(isinstance(p, Rectangle) for p in ax.patches) == 3 for ax in fig.axes)


def test_plot_tp_schematic_rows_and_refusals() -> None:
    fig = plot_tp_schematic(2)
    assert len(fig.axes) == 3
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles[-1] == "MLP, sequence parallel"
    text = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert "bwd: all-reduce" in text and "reduce-scatter" in text and "all-gather" in text
    for bad in (1, 9, 2.0):
        with pytest.raises(ValueError, match="draw 2 to 8 ranks"):
            plot_tp_schematic(bad)


def test_locate_finds_a_block_by_value() -> None:
    full = torch.arange(48.0).reshape(6, 8)
    assert locate(full, full[2:4, 4:8]) == ([2, 3], 4)
    with pytest.raises(RuntimeError, match="not in the full matrix"):
        locate(full, torch.full((2, 4), -1.0))
    with pytest.raises(ValueError, match="two matrices"):
        locate(full, torch.zeros(2, 9))


def test_plot_mesh_blocks_tiles_each_matrix() -> None:
    full = {"w": torch.arange(32.0).reshape(4, 8)}
    blocks = [
        {"w": full["w"][2 * (r // 2) : 2 * (r // 2) + 2, 4 * (r % 2) : 4 * (r % 2) + 4]}
        for r in range(4)
    ]
    fig = plot_mesh_blocks(full, blocks, [(r // 2, r % 2) for r in range(4)])
    assert len(fig.axes) == 1 and len(fig.axes[0].patches) == 5  # 4 blocks and the frame
    wide = {"w": torch.arange(32.0).reshape(2, 16), "t": torch.arange(32.0).reshape(8, 4)}
    fig = plot_mesh_blocks(wide, [{k: v for k, v in wide.items()}], [(0, 0)])
    ax = fig.axes[0]  # the 2 x 16 matrix beside an 8-row one: framed around its 2 rows only
    assert not any(spine.get_visible() for spine in ax.spines.values())
    frame = [p for p in ax.patches if not p.get_fill()]
    assert [(p.get_width(), p.get_height()) for p in frame] == [(16, 2)]
    assert ax.get_ylim() == (8, 0)  # every panel at the tallest matrix's scale
    with pytest.raises(AssertionError, match="held by no rank"):
        plot_mesh_blocks(full, blocks[:3], [(0, 0), (0, 1), (1, 0)])


class FakeStage:
    """What StageProbe needs of a PipelineStage: a Linear that runs and backpropagates."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.submod = nn.Linear(8, 8)
        self.outputs: dict[int, torch.Tensor] = {}

    def forward_one_chunk(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self.outputs[i] = torch.relu(self.submod(x)).sum()
        return self.outputs[i]

    def backward_one_chunk(self, i: int) -> None:
        self.outputs.pop(i).backward()


@pytest.mark.parametrize(("order", "peak"), [("F0 F1 F2 B0 B1 B2", 3), ("F0 B0 F1 B1 F2 B2", 1),
                                             ("F0 F1 B0 F2 B1 B2", 2)])  # fmt: skip
def test_stage_probe_counts_the_micro_batches_alive(order: str, peak: int) -> None:
    stage = FakeStage()
    probe = StageProbe(stage)
    probe.counting = True
    x = torch.randn(4, 8)
    for action in order.split():
        kind, micro = action[0], int(action[1:])
        stage.forward_one_chunk(micro, x) if kind == "F" else stage.backward_one_chunk(micro)
    assert probe.peak_micro == peak
    saved = probe.micro_bytes[0]
    assert saved >= 2 * 4 * 8 * 4  # the input and relu's output, float32; the weight left out
    assert probe.peak_bytes == peak * saved
    assert all(b == 0 for b in probe.live.values())  # every backward freed its activations
    assert [(k, m) for k, m, _, _ in probe.events] == [(a[0], int(a[1:])) for a in order.split()]
    assert all(start <= end for _, _, start, end in probe.events)


def test_as_events_unequal_idle_and_the_verdict() -> None:
    events = as_events([[("F", 0, 0.0, 1.0)], [("F", 0, 1.0, 2.0), ("B", 0, 2.0, 4.0)]])
    assert [(e.stage, e.kind) for e in events] == [(0, "F"), (1, "F"), (1, "B")]
    assert unequal_idle([1, 1, 1], [2, 2, 2], 4) == pytest.approx(bubble_fraction(3, 4))
    assert unequal_idle([1, 3], [2, 6], 4) > bubble_fraction(2, 4)  # unequal stages idle more
    with pytest.raises(ValueError):
        unequal_idle([1], [1, 2], 4)
    noisy = bubble_verdict("GPipe", 0.5, 0.3, 0.2, 0.3, False, 10)
    assert "noise dominates" in noisy[1]
    assert "within 10 points" in bubble_verdict("1F1B", 0.25, 0.01, 0.2, 0.2, False, 10)[0]
    far = bubble_verdict("GPipe", 0.6, 0.01, 0.2, 0.3, False, 10)
    assert "+40 points against the formula's 20%" in far[0]  # points, not a relative +40%
    assert "unequal stages explain +10 points" in far[0] and "+30 points" in far[1]
    assert "quick mode" in bubble_verdict("GPipe", 0.6, 0.2, 0.2, 0.3, True, 3)[0]


def test_plot_activation_peaks() -> None:
    fig = plot_activation_peaks({"GPipe": [4, 4], "1F1B": [2, 1]}, 4)
    assert isinstance(fig, Figure) and len(fig.axes[0].patches) == 4
    with pytest.raises(ValueError):
        plot_activation_peaks({}, 4)
