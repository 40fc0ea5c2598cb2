"""Lesson 05: split models, the GPipe and 1F1B schedules and balancing, checked against one device.

The split model and the GPipe step are written in part 05a's cells, the 1F1B step in 05b's;
these tests run that very code, read from the notebooks (tests/lesson05_code.py, as
benchmarks/pipeline.py reads it).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from lesson05_code import lesson, schedules, split_sequential
from torch import nn

from mgpu_helpers.devices import full_float32
from mgpu_helpers.lesson_code import load_lesson_code
from mgpu_helpers.memory import (
    measured_training_memory,
    memory_by_device,
    memory_by_stage,
    saved_activation_bytes,
    watch_activations,
)
from mgpu_helpers.model_parallel import (
    Event,
    Timeline,
    balance,
    best_pipeline_line,
    bubble_fraction,
    busy_shares,
    forward_overlap,
    idle_fraction,
    layer_costs,
    run_stages,
    two_thread_speedup,
    two_thread_verdict,
)
from mgpu_helpers.models import mlp, small_cnn
from mgpu_helpers.timing import Comparison

SplitModel, gpipe_step = lesson.SplitModel, lesson.gpipe_step
one_f_one_b_step, one_f_one_b_order = schedules.one_f_one_b_step, schedules.one_f_one_b_order


# The margin lesson 05a prints the forward overlap with (section 4.1): the tests' own.
OVERLAP_MARGIN = load_lesson_code("05a", ["OVERLAP_MARGIN"], {}).OVERLAP_MARGIN


def data(n: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def reference_step(model: nn.Module, x, y, lr: float = 0.1) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q.cpu(), p.cpu())


@pytest.mark.parametrize("cuts", [[4], [2, 7], [1, 5, 9]])
def test_split_model_matches_the_unsplit_model(cuts: list[int]) -> None:
    torch.manual_seed(0)
    whole = small_cnn()
    split = split_sequential(copy.deepcopy(whole), cuts, ["cpu"] * (len(cuts) + 1))
    x, y = data()
    torch.testing.assert_close(split(x), whole(x))
    F.cross_entropy(whole(x), y).backward()
    F.cross_entropy(split(x), y).backward()
    for p, q in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)


@pytest.mark.parametrize("step", ["gpipe", "1f1b"])
@pytest.mark.parametrize("n_micro", [1, 2, 3, 5, 24])
@pytest.mark.parametrize("n_stages", [2, 3])
def test_pipelined_step_equals_the_plain_step(n_micro: int, n_stages: int, step: str) -> None:
    """GPipe (05a) and 1F1B (05b): the same step as the unsplit model, inputs ready before use."""
    torch.manual_seed(0)
    whole = mlp(64, hidden=32, depth=4)
    cuts = balance(layer_costs(whole), n_stages)
    split = split_sequential(copy.deepcopy(whole), cuts, ["cpu"] * n_stages)
    x, y = data(24)
    expected_loss = reference_step(whole, x, y)
    opt = torch.optim.SGD(split.parameters(), lr=0.1, momentum=0.9)
    run = gpipe_step if step == "gpipe" else one_f_one_b_step
    loss, events = run(split, opt, x, y, n_micro)
    torch.testing.assert_close(loss, expected_loss)
    assert_same_parameters(whole, split)
    assert len(events) == 2 * n_stages * min(n_micro, 24)
    assert {e.kind for e in events} == {"F", "B"}
    assert_inputs_ready_before_use(events)


def test_schedule_order_respects_dependencies() -> None:
    torch.manual_seed(0)
    split = split_sequential(mlp(64, hidden=32, depth=4), [4], ["cpu", "cpu"])
    opt = torch.optim.SGD(split.parameters(), lr=0.1)
    x, y = data(16)
    _, events = gpipe_step(split, opt, x, y, 4)
    when = {(e.stage, e.micro, e.kind): e for e in events}
    for m in range(4):
        assert when[(1, m, "F")].start >= when[(0, m, "F")].end  # stage 1 waits for stage 0
        assert when[(0, m, "B")].start >= when[(1, m, "B")].end  # and the reverse backward
    backward_order = [
        e.micro for e in sorted(events, key=lambda e: e.start) if e.stage == 1 and e.kind == "B"
    ]
    assert backward_order == [3, 2, 1, 0]


@pytest.mark.parametrize("failing_stage", [0, 1, 2])
def test_pipeline_errors_surface_in_the_caller(failing_stage: int) -> None:
    """A stage that fails stops the others (they wait on their queues) and its own error,
    not a follower's, reaches the caller, for a first, middle or last stage."""
    split = split_sequential(mlp(64, hidden=32, depth=4), [3, 6], ["cpu"] * 3)

    def boom(*_: object) -> None:
        raise ZeroDivisionError(f"stage {failing_stage} failed")

    split.stages[failing_stage].register_forward_pre_hook(boom)
    opt = torch.optim.SGD(split.parameters(), lr=0.1)
    x, y = data(8)
    with pytest.raises(ZeroDivisionError, match=f"stage {failing_stage} failed"):
        gpipe_step(split, opt, x, y, 2)


def test_run_stages_raises_the_first_error_and_wakes_the_waiting_stages() -> None:
    import queue

    queues = [queue.Queue() for _ in range(2)]
    got: list[object] = []

    def run_stage(s: int) -> None:
        if s == 0:
            raise KeyError("first")
        got.append(queues[1].get())  # would wait for ever without the stop item

    with pytest.raises(KeyError, match="first"):
        run_stages(run_stage, 2, queues)
    assert got == [None]


def test_a_stage_that_waits_for_ever_is_an_error_naming_it() -> None:
    import queue
    import time

    queues = [queue.Queue() for _ in range(2)]

    def run_stage(s: int) -> None:
        if s == 1:
            queues[1].get()  # no stage ever sends to it

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"stage\(s\) \[1\] still ran after 0.5 s"):
        run_stages(run_stage, 2, queues, timeout=0.5)
    assert time.monotonic() - start < 5


def test_more_micro_batches_than_samples_gives_one_per_sample() -> None:
    torch.manual_seed(0)
    whole = mlp(64, hidden=32, depth=2)
    split = split_sequential(copy.deepcopy(whole), [3], ["cpu", "cpu"])
    x, y = data(5)
    expected = reference_step(whole, x, y)
    loss, events = gpipe_step(
        split, torch.optim.SGD(split.parameters(), lr=0.1, momentum=0.9), x, y, 8
    )
    torch.testing.assert_close(loss, expected)
    assert len(events) == 2 * 2 * 5


def test_balance_finds_the_best_contiguous_split() -> None:
    assert balance([1, 1, 1, 10, 1, 1], 3) == [3, 4]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [1]
    assert balance([1, 1, 1, 1], 2) == [2]
    assert balance([3, 3, 3], 3) == [1, 2]
    assert balance([7.0], 1) == []
    with pytest.raises(ValueError, match="n_stages"):
        balance([1, 2], 3)


def test_balance_by_parameters_on_uneven_layers() -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    costs = layer_costs(model)
    assert costs == [262656.0, 4104.0, 72.0, 72.0]
    (cut,) = balance(costs, 2)
    assert cut == 1  # the big layer alone; half the layers each would put 3 of 4 costs first
    naive_max = max(sum(costs[:2]), sum(costs[2:]))
    balanced_max = max(sum(costs[:cut]), sum(costs[cut:]))
    assert balanced_max < naive_max


def test_layer_costs_by_time_needs_a_sample() -> None:
    model = mlp(64, depth=2)
    with pytest.raises(ValueError, match="sample"):
        layer_costs(model, by="time")
    with pytest.raises(ValueError, match="'params' or 'time'"):
        layer_costs(model, by="flops")
    x, _ = data(8)
    times = layer_costs(model, by="time", sample=x, repeats=2)
    assert len(times) == len(model) and all(t > 0 for t in times)
    assert all(p.grad is None for p in model.parameters())


def test_the_cut_keeps_every_layer_once_in_order() -> None:
    model = small_cnn()
    for cuts in ([4], [2, 7], [1, 5, 9]):
        stages = lesson.cut(model, cuts)
        assert len(stages) == len(cuts) + 1
        assert [layer for stage in stages for layer in stage] == list(model)
    with pytest.raises(ValueError, match="one device per stage"):
        memory_by_stage([nn.Identity()], ["cpu", "cpu"])


def test_timeline_records_work_in_seconds_from_its_start() -> None:
    timeline = Timeline([torch.device("cpu")])
    begin = timeline.mark(torch.device("cpu"))
    sum(range(10_000))
    timeline.add(0, 0, "F", torch.device("cpu"), begin)
    (event,) = timeline.events()
    assert event.stage == 0 and event.micro == 0 and event.kind == "F"
    assert 0 <= event.start < event.end < 10


def test_memory_by_device_counts_parameters_gradients_state_and_activations() -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    x = torch.randn(4, 10)
    report = memory_by_device(model, optimizer_slots=2, sample=x)["cpu"]
    params = (10 * 20 + 20 + 20 * 5 + 5) * 4
    assert report["parameters"] == report["gradients"] == params
    assert report["optimizer"] == 2 * params
    # Backward keeps the ReLU's output (which the second Linear saves too), not the first
    # Linear's output, the logits, or the input batch: one 4 x 20 float32 tensor.
    assert report["activations"] == 4 * 20 * 4


def test_activations_are_what_autograd_saves_in_an_mlp() -> None:
    """Lesson 05a, section 2.1: a hand count of what backward needs. In the course's MLP
    (Flatten, then Linear + ReLU per hidden layer, then a Linear) autograd keeps each ReLU's
    output, once, although the next Linear saves it too; the Flatten is a view of the input,
    and the first Linear saves only the input batch, which is not counted."""
    batch, hidden, depth = 8, 32, 3
    model = mlp(64, hidden=hidden, depth=depth)
    x, _ = data(batch)
    assert saved_activation_bytes(model, x) == {"cpu": depth * batch * hidden * 4}
    assert memory_by_device(model, 1, x)["cpu"]["activations"] == depth * batch * hidden * 4
    # A GELU needs its input for backward: there the Linear's output is kept as well.
    gelu = nn.Sequential(nn.Linear(10, 20), nn.GELU(), nn.Linear(20, 5))
    assert saved_activation_bytes(gelu, torch.randn(4, 10)) == {"cpu": 2 * 4 * 20 * 4}


def test_activations_leave_batchnorm_statistics_as_they_were() -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20), nn.ReLU())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saved = saved_activation_bytes(model, torch.randn(4, 10))["cpu"]
    # the Linear's output and the ReLU's, and BatchNorm's batch mean and inverse deviation
    assert saved == (2 * 4 * 20 + 2 * 20) * 4
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_bubble_and_idle_fractions() -> None:
    assert bubble_fraction(2, 1) == pytest.approx(0.5)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 5) == 0.0
    with pytest.raises(ValueError):
        bubble_fraction(0, 1)
    # two stages, one micro-batch, equal work: each idle half the time
    events = [
        Event(0, 0, "F", 0, 1),
        Event(1, 0, "F", 1, 2),
        Event(1, 0, "B", 2, 3),
        Event(0, 0, "B", 3, 4),
    ]
    assert idle_fraction(events) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        idle_fraction([])


def assert_inputs_ready_before_use(events: list[Event], slack: float = 0.0) -> None:
    """Every forward starts after the previous stage's forward of that micro-batch ended, and
    every backward after the next stage's backward (the timeline's begin marks are taken once
    the input is there). ``slack`` allows for the offset between two GPUs' clocks."""
    when = {(e.stage, e.micro, e.kind): e for e in events}
    for (s, m, kind), e in when.items():
        before = (s - 1, m, "F") if kind == "F" else (s + 1, m, "B")
        if before in when:
            assert e.start >= when[before].end - slack, f"{e} starts before {when[before]} ends"


def test_forward_overlap_reads_the_timeline() -> None:
    piped = [Event(0, 0, "F", 0, 1), Event(0, 1, "F", 1, 2), Event(1, 0, "F", 1, 2)]
    assert forward_overlap(piped) == pytest.approx(1.0)  # stage 1 started one unit early
    serial = [Event(0, 0, "F", 0, 1), Event(0, 1, "F", 1, 2), Event(1, 0, "F", 2.5, 3)]
    assert forward_overlap(serial) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="stages 1 and 2"):
        forward_overlap(piped, stage=1)


@pytest.mark.gpu
def test_split_and_pipeline_on_one_gpu_twice() -> None:
    full_float32()
    torch.manual_seed(0)
    whole = mlp(64, hidden=64, depth=4).cuda()
    split = split_sequential(copy.deepcopy(whole), [4], ["cuda:0", "cuda:0"])
    x, y = (t.cuda() for t in data(32))
    expected_loss = reference_step(whole, x, y)
    loss, events = gpipe_step(
        split, torch.optim.SGD(split.parameters(), lr=0.1, momentum=0.9), x, y, 4
    )
    torch.testing.assert_close(loss, expected_loss)
    assert_same_parameters(whole, split)
    # one GPU, one stream: the stages take turns, and each input is there before it is used
    assert_inputs_ready_before_use(events)


@pytest.mark.multigpu
def test_split_and_pipeline_on_two_gpus() -> None:
    full_float32()
    torch.manual_seed(0)
    whole = mlp(64, hidden=64, depth=4).to("cuda:0")
    split = split_sequential(copy.deepcopy(whole), [4], ["cuda:0", "cuda:1"])
    x, y = (t.to("cuda:0") for t in data(32))
    torch.testing.assert_close(split(x).to("cuda:0"), whole(x))
    expected_loss = reference_step(whole, x, y)
    loss, events = gpipe_step(
        split, torch.optim.SGD(split.parameters(), lr=0.1, momentum=0.9), x, y, 4
    )
    torch.testing.assert_close(loss.to("cuda:0"), expected_loss)  # the loss is on cuda:1
    assert_same_parameters(whole, split)
    assert all(e.end >= e.start >= 0 for e in events)


@pytest.mark.multigpu
@pytest.mark.parametrize("n_micro", [2, 4])
def test_pipeline_overlaps_on_two_gpus(n_micro: int) -> None:
    """The lesson's claim on two GPUs: with M >= 2 micro-batches the stages work at the same
    time. Two equal stages, big enough that a forward takes far longer than the copy."""
    full_float32()
    torch.manual_seed(0)
    model = mlp(4096, hidden=4096, depth=6)
    cuts = balance(layer_costs(model), 2)
    assert cuts == [6]  # three 4096 x 4096 layers on each GPU
    split = split_sequential(model, cuts, ["cuda:0", "cuda:1"])
    opt = torch.optim.SGD(split.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 4096, generator=g).to("cuda:0")
    y = torch.randint(0, 10, (4096,), generator=g).to("cuda:0")
    for _ in range(2):  # warm-up: cuBLAS, the allocator, the copy streams
        gpipe_step(split, opt, x, y, n_micro)
    _, events = gpipe_step(split, opt, x, y, n_micro)
    assert_inputs_ready_before_use(events, slack=1e-4)  # the two clocks' offset: microseconds
    first_f1 = min((e for e in events if e.stage == 1 and e.kind == "F"), key=lambda e: e.start)
    last_f0 = max((e for e in events if e.stage == 0 and e.kind == "F"), key=lambda e: e.end)
    # Each GPU's clock starts at its own origin event, recorded one after the other: the two
    # clocks differ by a few microseconds, so an overlap counts only with a margin.
    margin = (
        OVERLAP_MARGIN  # 0.1 ms; one micro-batch forward (1024+ samples, three 4096 layers): ~1 ms
    )
    assert first_f1.start < last_f0.end - margin, f"no overlap: {first_f1} vs {last_f0}"
    if n_micro >= 4:
        # A serialised schedule can hide behind early begin marks; its ends cannot: with equal
        # stages, stage 1 ends micro-batch 0 (slot 2) while stage 0 works on the last (slot M).
        assert first_f1.end < last_f0.end - margin, f"serialised: {first_f1} vs {last_f0}"
    assert forward_overlap(events) > margin
    # the idle share is near the bubble, not the naive split's 50%
    assert idle_fraction(events) < 0.5 - 0.5 * (0.5 - bubble_fraction(2, n_micro))


def test_memory_of_a_split_model_is_reported_per_stage_even_on_one_device() -> None:
    whole = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    split = split_sequential(copy.deepcopy(whole), [2], ["cpu", "cpu"])
    x = torch.randn(4, 10)
    report = memory_by_stage(split.stages, split.devices, optimizer_slots=1, sample=x)
    assert len(report) == 2
    assert report[0]["parameters"] == (10 * 20 + 20) * 4
    assert report[1]["parameters"] == (20 * 5 + 5) * 4
    boundary = 4 * 20 * 4  # the ReLU's output: stage 0 keeps it, stage 1's Linear its copy
    assert report[0]["activations"] == boundary
    assert report[1]["activations"] == boundary
    total = memory_by_device(whole, optimizer_slots=1, sample=x)["cpu"]
    for key in ("parameters", "gradients", "optimizer"):
        assert sum(r[key] for r in report) == total[key]
    # on devices of their own the two stages hold the boundary activation twice
    assert sum(r["activations"] for r in report) == total["activations"] + boundary


def _allocated_after_forward(model: nn.Module, x: torch.Tensor, devices: list[str]) -> dict:
    """Bytes each GPU gained during a training forward whose output was then dropped."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):  # warm-up: cuBLAS workspaces and the like stay allocated
        opt.zero_grad()
        model(x).sum().backward()
    opt.zero_grad(set_to_none=True)
    for d in devices:
        torch.cuda.synchronize(d)
    before = {d: torch.cuda.memory_allocated(d) for d in devices}
    out = model(x)
    grown = {d: torch.cuda.memory_allocated(d) - before[d] for d in devices}
    out_bytes = out.untyped_storage().nbytes()
    grown[str(out.device)] -= out_bytes  # the output is not an activation backward keeps
    del out
    return grown


@pytest.mark.gpu
def test_computed_activations_match_the_allocator_on_a_gpu() -> None:
    """What memory_by_device computes is what the allocator holds after a forward, within
    its 512-byte blocks (a few per saved tensor)."""
    torch.manual_seed(0)
    model = mlp(64, hidden=1024, depth=5).cuda()
    x, _ = data(512)
    x = x.cuda()
    computed = memory_by_device(model, 1, x)["cuda:0"]["activations"]
    measured = _allocated_after_forward(model, x, ["cuda:0"])["cuda:0"]
    assert computed == 5 * 512 * 1024 * 4
    assert abs(measured - computed) <= 16 * 512, (measured, computed)


@pytest.mark.multigpu
def test_computed_activations_per_stage_match_the_allocator_on_two_gpus() -> None:
    torch.manual_seed(0)
    split = split_sequential(mlp(64, hidden=1024, depth=5), [7], ["cuda:0", "cuda:1"])
    x, _ = data(512)
    x = x.to("cuda:0")
    report = memory_by_stage(split.stages, split.devices, 1, x)
    measured = _allocated_after_forward(split, x, ["cuda:0", "cuda:1"])
    for i, d in enumerate(("cuda:0", "cuda:1")):
        computed = report[i]["activations"]
        assert computed == 3 * 512 * 1024 * 4  # three ReLU outputs; stage 1: the copy, two
        assert abs(measured[d] - computed) <= 16 * 512, (d, measured[d], computed)


def test_each_stage_sends_right_after_its_own_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order that keeps two GPUs overlapping (lesson 05a, section 3.1): the stage that
    computed an activation (or an input's gradient) issues its transfer at once, from its own
    thread, before its next piece of work; a copy issued by the receiver would queue behind
    the sender's later work on a GPU. Shown on the CPU by logging each thread's calls."""
    import threading

    log: dict[int, list[str]] = {}

    def note(what: str) -> None:
        log.setdefault(threading.get_ident(), []).append(what)

    real_send = lesson.send

    def send(t, dst, streams):
        note("send")
        return real_send(t, dst, streams)

    monkeypatch.setitem(gpipe_step.__globals__, "send", send)  # the name gpipe_step calls
    torch.manual_seed(0)
    split = split_sequential(mlp(64, hidden=32, depth=4), [3, 6], ["cpu"] * 3)
    for s, stage in enumerate(split.stages):
        stage.register_forward_hook(lambda *_, s=s: note(f"F{s}"))
        stage.register_full_backward_pre_hook(lambda *_, s=s: note(f"B{s}"))
    opt = torch.optim.SGD(split.parameters(), lr=0.1)
    x, y = data(16)
    gpipe_step(split, opt, x, y, 4)
    per_stage = sorted(log.values(), key=lambda calls: calls[0])  # F0..., F1..., F2...
    assert per_stage == [
        ["F0", "send"] * 4 + ["B0"] * 4,  # the first stage sends no gradient back
        ["F1", "send"] * 4 + ["B1", "send"] * 4,
        ["F2"] * 4 + ["B2", "send"] * 4,  # the last stage computes the loss, sends no output
    ]


# --- part 05b: 1F1B, activation memory, busy shares ---------------------------------------


@pytest.mark.parametrize(("n_stages", "n_micro"), [(1, 1), (2, 4), (3, 2), (4, 8)])
def test_one_f_one_b_order_alternates_after_the_warm_up(n_stages: int, n_micro: int) -> None:
    for s in range(n_stages):
        order = one_f_one_b_order(n_stages, s, n_micro)
        assert sorted(order) == sorted(
            [("F", m) for m in range(n_micro)] + [("B", m) for m in range(n_micro)]
        )
        assert [m for kind, m in order if kind == "B"] == list(range(n_micro))  # in order
        live, held = 0, 0
        for kind, _ in order:
            live += 1 if kind == "F" else -1
            held = max(held, live)
        assert held == min(n_stages - s, n_micro)
        warmup = min(n_stages - 1 - s, n_micro)
        steady = order[warmup : warmup + 2 * (n_micro - warmup)]
        assert [kind for kind, _ in steady] == ["F", "B"] * (n_micro - warmup)


def test_one_f_one_b_runs_each_stage_in_its_order_and_sends_at_once() -> None:
    """Each stage thread follows one_f_one_b_order, and the steps the timeline records show it."""
    torch.manual_seed(0)
    split = split_sequential(mlp(64, hidden=32, depth=4), [3, 6], ["cpu"] * 3)
    opt = torch.optim.SGD(split.parameters(), lr=0.1)
    x, y = data(24)
    _, events = one_f_one_b_step(split, opt, x, y, 6)
    for s in range(3):
        row = sorted((e for e in events if e.stage == s), key=lambda e: e.start)
        assert [(e.kind, e.micro) for e in row] == one_f_one_b_order(3, s, 6)


@pytest.mark.parametrize(("n_stages", "n_micro"), [(2, 4), (3, 6)])
def test_one_f_one_b_holds_fewer_activations_than_gpipe(n_stages: int, n_micro: int) -> None:
    """Lesson 05b, section 3.1: on the same split GPipe's stages hold all M micro-batches'
    activations at once, 1F1B's stage s at most min(S - s, M), counted from the tensors."""
    torch.manual_seed(0)
    whole = mlp(64, hidden=32, depth=6)
    split = split_sequential(whole, balance(layer_costs(whole), n_stages), ["cpu"] * n_stages)
    opt = torch.optim.SGD(split.parameters(), lr=0.1)
    x, y = data(24)
    peaks = {}
    for name, step in (("gpipe", gpipe_step), ("1f1b", one_f_one_b_step)):
        with watch_activations(split.stages, exclude=[x]) as meters:
            step(split, opt, x, y, n_micro)
        peaks[name] = [m.peak for m in meters]
        assert all(m.live == 0 for m in meters), "backward must free every saved activation"
    for s, (g, o) in enumerate(zip(peaks["gpipe"], peaks["1f1b"], strict=True)):
        assert g > 0
        assert o * n_micro == g * min(n_stages - s, n_micro), (s, o, g)


def test_watch_activations_counts_saved_tensors_until_backward() -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    x = torch.randn(4, 10)
    expected = saved_activation_bytes(model, x)["cpu"]
    with watch_activations([model], exclude=[x]) as (meter,):
        out = model(x)
        # the ReLU's output, saved by the ReLU and the second Linear: one storage, once
        assert meter.live == meter.peak == 4 * 20 * 4 == expected
        out.sum().backward()
        assert meter.live == 0 and meter.peak == 4 * 20 * 4
    model(x).sum().backward()  # the hooks are gone after the block
    assert meter.peak == 4 * 20 * 4


def test_watch_activations_counts_per_stage_and_survives_an_error() -> None:
    first, second = nn.Sequential(nn.Linear(10, 20), nn.ReLU()), nn.Sequential(nn.Linear(20, 5))
    x = torch.randn(4, 10)
    with watch_activations([first, second], exclude=[x]) as meters:
        h = first(x)
        out = second(h)  # kept: freeing the graph would free what it saved
        assert [m.live for m in meters] == [4 * 20 * 4, 4 * 20 * 4]  # each stage's own copy
        with pytest.raises(RuntimeError):
            first(torch.randn(4, 3))  # a wrong shape fails inside the watched forward
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        first(x)  # the failed forward left no hook of the meter's behind
    assert saved and all(isinstance(t, torch.Tensor) for t in saved)
    del out
    assert [m.live for m in meters] == [4 * 20 * 4, 0]  # the graph of `second` is gone


def test_busy_shares_are_per_stage_and_prefer_cpu_time() -> None:
    events = [Event(0, 0, "F", 0, 1), Event(1, 0, "F", 1, 4), Event(0, 0, "B", 4, 5)]
    assert busy_shares(events) == pytest.approx([2 / 5, 3 / 5])
    waited = [Event(0, 0, "F", 0, 4, cpu=1.0), Event(1, 0, "F", 0, 4, cpu=4.0)]
    assert busy_shares(waited) == pytest.approx([1 / 4, 1.0])  # waiting for a core is not busy
    with pytest.raises(ValueError, match="no events"):
        busy_shares([])


def test_cpu_timeline_counts_thread_time_not_waiting() -> None:
    import time

    timeline = Timeline([torch.device("cpu")])
    begin = timeline.mark(torch.device("cpu"))
    time.sleep(0.05)  # on the clock, but no CPU work
    timeline.add(0, 0, "F", torch.device("cpu"), begin)
    begin = timeline.mark(torch.device("cpu"))
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # CPU work
        pass
    timeline.add(0, 1, "F", torch.device("cpu"), begin)
    slept, worked = sorted(timeline.events(), key=lambda e: e.micro)
    assert slept.end - slept.start >= 0.05 and slept.cpu < 0.02
    assert worked.cpu >= 0.05
    assert busy_shares([slept])[0] < 0.5


def test_two_thread_speedup_is_a_ratio_of_timings() -> None:
    speedup = two_thread_speedup(repeats=1, size=256)
    assert 0 < speedup < 4  # 2 with two free cores, 1 when the threads take turns


@pytest.mark.parametrize(
    ("speedup", "meaning"),
    [
        (1.95, "two free cores"),
        (1.5, "two free cores"),
        (1.2, "take turns"),
        (0.95, "take turns"),
        (0.52, "so busy that running two threads together costs extra"),
    ],
)
def test_two_thread_verdict_says_what_the_ratio_means(speedup: float, meaning: str) -> None:
    ratio, said = two_thread_verdict(speedup).split("\n")
    assert ratio.startswith(f"two threads at once: {speedup:.2f}x")
    assert meaning in said and len(ratio) <= 100 and len(said) <= 100
    assert ("below 1x" in said) == (speedup < 0.9)  # lesson 05a's run printed 0.52x


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_two_thread_verdict_refuses_what_is_no_ratio(bad: float) -> None:
    with pytest.raises(ValueError, match="positive number"):
        two_thread_verdict(bad)


AGREE, TORN = Comparison((1.3, 1.2, 1.4, 1.25, 1.3)), Comparison((0.4, 2.35, 0.9, 1.6, 1.1))


def test_best_pipeline_line_names_a_best_only_below_its_ideal_with_a_verdict() -> None:
    assert best_pipeline_line(4, 1.42, 1.6, AGREE) == (
        "best pipeline: M=4, 1.42x the unsplit model (ideal 1.60x)"
    )
    for speedup, verdict, why in [
        (1.03, AGREE, "at or above its ideal"),  # lesson 05b's busy run: M=16 beat its 1.00x
        (1.00, AGREE, "at or above its ideal"),
        (0.9, TORN, "no verdict against the naive split"),  # 0.40x to 2.35x
        (1.03, TORN, "at or above its ideal"),
    ]:
        line = best_pipeline_line(16, speedup, 1.0, verdict)
        assert not line.startswith("best") and "within the noise" in line and why in line, line
        assert line.startswith(f"fastest pipeline: M=16, {speedup:.2f}x the unsplit model")
        assert all(len(part) <= 100 for part in line.splitlines())


def test_the_overlap_margin_is_the_tests() -> None:
    assert OVERLAP_MARGIN == 1e-4  # 0.1 ms: lesson 05a prints the overlap with this margin


def test_measured_training_memory_needs_a_gpu() -> None:
    with pytest.raises(ValueError, match="needs a GPU"):
        measured_training_memory(
            lambda: nn.Linear(4, 2),
            [torch.device("cpu")],
            torch.randn(2, 4),
            torch.zeros(2, dtype=torch.long),
        )


@pytest.mark.gpu
def test_measured_training_memory_sees_the_activations_autograd_saves() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(256, 1, 8, 8), torch.randint(0, 10, (256,))
    row = measured_training_memory(
        lambda: mlp(64, hidden=512, depth=3).cuda(), [torch.device("cuda:0")], x, y
    )["cuda:0"]
    computed = memory_by_device(mlp(64, hidden=512, depth=3).cuda(), 1, x.cuda())["cuda:0"]
    assert abs(row["parameters"] - computed["parameters"]) <= 16 * 512
    assert abs(row["activations"] - computed["activations"]) <= 16 * 512
    assert row["gradients + optimizer"] >= computed["gradients"] + computed["optimizer"]
