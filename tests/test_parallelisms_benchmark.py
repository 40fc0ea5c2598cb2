"""benchmarks/parallelisms.py runs lesson 09a and 09b's code and writes its JSON; run_all reads it.

One quick run on 4 gloo processes (one launch): data, tensor, pipeline (GPipe, 1F1B) and 2-D
parallelism side by side. Only what is exact is asserted (tensor byte counts, the bubble
formula, the collectives CommDebugMode counts, the fields); no timing (speed belongs in the
benchmark, not in the tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_run import ROOT, load_benchmark, run_benchmark

from mgpu_helpers.devices import gpu_count

run_all = load_benchmark("run_all")
DEPTH = 4  # --quick's


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("parallelisms") / "parallelisms.json"
    # one round (--quick has 2): the rounds' rotation costs a second launch's worth of time here
    args = ("--quick", "--device", "cpu", "--repeats", "1", "--out", str(out))
    done = run_benchmark("parallelisms", *args, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


@pytest.mark.slow  # make test-long
def test_quick_run_reports_every_method_next_to_its_model(result: tuple[str, dict]) -> None:
    text, data = result
    assert data["benchmark"] == "parallelisms" and data["quick"] is True
    assert data["world_size"] == 4 and data["placement"]["backend"] == "gloo"
    assert data["methods"] == ["one device", "DDP", "TP", "GPipe", "1F1B", "dp x tp"]
    assert {"torch", "python", "cpu_count", "gpus"} <= set(data["hardware"])
    res = data["results"]
    for name in data["methods"]:
        assert len(res[name]["seconds_per_round"]) == data["repeats"] == 1
        assert res[name]["median_s"] > 0 and res[name]["spread"] >= 0
        memory = res[name]["memory"]
        assert memory["total"] == sum(memory[k] for k in ("parameters", "gradients", "optimizer"))
        assert len(res[name]["total_per_rank"]) == 4
        assert {"what", "collectives", "bytes_each", "sent_per_rank"} <= set(res[name]["comm"])
        assert name in text
    # exact counts: DDP and one device hold fp32 Adam's 16 bytes per parameter
    assert res["DDP"]["memory"]["total"] == res["one device"]["memory"]["total"]
    assert res["DDP"]["memory"]["total"] == 16 * data["parameters"]
    for name in ("TP", "GPipe", "1F1B", "dp x tp"):  # about a quarter of DDP's on 4 ranks
        assert 0.2 < res[name]["memory"]["total"] / res["DDP"]["memory"]["total"] < 0.35, name
    # tensor parallelism: 4 all-reduces per layer (2 forward, 2 backward: q, k, v share their
    # input through PrepareModuleOutput, lesson 09a), as CommDebugMode counted
    assert res["TP"]["comm"]["collectives"] == res["dp x tp"]["comm"]["collectives"] == 4 * DEPTH
    act = data["batch"] * data["seq"] * data["width"] * 4
    assert res["TP"]["comm"]["bytes_each"] == act
    assert res["dp x tp"]["comm"]["bytes_each"] == act / 2
    assert res["DDP"]["comm"]["sent_per_rank"] == pytest.approx(2 * 3 / 4 * 4 * data["parameters"])
    # DDP's reducer all-reduces its buckets through the dispatcher: CommDebugMode counts them
    # (the quick model's 0.2 MiB of gradients make one bucket)
    assert res["DDP"]["comm"]["collectives"] == 1
    long = [x for x in text.splitlines() if len(x) > 100 and not x.startswith("results written")]
    assert not long, f"lines of at most 100 characters: {long}"
    assert ("warning: 4 CPU processes" in text) == data["crowded"]


@pytest.mark.slow  # make test-long
def test_pipeline_rows_carry_the_bubble_model(result: tuple[str, dict]) -> None:
    text, data = result
    s, m = data["world_size"], data["microbatches"]
    for name in ("GPipe", "1F1B"):
        row = data["results"][name]
        assert row["bubble"] == pytest.approx((s - 1) / (m + s - 1))
        assert row["ideal_speedup"] == pytest.approx(s * m / (m + s - 1))
        assert row["comm"]["bytes_each"] == data["batch"] // m * data["seq"] * data["width"] * 4
    line = next(x for x in text.splitlines() if x.startswith("  GPipe"))  # its model's line
    assert f"bubble (S-1)/(M+S-1) = {(s - 1) / (m + s - 1):.2f}" in line


@pytest.mark.slow  # make test-long
def test_run_all_reads_it_and_draws_it(result: tuple[str, dict], tmp_path: Path) -> None:
    _, data = result
    rows = {h.what: h for h in run_all._parallelisms(data)}
    gpipe = rows["GPipe: speed-up over one device, N=4"]
    assert gpipe.kind == "ideal" and gpipe.reference == data["results"]["GPipe"]["ideal_speedup"]
    assert rows["TP: speed-up over one device, N=4"].kind == "report"
    assert rows["dp x tp: model state per rank / DDP's"].measured < 0.35
    assert all(h.met is None for h in rows.values())  # no target: reports and ideals only
    run_all._plot_parallelisms(data).savefig(tmp_path / "p.png", dpi=50)
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert "parallelisms" in run_all.BENCHMARKS and "parallelisms" in run_all.READERS


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark("parallelisms")
    refused = (
        (["--steps", "2"], "at least 3"),
        (["--world-size", "3"], "even number of ranks"),
        (["--heads", "6", "--width", "36"], "do not split over 4 tensor-parallel ranks"),
        (["--depth", "2"], "fewer layers than the 4 pipeline stages"),
        (["--microbatches", "2"], "1F1B needs --microbatches >= 4"),
    )
    for args, message in refused:
        with pytest.raises(SystemExit) as stopped:
            benchmark.parse_args(["--quick", "--device", "cpu", *args])
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_benchmark_runs_lesson_09s_own_code() -> None:
    benchmark = load_benchmark("parallelisms")
    parts = {"09a_tensor_parallel": ("apply_tp", "make_model"),
             "09b_pipeline_and_2d_mesh": ("make_stage", "pipeline_step", "apply_2d")}  # fmt: skip
    for stem, names in parts.items():
        notebook = str(ROOT / "notebooks" / f"{stem}.ipynb")
        for name in names:
            assert getattr(benchmark.lesson, name).__code__.co_filename.startswith(notebook), name
    assert getattr(benchmark, "apply_tp", None) is None  # no copy of its own


@pytest.mark.multigpu
@pytest.mark.skipif(gpu_count() < 4, reason="the benchmark's 4 ranks on GPUs need 4 of them")
def test_quick_run_on_four_gpus_measures_the_allocator(tmp_path: Path) -> None:
    out = tmp_path / "parallelisms.json"
    args = ("--quick", "--device", "cuda", "--out", str(out))
    done = run_benchmark("parallelisms", *args, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["placement"]["backend"] == "nccl" and data["crowded"] is False
    res = data["results"]
    assert all(res[name]["peak_cuda"] for name in data["methods"])
    # a quarter of the model state per GPU, as on the CPU: exact tensor counts
    for name in ("TP", "GPipe", "1F1B", "dp x tp"):
        assert res[name]["memory"]["total"] < 0.35 * res["DDP"]["memory"]["total"], name
