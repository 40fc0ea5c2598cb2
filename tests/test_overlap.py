"""mgpu_helpers.overlap (lesson 06a): the clock, the bucket recorder on real DDP over gloo, the
gradient stamps, the gradient comparison, the phase timer and the two drawings."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from matplotlib.patches import FancyArrowPatch, Rectangle
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.launch import launch
from mgpu_helpers.models import mlp
from mgpu_helpers.overlap import (
    BucketRecorder,
    Clock,
    assert_same_gradients,
    layer_pieces,
    overlap_seconds,
    plot_bucketed_backward,
    plot_step_timeline,
    stamp_gradients,
    time_phases,
)


def test_the_cpu_clock_counts_seconds_from_its_start() -> None:
    clock = Clock("cpu")
    time.sleep(0.02)
    clock.start()
    time.sleep(0.03)
    assert 0.025 < clock.seconds(clock.now()) < 0.5


def recorder_worker(env: DistEnv, cap_mb: float, steps: int) -> dict:
    torch.manual_seed(0)
    model = mlp(16, 4, hidden=64, depth=2)  # bytes per tensor: 4096 256 16384 256 1024 16
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    recorder = BucketRecorder(model, env.device)
    ddp.register_comm_hook(None, recorder.hook)
    reference = mlp(16, 4, hidden=64, depth=2)
    reference.load_state_dict(model.state_dict())
    x, y = (
        torch.randn(8, 16, generator=torch.Generator().manual_seed(env.rank)),
        torch.arange(8) % 4,
    )
    stamps: list = []
    for _ in range(steps):
        recorder.new_step()
        stamps.clear()
        remove = stamp_gradients(model, recorder.clock, stamps)
        start = recorder.clock.now()
        F.cross_entropy(ddp(x), y).backward()
        remove()
    return {
        "layouts": [recorder.layout(k) for k in range(steps)],
        "intervals": recorder.intervals(),
        "nbytes": [r.nbytes for r in recorder.steps[-1]],
        "pieces": layer_pieces(model, stamps, recorder.clock, start),
        "grad": model[1].weight.grad.clone(),  # the hook's result: DDP's average
    }


def test_the_recorder_sees_ddps_buckets_and_the_default_hook_still_averages() -> None:
    cap = 17000 / 2**20  # closes [5, 4, 3, 2] (17680 B), then [1, 0]
    ranks = launch(recorder_worker, 2, cap, 3, device="cpu", echo=False, timeout=60)
    for r in ranks:
        assert r["layouts"][0] == [[0, 1, 2, 3, 4, 5]]  # before DDP knows the gradients' order
        assert r["layouts"][1] == r["layouts"][2] == [[5, 4, 3, 2], [1, 0]]
        assert sorted(r["nbytes"]) == sorted([17680, 4352])
        assert [label for label, _, _ in r["intervals"]] == ["bucket 0", "bucket 1"]
        assert all(0 <= start <= end for _, start, end in r["intervals"])
        assert [label for label, _, _ in r["pieces"]] == ["Linear 3", "Linear 2", "Linear 1"]
    torch.testing.assert_close(ranks[0]["grad"], ranks[1]["grad"])  # averaged over both ranks


def test_intervals_refuse_a_bucket_still_in_flight() -> None:
    recorder = BucketRecorder(nn.Linear(2, 2), "cpu")
    recorder.new_step()
    recorder.steps[-1].append(
        __import__("mgpu_helpers.overlap", fromlist=["BucketRecord"]).BucketRecord(
            0, [1, 0], 24, 0.0
        )
    )
    with pytest.raises(RuntimeError, match="has not finished"):
        recorder.intervals()


def test_stamp_gradients_fires_once_per_parameter_and_removes_its_hooks() -> None:
    model, stamps = mlp(4, 2, hidden=8, depth=1), []
    clock = Clock("cpu")
    remove = stamp_gradients(model, clock, stamps)
    model(torch.randn(3, 4)).sum().backward()
    assert sorted(i for i, _ in stamps) == list(range(len(list(model.parameters()))))
    assert [i for i, _ in stamps][:2] in ([3, 2], [2, 3])  # the last layer's gradients first
    remove()
    model(torch.randn(3, 4)).sum().backward()
    assert len(stamps) == 4


def _results(grads_a: list, grads_b: list) -> list[dict]:
    return [{"mine": {"grads": grads_a}, "ddp": {"grads": grads_b}}]


def test_assert_same_gradients_allows_rounding_and_names_a_real_difference() -> None:
    g = torch.randn(10)
    assert assert_same_gradients(_results([g * (1 + 1e-7)], [g]), "mine") < 1e-5
    with pytest.raises(AssertionError, match="rank 0, parameter 0, mine vs ddp"):
        assert_same_gradients(_results([g + 1e-3], [g]), "mine")
    with pytest.raises(AssertionError, match="mine gives no gradient, ddp one"):
        assert_same_gradients(_results([None], [g]), "mine")
    assert assert_same_gradients(_results([None], [None]), "mine") == 0.0


def test_overlap_seconds_counts_only_time_with_both() -> None:
    compute = [("a", 0.0, 1.0), ("b", 1.0, 2.0)]
    assert overlap_seconds(compute, [("b0", 1.5, 3.0), ("b1", 1.8, 2.5)]) == pytest.approx(0.5)
    assert overlap_seconds(compute, [("b0", 2.0, 3.0)]) == 0.0


def test_time_phases_times_each_phase_apart() -> None:
    timed = time_phases(
        {"short": lambda: time.sleep(0.002), "long": lambda: time.sleep(0.02)}, "cpu", repeats=3
    )
    assert len(timed["short"].times) == len(timed["long"].times) == 3
    assert timed["long"].median > 3 * timed["short"].median
    with pytest.raises(ValueError, match="repeats >= 1"):
        time_phases({"a": lambda: None}, "cpu", repeats=0)


def test_the_schematic_draws_each_bucket_with_its_arrow_and_refuses_one_bucket() -> None:
    fig = plot_bucketed_backward(n_layers=6, layers_per_bucket=2)
    ax = fig.axes[0]
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == 3  # one per bucket
    labels = [t.get_text() for t in ax.texts]
    assert [t for t in labels if t.startswith("all-reduce")] == [
        "all-reduce b0",
        "all-reduce b1",
        "all-reduce b2",
    ]
    assert "backward ends" in labels
    for bad in ((1, 1), (4, 4), (4, 0)):
        with pytest.raises(ValueError, match="2 buckets or more"):
            plot_bucketed_backward(*bad)


def test_the_timeline_keeps_duration_labels_clear_of_the_bars_and_draws_the_bound() -> None:
    phases = [("forward", 0.0, 0.01), ("Linear 2", 0.01, 0.03), ("optimizer", 0.05, 0.055)]
    comm = [("bucket 0", 0.02, 0.04), ("bucket 1", 0.03, 0.03)]  # a bucket of ~0 ms at the end
    fig = plot_step_timeline(phases, comm, bound=0.06)
    ax = fig.axes[0]
    labels = {t.get_text(): t.get_position()[0] for t in ax.texts}
    assert labels["< 0.1 ms"] > 30.0  # right of its bar's end (30 ms), not on it
    assert labels["20.0 ms"] > 40.0
    assert any(line.get_xdata()[0] == pytest.approx(60.0) for line in ax.lines)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(legend) == ["Linear 2", "bound with perfect overlap", "forward", "optimizer"]
    assert len([p for p in ax.patches if isinstance(p, Rectangle)]) == 5
    with pytest.raises(ValueError, match="ends"):
        plot_step_timeline([("x", 1.0, 0.0)], comm)
    with pytest.raises(ValueError, match="need both"):
        plot_step_timeline([], comm)


def big_bucket_worker(env: DistEnv) -> tuple[float, float]:
    """One DDP step of a model that is one 256 MiB bucket: the recorded all-reduce against the
    same all-reduce timed alone with CUDA events."""
    model = nn.Linear(8192, 8192, bias=False).to(env.device)  # 256 MiB of float32 gradient
    ids = [env.device.index] if env.backend == "nccl" else None
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=1024)
    recorder = BucketRecorder(model, env.device)
    ddp.register_comm_hook(None, recorder.hook)
    x = torch.randn(8, 8192, device=env.device)
    for _ in range(3):
        recorder.new_step()
        ddp(x).sum().backward()
    torch.cuda.synchronize(env.device)
    (_, launched, done), *_ = recorder.intervals()
    buffer = torch.ones(8192 * 8192, device=env.device)
    clock = Clock(env.device)
    torch.distributed.all_reduce(buffer)  # blocking: the stream waits for the collective
    end = clock.now()
    torch.cuda.synchronize(env.device)
    return done - launched, clock.seconds(end)


@pytest.mark.parametrize(
    "share",
    [
        pytest.param(True, id="shared-gpu", marks=pytest.mark.gpu),
        pytest.param(False, id="nccl", marks=pytest.mark.multigpu),
    ],
)
def test_on_gpus_the_recorded_end_of_an_all_reduce_is_its_end_on_the_device(share: bool) -> None:
    """If the callback's event were not ordered after the collective, a 256 MiB bucket would
    seem to finish at once; it must take about as long as the same all-reduce timed alone."""
    from mgpu_helpers.placement import place

    for recorded, alone in launch(
        big_bucket_worker, place(2, "cuda", share_gpus=share), echo=False, timeout=180
    ):
        assert recorded >= 0.5 * alone, (recorded, alone)
