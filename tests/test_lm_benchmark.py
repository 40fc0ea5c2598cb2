"""benchmarks/lm.py (lesson 11): tokens/s and MFU per parallelism, and the sweep; run_all reads it.

One quick run on 4 gloo processes (one launch: single, ddp, fsdp, fsdp_tp), then the one-device
sweep. Only what is exact is asserted: the fields, the FLOP formula's numbers, MFU as the
arithmetic of the measured numbers; never a speed. The measurement it shares with lesson 11's
notebook (mgpu_helpers.lm_bench) has its own tests in test_lm_bench.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from benchmark_run import load_benchmark, run_benchmark

from mgpu_helpers.lm import GPTConfig
from mgpu_helpers.mfu import flops_per_token

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


def test_the_sweep_names_the_first_size_past_30_percent() -> None:
    rows = [{"mfu": 0.1, "n": 1}, {"mfu": 0.31, "n": 2}, {"mfu": 0.5, "n": 3}]
    assert benchmark.passes_at(rows)["n"] == 2
    assert benchmark.passes_at(rows[:1]) is None


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
