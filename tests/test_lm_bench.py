"""mgpu_helpers.lm_bench (lesson 11): the variants side by side in one launch, and their text.

One real launch of 2 gloo processes with a tiny GPT checks :func:`measure_variants`' fields and
its arithmetic (never a speed); the text, the picture and the summary are checked on hand-built
numbers.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display in the tests

import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.container import BarContainer, ErrorbarContainer  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from torch import nn  # noqa: E402

from mgpu_helpers.dist_env import DistEnv  # noqa: E402
from mgpu_helpers.launch import WorkerError, launch  # noqa: E402
from mgpu_helpers.lm import GPT, GPTConfig, stdlib_bytes  # noqa: E402
from mgpu_helpers.lm_bench import (  # noqa: E402
    COMPILE_TOLERANCE,
    NO_SYNC,
    NOISY,
    Trainer,
    compile_check,
    compile_text,
    measure_variants,
    peak_text,
    plot_variants,
    summarize,
    variants_for,
    variants_table,
)
from mgpu_helpers.lm_train import LMRun  # noqa: E402
from mgpu_helpers.mfu import compile_available, flops_per_token  # noqa: E402
from mgpu_helpers.placement import place  # noqa: E402

TINY = GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=4)


def test_variants_follow_the_world_size() -> None:
    assert variants_for(1, 4) == ("single",)
    assert variants_for(2, 4) == ("single", "ddp", "fsdp")
    assert variants_for(4, 4) == ("single", "ddp", "fsdp", "fsdp_tp")
    assert variants_for(4, 3) == ("single", "ddp", "fsdp")  # 3 heads: no 2-way TP


def test_summary_arithmetic_on_given_times() -> None:
    cfg = GPTConfig(seq_len=16, d_model=32, n_layers=2)
    times = {"single": [0.4, 0.5, 0.6, 0.5, 0.5], "ddp": [0.2, 0.25, 0.3, 0.25, 0.25]}
    res = summarize(times, ("single", "ddp"), 2, 8, cfg, {"flops": 1e9})
    assert res["single"]["tokens_per_s"] == pytest.approx(8 * 16 / 0.5)
    assert res["single"]["mfu"] == pytest.approx(8 * 16 / 0.5 * flops_per_token(cfg) / 1e9)
    assert res["ddp"]["mfu"] == pytest.approx(8 * 16 / 0.25 * flops_per_token(cfg) / 2e9)
    assert res["ddp"]["speedup"] == pytest.approx(2.0) and res["ddp"]["speedup_meaningful"]
    assert res["ddp"]["scaling_efficiency"] == pytest.approx(1.0)
    times[NO_SYNC] = [0.15, 0.2, 0.2, 0.2, 0.1]  # DDP's step without its all-reduce
    res = summarize(times, ("single", "ddp"), 2, 8, cfg, {"flops": 1e9})
    assert res["ddp"]["communication_share"] == pytest.approx(1 - 0.2 / 0.25)
    assert res["ddp"]["communication_meaningful"]  # faster in every round
    times[NO_SYNC] = [0.3, 0.2, 0.2, 0.2, 0.2]  # one round slower: the rounds disagree
    assert not summarize(times, ("single", "ddp"), 2, 8, cfg, {"flops": 1e9})["ddp"][
        "communication_meaningful"
    ]
    assert NO_SYNC not in res  # a measurement of ddp's, not a variant


def _gradients_agree(env: DistEnv, no_sync: bool) -> bool:
    """One DDP step of lesson 11's Trainer; do the ranks end with the same gradients?"""
    trainer = Trainer(env, "ddp", TINY, 4, stdlib_bytes("train", 20_000), no_sync=no_sync)
    trainer.step()
    grad = trainer.model.module.blocks[0].mlp.up.weight.grad.flatten()
    both = [torch.empty_like(grad) for _ in range(env.world_size)]
    torch.distributed.all_gather(both, grad)
    return torch.equal(both[0], both[1])


def test_no_sync_step_leaves_out_the_all_reduce() -> None:
    """The no_sync entry must time DDP's step without its all-reduce: the ranks' gradients then
    stay their own (each rank saw other rows), while DDP's own step makes them equal. With the
    forward outside no_sync(), DDP would still all-reduce, and this test fails."""
    assert launch(_gradients_agree, place(2, "cpu"), False, echo=False) == [True, True]
    assert launch(_gradients_agree, place(2, "cpu"), True, echo=False) == [False, False]


def test_measure_variants_in_one_launch_of_two_ranks() -> None:
    data = measure_variants(place(2, "cpu"), TINY, 4, 2, data_limit=20_000, peak_size=64)
    assert set(data) == {"peak", "results", "variants", "world_size", "batch", "repeats",
                         "config", "noisy", "launch_s"}  # fmt: skip
    assert data["variants"] == ["single", "ddp", "fsdp"] == list(data["results"])
    assert (data["world_size"], data["batch"], data["repeats"]) == (2, 4, 2)
    assert data["config"] == asdict(TINY) and data["launch_s"] > 0
    peak = data["peak"]
    assert peak["dtype"] == "float32" and peak["size"] == 64 and peak["flops"] > 0
    assert peak["datasheet"] is None and "gpu" not in peak  # the CPU: no datasheet
    for name, row in data["results"].items():
        assert len(row["seconds_per_round"]) == 2
        assert row["median_s"] == statistics.median(row["seconds_per_round"])
        assert row["tokens_per_s"] == pytest.approx(4 * 32 / row["median_s"])
        devices = 1 if name == "single" else 2
        assert row["devices"] == devices
        expected = row["tokens_per_s"] * flops_per_token(TINY) / (devices * peak["flops"])
        assert row["mfu"] == pytest.approx(expected)
        assert ("scaling_efficiency" in row) == (name != "single")
    ddp = data["results"]["ddp"]  # its step less the all-reduce, timed in the same rounds
    assert 0 <= ddp["communication_share"] <= 1 and ddp["no_sync_s"] > 0
    assert "communication_share" not in data["results"]["fsdp"]
    assert data["noisy"] == [n for n, r in data["results"].items() if r["spread"] > NOISY]
    lines = variants_table(data).splitlines()
    assert [line.split()[0] for line in lines[1:4]] == data["variants"]


def _refusing_wrap(model: GPT, run: LMRun, env: DistEnv) -> tuple[nn.Module, int, int]:
    raise RuntimeError(f"the test's own wrap was asked for {run.parallel}")


def test_measure_variants_wraps_with_the_given_function() -> None:
    # the notebook passes its own cell's parallelize: the ranks must call it, not the package's
    with pytest.raises(WorkerError, match="the test's own wrap was asked for ddp"):
        measure_variants(place(2, "cpu"), TINY, 4, 1, ("single", "ddp"), data_limit=20_000,
                         peak_size=64, wrap=_refusing_wrap)  # fmt: skip


@pytest.mark.parametrize(
    ("variants", "batch", "repeats", "message"),
    [
        (("single", "fsdp_tp"), 4, 2, "do not run on 2 rank(s)"),
        (("ddp",), 4, 2, "'single' is the baseline"),
        (("single", "tp"), 4, 2, "['tp'] do not run"),
        (("single", "ddp", "ddp"), 4, 2, "each at most once"),
        (None, 3, 2, "batch 3 does not split over 2 ranks"),
        (None, 4, 0, "repeats must be at least 1"),
    ],
)
def test_bad_requests_are_refused_before_any_process(
    variants: tuple[str, ...] | None, batch: int, repeats: int, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        measure_variants(place(2, "cpu"), TINY, batch, repeats, variants, timeout=5)
    assert message in str(refused.value)


def _hand_built() -> dict:
    results = {
        "single": {"median_s": 0.5, "spread": 0.1, "tokens_per_s": 256.0, "mfu": 0.0123,
                   "seconds_per_round": [0.45, 0.5, 0.5]},
        "ddp": {"median_s": 0.25, "spread": 0.2, "tokens_per_s": 512.0, "mfu": 0.0125,
                "seconds_per_round": [0.25, 0.2, 0.25], "speedup_text": "2.00x (1.90x to 2.10x)",
                "scaling_efficiency": 1.0, "no_sync_s": 0.2, "communication_share": 0.2},
        "fsdp": {"median_s": 1.0, "spread": 0.75, "tokens_per_s": 128.0, "mfu": 0.003,
                 "seconds_per_round": [0.5, 1.0, 1.25], "scaling_efficiency": 0.25,
                 "speedup_text": "no verdict (0.4x to 0.6x)"},
    }  # fmt: skip
    return {"results": results, "peak": {"dtype": "float32"}, "noisy": ["fsdp"]}


def test_variants_table_lines() -> None:
    assert variants_table(_hand_built()).splitlines() == [
        "variant    ms/step  spread   tokens/s     MFU                vs single efficiency",
        "single       500.0     10%        256   1.23%                 baseline           ",
        "ddp          250.0     20%        512   1.25%   2.00x (1.90x to 2.10x)       100%",
        "fsdp        1000.0     75%        128   0.30% no verdict (0.4x to 0.6x)        25%",
        "ddp without its gradient all-reduce (no_sync, same rounds): 200.0 ms/step",
        "  so the all-reduce that backward does not hide is ~20% of ddp's step",
    ]
    noisy = _hand_built()
    noisy["results"]["ddp"]["communication_meaningful"] = False
    assert variants_table(noisy).splitlines()[-2:] == [
        "  so the all-reduce that backward does not hide is ~20% of ddp's step",
        "  (within the rounds' noise: no verdict)",
    ]
    slower = _hand_built()
    slower["results"]["ddp"]["no_sync_s"] = 0.3  # no faster than ddp's 250 ms
    assert variants_table(slower).splitlines()[-2:] == [
        "  no faster than ddp's step: at this size the all-reduce is too small to show",
        "  against the rounds' noise",
    ]
    for table in (variants_table(noisy), variants_table(slower)):  # the benchmark's 100 columns
        assert max(map(len, table.splitlines())) <= 100
    no_ddp = _hand_built()
    del no_ddp["results"]["ddp"]
    assert len(variants_table(no_ddp).splitlines()) == 3  # the header and two variants


def test_peak_text_names_the_datasheet_where_known() -> None:
    cpu = {"text": "0.1 TFLOP/s (float32 ...)", "datasheet": None, "flops": 1e11}
    assert peak_text(cpu) == "peak (measured): 0.1 TFLOP/s (float32 ...)"
    sheet = {"flops": 989e12, "source": "the datasheet"}
    known = {**cpu, "flops": 600e12, "gpu": "NVIDIA H100", "datasheet": sheet}
    assert peak_text(known).splitlines()[1] == (
        "  datasheet, dense: 989 TFLOP/s (the datasheet); measured = 61% of it"
    )
    unknown = {**cpu, "gpu": "Some GPU"}
    assert peak_text(unknown).splitlines()[1] == (
        "  no datasheet figure known for Some GPU in mgpu_helpers.mfu"
    )


def test_compile_text_says_whether_the_losses_agree() -> None:
    result = {"available": True, "eager_loss": [1.0, 2.0, 3.0], "max_abs_diff": 2e-5,
              "tolerance": 1e-4, "speedup_text": "compiled is 1.5x faster"}  # fmt: skip
    assert compile_text(result) == (
        "torch.compile against eager, 3 steps: losses agree (max |diff| 2.0e-05, tolerance "
        "0.0001)\n  compiled is 1.5x faster"
    )
    assert "losses DISAGREE (max |diff| 2.0e-03" in compile_text({**result, "max_abs_diff": 2e-3})
    skipped = compile_text({"available": False, "why": "no C++ compiler " + "x " * 60})
    assert skipped.startswith("torch.compile: skipped: no C++ compiler")
    assert all(len(line) <= 100 for line in skipped.splitlines()) and "\n  x" in skipped


def test_plot_variants_draws_each_variant_with_its_rounds() -> None:
    data = _hand_built()
    fig = plot_variants(data)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    speed, util = fig.axes
    for ax, key, scale in ((speed, "tokens_per_s", 1), (util, "mfu", 100)):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["single", "ddp", "fsdp"]
        (bars,) = [c for c in ax.containers if isinstance(c, BarContainer)]
        heights = [r[key] * scale for r in data["results"].values()]
        assert [b.get_height() for b in bars] == pytest.approx(heights)
        (whiskers,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        segments = whiskers.lines[2][0].get_segments()
        # fsdp's rounds: 0.5 to 1.25 s around a 1.0 s median: 128 tokens/s x 1.0 / 1.25 .. / 0.5
        (_, low), (_, high) = segments[2]
        assert (low, high) == pytest.approx((heights[2] / 1.25, heights[2] / 0.5))
    assert "NOISY" in fig.get_suptitle() and "fsdp" in fig.get_suptitle()
    calm = plot_variants({**data, "noisy": []})
    assert calm.get_suptitle() == ""


def test_compile_check_without_a_compiler_reports_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor import config

    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on it
    with config.patch({"cpp.cxx": (None, "g++")}):
        result = compile_check(torch.device("cpu"), GPTConfig(), 2, 1, 1)
    assert result == {"available": False, "why": compile_available("cpu")[1], "backend": "inductor"}
    assert "no compiler runs here" in result["why"]


def test_aot_eager_captures_the_training_step_without_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lesson 11's quick mode: the graphs captured, run with eager kernels; no C++ compiler needed,
    and the losses equal eager's within the tolerance."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on it: aot_eager does not need one
    result = compile_check(torch.device("cpu"), TINY, 4, 2, 1, backend="aot_eager")
    assert result["available"] is True and result["backend"] == "aot_eager"
    assert result["max_abs_diff"] <= COMPILE_TOLERANCE["cpu"]
    text = compile_text(result)
    assert text.startswith("torch.compile (aot_eager) against eager, 2 steps: losses agree")
    assert "no speed-up is expected" in text
    with pytest.raises(ValueError, match="backend must be one of"):
        compile_check(torch.device("cpu"), TINY, 4, 2, 1, backend="tvm")


@pytest.mark.slow  # make test-long: inductor compiles the step's C++ (a minute on 2 busy cores)
@pytest.mark.skipif(not compile_available("cpu")[0], reason=compile_available("cpu")[1])
def test_compiled_training_matches_eager_on_the_cpu() -> None:
    result = compile_check(torch.device("cpu"), TINY, 4, 3, 3)
    assert result["available"] is True and len(result["compiled_loss"]) == 3
    # float32: inductor's fused kernels sum in another order, so not bitwise (see the tolerance)
    assert result["max_abs_diff"] <= COMPILE_TOLERANCE["cpu"] == 1e-4
    assert result["eager_loss"][0] == pytest.approx(5.55, abs=0.3)  # about log(256): untrained
    assert result["speedup"] > 0 and len(result["seconds"]["compiled"]) == 3
    assert compile_text(result).startswith("torch.compile against eager, 3 steps: losses agree")
