"""benchmarks/lm.py (lesson 11): tokens/s and MFU per parallelism, and the sweep; run_all reads it.

One quick run on 4 gloo processes (one launch: single, ddp, fsdp, fsdp_tp), then the one-device
sweep. Only what is exact is asserted: the fields, the FLOP formula's numbers, MFU as the
arithmetic of the measured numbers; never a speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from benchmark_run import load_benchmark, run_benchmark

from mgpu_helpers.lm import GPTConfig
from mgpu_helpers.mfu import compile_available, flops_per_token

benchmark = load_benchmark("lm")
run_all = load_benchmark("run_all")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("lm") / "lm.json"
    args = ("--quick", "--device", "cpu", "--world-size", "4", "--out", str(out))
    done = run_benchmark("lm", *args, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


@pytest.mark.slow  # make test-long: one launch of 4 ranks, ~50 s on the busy 2-core machine
def test_quick_run_reports_every_variant_with_its_mfu(result: tuple[str, dict]) -> None:
    text, data = result
    assert data["benchmark"] == "lm" and data["quick"] is True and data["world_size"] == 4
    assert data["variants"] == ["single", "ddp", "fsdp", "fsdp_tp"]
    assert data["placement"]["backend"] == "gloo" and data["target"] is None  # CPU: no target
    cfg = GPTConfig(**data["config"])
    assert data["flops_per_token"] == flops_per_token(cfg)
    peak = data["peak"]
    assert peak["dtype"] == "float32" and peak["flops"] > 0 and peak["datasheet"] is None
    assert peak["threads"] == data["placement"]["threads_per_rank"]  # like for like
    tokens = data["batch"] * cfg.seq_len
    for name in data["variants"]:
        row = data["results"][name]
        assert len(row["seconds_per_round"]) == data["repeats"]
        assert row["tokens_per_s"] == pytest.approx(tokens / row["median_s"])
        devices = 1 if name == "single" else 4
        assert row["devices"] == devices
        expected = row["tokens_per_s"] * data["flops_per_token"] / (devices * peak["flops"])
        assert row["mfu"] == pytest.approx(expected)
        assert name in text
    ddp = data["results"]["ddp"]  # its step less the all-reduce, timed in the same rounds
    assert 0 <= ddp["communication_share"] <= 1 and ddp["no_sync_s"] > 0
    assert "ddp without its gradient all-reduce" in text
    for name in ("ddp", "fsdp", "fsdp_tp"):
        assert {"speedup", "speedup_meaningful", "scaling_efficiency"} <= set(data["results"][name])
    assert [row["config"]["d_model"] for row in data["sweep"]] == [16, 32]
    assert all(row["mfu"] > 0 for row in data["sweep"])
    assert "peak (measured):" in text
    assert "MFU stays under 30%" in text or "MFU passes 30%" in text
    assert ("warning: 4 CPU processes" in text) == data["crowded"]
    long = [x for x in text.splitlines() if len(x) > 100 and not x.startswith("results written")]
    assert not long, f"lines of at most 100 characters: {long}"


@pytest.mark.slow  # make test-long
def test_run_all_reads_it_and_draws_it(result: tuple[str, dict], tmp_path: Path) -> None:
    _, data = result
    rows = {h.what: h for h in run_all._lm(data)}
    assert rows["fsdp_tp: MFU on 4 device(s)"].measured == data["results"]["fsdp_tp"]["mfu"]
    share = rows["ddp: exposed all-reduce share of a step (no_sync)"].measured
    assert share == data["results"]["ddp"]["communication_share"]
    assert all(h.kind == "report" and h.met is None for h in rows.values())
    assert any(what.startswith("sweep:") for what in rows)
    run_all._plot_lm(data).savefig(tmp_path / "lm.png", dpi=50)
    assert (tmp_path / "lm.png").stat().st_size > 1000
    assert "lm" in run_all.BENCHMARKS and "lm" in run_all.READERS


def test_variants_follow_the_world_size() -> None:
    assert benchmark.variants_for(1, 4) == ("single",)
    assert benchmark.variants_for(2, 4) == ("single", "ddp", "fsdp")
    assert benchmark.variants_for(4, 4) == ("single", "ddp", "fsdp", "fsdp_tp")
    assert benchmark.variants_for(4, 3) == ("single", "ddp", "fsdp")  # 3 heads: no 2-way TP


def test_the_sweep_names_the_first_size_past_30_percent() -> None:
    rows = [{"mfu": 0.1, "n": 1}, {"mfu": 0.31, "n": 2}, {"mfu": 0.5, "n": 3}]
    assert benchmark.passes_at(rows)["n"] == 2
    assert benchmark.passes_at(rows[:1]) is None


def test_summary_arithmetic_on_given_times() -> None:
    cfg = GPTConfig(seq_len=16, d_model=32, n_layers=2)
    times = {"single": [0.4, 0.5, 0.6, 0.5, 0.5], "ddp": [0.2, 0.25, 0.3, 0.25, 0.25]}
    res = benchmark.summarize(times, ("single", "ddp"), 2, 8, cfg, {"flops": 1e9})
    assert res["single"]["tokens_per_s"] == pytest.approx(8 * 16 / 0.5)
    assert res["single"]["mfu"] == pytest.approx(8 * 16 / 0.5 * flops_per_token(cfg) / 1e9)
    assert res["ddp"]["mfu"] == pytest.approx(8 * 16 / 0.25 * flops_per_token(cfg) / 2e9)
    assert res["ddp"]["speedup"] == pytest.approx(2.0) and res["ddp"]["speedup_meaningful"]
    assert res["ddp"]["scaling_efficiency"] == pytest.approx(1.0)
    times[benchmark.NO_SYNC] = [0.15, 0.2, 0.2, 0.2, 0.1]  # DDP's step without its all-reduce
    res = benchmark.summarize(times, ("single", "ddp"), 2, 8, cfg, {"flops": 1e9})
    assert res["ddp"]["communication_share"] == pytest.approx(1 - 0.2 / 0.25)
    assert benchmark.NO_SYNC not in res  # a measurement of ddp's, not a variant


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    refused = (
        (["--batch", "6"], "does not split over 4 ranks"),
        (["--heads", "3"], "not a multiple of --heads 3"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--world-size", "0"], "--world-size 0"),
    )
    for args, message in refused:
        with pytest.raises(SystemExit) as stopped:
            benchmark.parse_args(["--quick", "--device", "cpu", *args])
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_compile_check_without_a_compiler_reports_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor import config

    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on it
    with config.patch({"cpp.cxx": (None, "g++")}):
        result = benchmark.compile_check(torch.device("cpu"), GPTConfig(), 2, 1, 1)
    assert result == {"available": False, "why": compile_available("cpu")[1]}
    assert "no compiler runs here" in result["why"]


@pytest.mark.slow  # make test-long: inductor compiles the step's C++ (a minute on 2 busy cores)
@pytest.mark.skipif(not compile_available("cpu")[0], reason=compile_available("cpu")[1])
def test_compiled_training_matches_eager_on_the_cpu() -> None:
    cfg = GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=4)
    result = benchmark.compile_check(torch.device("cpu"), cfg, 4, 3, 3)
    assert result["available"] is True and len(result["compiled_loss"]) == 3
    # float32: inductor's fused kernels sum in another order, so not bitwise (see the tolerance)
    assert result["max_abs_diff"] <= benchmark.COMPILE_TOLERANCE["cpu"] == 1e-4
    assert result["eager_loss"][0] == pytest.approx(5.55, abs=0.3)  # about log(256): untrained
    assert result["speedup"] > 0 and len(result["seconds"]["compiled"]) == 3


@pytest.mark.gpu
@pytest.mark.slow  # make test-long
def test_quick_run_on_one_gpu_measures_in_bf16(tmp_path: Path) -> None:
    out = tmp_path / "lm.json"
    done = run_benchmark(
        "lm", "--quick", "--device", "cuda", "--world-size", "1", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["variants"] == ["single"] and data["placement"]["device_type"] == "cuda"
    major, _ = torch.cuda.get_device_capability(0)
    assert data["peak"]["dtype"] == ("bfloat16" if major >= 8 else "float16")
    assert data["target"] == 0.3 and data["peak"]["gpu"] == torch.cuda.get_device_name(0)
