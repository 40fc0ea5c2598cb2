"""Every benchmark of the course in one go, with the results in one folder (`make benchmark`).

    python benchmarks/run_all.py                         # benchmarks/results/<host>-<date>/
    python benchmarks/run_all.py --quick --out /tmp/b    # a smoke run: the numbers mean little
    python benchmarks/run_all.py --only pipeline allreduce

Each benchmark runs in a process of its own with `--out <folder>/<name>.json`; what it prints is
kept in `<name>.txt`, and a picture of its measurements is drawn from its JSON into `<name>.png`.
At the end `summary.txt` (also printed) and `summary.json` put every headline number next to its
**target** (a limit the course sets for its own code, such as the launcher at most 2x a bare
fork) or its **ideal** (what the hardware would give with no overhead, such as the bubble
formula or the memory-copy ceiling). A target is met or missed; an ideal is only approached, so
its row shows the fraction reached; a number the course sets no target for on this hardware
(the hand-built DDP on GPUs) is reported as it is. A benchmark that fails is reported, and the
others still run. Timings on a busy machine say little: each benchmark warns when its repeats
disagree.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a source checkout without installing

from mgpu_helpers.lm_bench import draw_variant_bars  # noqa: E402
from mgpu_helpers.plots import plot_bandwidth, plot_micro_batch_sweep  # noqa: E402
from mgpu_helpers.util import write_json  # noqa: E402

BENCHMARKS = (
    "loop_overhead", "launch_overhead", "pipeline", "ddp_from_scratch", "allreduce", "sharding",
    "parallelisms", "lm",
)  # fmt: skip


@dataclass(frozen=True)
class Headline:
    """One number a benchmark exists to measure, next to what it is measured against."""

    benchmark: str
    what: str
    measured: float
    reference: float | None  # the target (an upper limit) or the ideal; None for a report
    kind: str  # "target": met when measured <= reference; "ideal": a fraction of it; "report"

    @property
    def met(self) -> bool | None:
        return self.measured <= self.reference if self.kind == "target" else None

    def row(self) -> str:
        if self.kind == "target":
            verdict = "met" if self.met else "NOT met"
            against = f"target <= {self.reference:g}: {verdict}"
        elif self.kind == "ideal":
            against = f"ideal {self.reference:.3g}: {self.measured / self.reference:.0%} of it"
        else:
            against = "reported (no target or tight ideal on this hardware)"
        return f"{self.benchmark:<17} {self.what:<44} {self.measured:9.3g}   {against}"


def _loop_overhead(r: Mapping) -> list[Headline]:
    return [
        Headline(
            "loop_overhead",
            "fit / minimal loop (progress bars on)",
            r["ratio_fit_bar"],
            r["target"],
            "target",
        ),
        Headline(
            "loop_overhead",
            "fit / minimal loop (bars off)",
            r["ratio_fit_no_bar"],
            r["target"],
            "target",
        ),
    ]


def _launch_overhead(r: Mapping) -> list[Headline]:
    return [
        Headline(
            "launch_overhead",
            f"launcher / bare fork, {w}",
            ratios["launcher/fork"],
            r["target"],
            "target",
        )
        for w, ratios in r["ratios"].items()
    ]


def _pipeline(r: Mapping) -> list[Headline]:
    return [
        Headline(
            "pipeline",
            f"{name}: speed-up over the unsplit model",
            ratio,
            r["ideal_ratio_to_unsplit"][name],
            "ideal",
        )
        for name, ratio in r["ratio_to_unsplit"].items()
        if name.startswith("pipe")
    ]


def _bars(title: str, seconds: Mapping[str, Sequence[float]], ylabel: str) -> Figure:
    """Median seconds per variant with a whisker from the fastest to the slowest repeat."""
    names = list(seconds)
    med = [sorted(t)[len(t) // 2] for t in seconds.values()]
    low = [m - min(t) for m, t in zip(med, seconds.values(), strict=True)]
    high = [max(t) - m for m, t in zip(med, seconds.values(), strict=True)]
    fig = Figure(figsize=(max(4.5, 1.5 * len(names) + 2), 3.6))
    ax = fig.subplots()
    ax.bar(names, med, color=[f"C{i}" for i in range(len(names))])
    ax.errorbar(range(len(names)), med, [low, high], fmt="none", ecolor="black", capsize=6)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _plot_loop_overhead(r: Mapping) -> Figure:
    return _bars("training loop: fit against a minimal loop", r["seconds"], "seconds per run")


def _plot_launch_overhead(r: Mapping) -> Figure:
    seconds = {f"{w}\n{v}": t for w, runs in r["seconds"].items() for v, t in runs.items()}
    return _bars("launching ranks: call to return", seconds, "seconds")


def _plot_pipeline(r: Mapping) -> Figure:
    names = [n for n in r["samples_per_sec"] if n.startswith("pipe")]
    speed = r["samples_per_sec"]
    return plot_micro_batch_sweep(
        [int(n.split("=")[1]) for n in names],
        [speed[n] for n in names],
        ideal=[r["ideal_ratio_to_unsplit"][n] * speed["unsplit"] for n in names],
        baseline=speed["unsplit"],
        title=f"pipeline on {', '.join(r['devices'])}",
    )


def _ddp_from_scratch(r: Mapping) -> list[Headline]:
    what = "hand-built DDP / DDP (time per step)"
    if r["target_applies"]:
        return [Headline("ddp_from_scratch", what, r["ratio"], r["target"], "target")]
    return [Headline("ddp_from_scratch", what, r["ratio"], None, "report")]


def _plot_ddp_from_scratch(r: Mapping) -> Figure:
    devices = ", ".join(r["placement"]["devices"])
    title = f"DDP against lesson 06a's hand-built buckets ({devices})"
    return _bars(title, r["seconds_per_timing"], f"seconds per {r['steps']} steps")


def _allreduce(r: Mapping) -> list[Headline]:
    best = max(r["sizes"], key=lambda row: row["busbw_bytes_per_s"])
    what = f"best busbw (GB/s), at {best['bytes'] / 2**20:g} MiB"
    if r["placement"]["backend"] == "nccl":  # a GPU's own memory copy: far above any link
        return [Headline("allreduce", what, best["busbw_bytes_per_s"] / 1e9, None, "report")]
    ceiling = r["ceiling"]["bytes_per_s"] / 1e9
    return [Headline("allreduce", what, best["busbw_bytes_per_s"] / 1e9, ceiling, "ideal")]


def _plot_allreduce(r: Mapping) -> Figure:
    rows = r["sizes"]
    return plot_bandwidth(
        [row["bytes"] for row in rows],
        {
            "busbw": [row["busbw_bytes_per_s"] for row in rows],
            "algbw": [row["algbw_bytes_per_s"] for row in rows],
        },
        ceiling=r["ceiling"]["bytes_per_s"],
        ceiling_label=r["ceiling"]["what"],
        title=f"all-reduce over {r['placement']['world_size']} ranks ({r['placement']['backend']})",
    )


def _sharding(r: Mapping) -> list[Headline]:
    """FSDP2's per-rank model state against DDP's / N (a target at every N > 1); FSDP2's time.

    On one rank FSDP2 holds exactly what DDP holds (ratio 1): that row cannot miss the target,
    so it is reported, not judged.
    """
    rows = [
        Headline(
            "sharding",
            f"FSDP2 state / (DDP's / N), N={n}",
            ratio,
            r["target"] if int(n) > 1 else None,
            "target" if int(n) > 1 else "report",
        )
        for n, ratio in r["fsdp_ratio"].items()
    ]
    rows += [
        Headline("sharding", f"FSDP2 step time / DDP's, N={n}", ratios["FSDP2"], None, "report")
        for n, ratios in r["time_ratio"].items()
        if int(n) > 1
    ]
    return rows


def _plot_sharding(r: Mapping) -> Figure:
    """Model state per rank against N (with DDP / N), and each method's step time / DDP's."""
    sizes = [int(n) for n in r["runs"]]
    fig = Figure(figsize=(11, 4))
    memory, speed = fig.subplots(1, 2)
    for i, name in enumerate(r["methods"]):
        totals = [r["runs"][str(n)]["memory"][name]["total"] / 2**20 for n in sizes]
        memory.plot(sizes, totals, marker="o", color=f"C{i}", label=name)
        ratios = [r["time_ratio"][str(n)][name] for n in sizes]
        low = [
            q - r["time_ratio_range"][str(n)][name][0] for q, n in zip(ratios, sizes, strict=True)
        ]
        high = [
            r["time_ratio_range"][str(n)][name][1] - q for q, n in zip(ratios, sizes, strict=True)
        ]
        width = 0.8 / len(r["methods"])
        where = [k + (i - (len(r["methods"]) - 1) / 2) * width for k in range(len(sizes))]
        speed.bar(where, ratios, width, color=f"C{i}", label=name)
        speed.errorbar(where, ratios, [low, high], fmt="none", ecolor="black", capsize=3)
    ddp = [r["runs"][str(n)]["memory"]["DDP"]["total"] / n / 2**20 for n in sizes]
    memory.plot(sizes, ddp, "k--", label="DDP / N")
    memory.set(
        xscale="log", xticks=sizes, xticklabels=sizes, xlabel="ranks N", ylabel="MiB per rank"
    )
    memory.set_title("parameters + gradients + Adam state, per rank")
    memory.minorticks_off()  # the log axis shows the world sizes only
    memory.legend(fontsize="small")
    speed.axhline(1.0, color="0.5", lw=0.8)
    speed.set(xticks=range(len(sizes)), xticklabels=[f"N={n}" for n in sizes])
    speed.set(ylabel="step time / DDP's", title="step time against DDP (median, range of rounds)")
    speed.legend(fontsize="small")
    fig.tight_layout()
    return fig


def _parallelisms(r: Mapping) -> list[Headline]:
    """Each method's speed-up over one device (the pipelines against their bubble's ideal,
    S M / (M + S - 1)), and the model state per rank of the splits against DDP's.

    No target: on CPU processes that share cores the times measure the waiting (the JSON's
    ``timings_meaningful`` says so); the memory ratios are exact tensor counts.
    """
    res, rows = r["results"], []
    for name in r["methods"]:
        if name == "one device":
            continue
        what = f"{name}: speed-up over one device, N={r['world_size']}"
        if "ideal_speedup" in res[name]:
            rows.append(
                Headline(
                    "parallelisms", what, res[name]["speedup"], res[name]["ideal_speedup"], "ideal"
                )
            )
        else:
            rows.append(Headline("parallelisms", what, res[name]["speedup"], None, "report"))
    ddp = res["DDP"]["memory"]["total"]
    rows += [
        Headline(
            "parallelisms",
            f"{name}: model state per rank / DDP's",
            res[name]["memory"]["total"] / ddp,
            None,
            "report",
        )
        for name in r["methods"]
        if name not in ("one device", "DDP")
    ]
    return rows


def _plot_parallelisms(r: Mapping) -> Figure:
    """Step time (median, range of rounds), model state and bytes sent per rank, per method."""
    res, names = r["results"], r["methods"]
    fig = Figure(figsize=(13, 4))
    speed, memory, traffic = fig.subplots(1, 3)
    med = [res[n]["median_s"] * 1e3 for n in names]
    low = [m - min(res[n]["seconds_per_round"]) * 1e3 for m, n in zip(med, names, strict=True)]
    high = [max(res[n]["seconds_per_round"]) * 1e3 - m for m, n in zip(med, names, strict=True)]
    colors = [f"C{i}" for i in range(len(names))]
    speed.bar(names, med, color=colors)
    speed.errorbar(range(len(names)), med, [low, high], fmt="none", ecolor="black", capsize=4)
    title = "ms per step (median, range)" + ("" if r["timings_meaningful"] else ": NOISY")
    speed.set(title=title, ylabel="ms")
    bottom = [0.0] * len(names)
    for kind, hatch in (("parameters", ""), ("gradients", "//"), ("optimizer", "..")):
        part = [res[n]["memory"][kind] / 2**20 for n in names]
        memory.bar(names, part, bottom=bottom, color=colors, hatch=hatch, edgecolor="white")
        bottom = [b + p for b, p in zip(bottom, part, strict=True)]
    memory.set(title="model state per rank (params, //grads, ..Adam)", ylabel="MiB")
    traffic.bar(names, [res[n]["comm"]["sent_per_rank"] / 2**20 for n in names], color=colors)
    traffic.set(title="sent per rank per step (from shapes)", ylabel="MiB")
    for ax in (speed, memory, traffic):
        ax.tick_params(axis="x", labelrotation=30)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _lm(r: Mapping) -> list[Headline]:
    """Each variant's MFU, the small model's on one device, and where the sweep passes 30%.

    Reports only: on CPUs the course sets no target, and on GPUs 30% is where the sweep's MFU is
    read off, not a limit the code must meet.
    """
    rows = [
        Headline("lm", f"{name}: MFU on {row['devices']} device(s)", row["mfu"], None, "report")
        for name, row in r["results"].items()
    ]
    ddp = r["results"].get("ddp", {})
    if "communication_share" in ddp:
        what = "ddp: exposed all-reduce share of a step (no_sync)"
        rows.append(Headline("lm", what, ddp["communication_share"], None, "report"))
    lesson = [row for row in r["sweep"] if row.get("lesson_model")]
    if lesson:
        what = f"lesson 11's model: MFU on one device ({r['peak']['dtype']})"
        rows.append(Headline("lm", what, lesson[0]["mfu"], None, "report"))
    if r["passes_30"] is not None:
        what = "sweep: first d_model with MFU > 30%"
        rows.append(Headline("lm", what, r["passes_30"]["config"]["d_model"], None, "report"))
    else:
        best = max(r["sweep"], key=lambda row: row["mfu"])
        what = f"sweep: best MFU (d_model {best['config']['d_model']}; none > 30%)"
        rows.append(Headline("lm", what, best["mfu"], None, "report"))
    return rows


def _plot_lm(r: Mapping) -> Figure:
    """Tokens/s per variant (median, range of rounds) and one device's MFU against model size."""
    res = r["results"]
    fig = Figure(figsize=(11, 4))
    speed, sweep = fig.subplots(1, 2)
    draw_variant_bars(speed, r, "tokens_per_s")
    for i, row in enumerate(res.values()):
        speed.annotate(f"MFU {row['mfu']:.1%}", (i, row["tokens_per_s"]), ha="center", va="bottom")
    title = "tokens/s (median, range)" + ("" if r["timings_meaningful"] else ": NOISY")
    speed.set(title=title, ylabel="tokens per second")
    params = [row["parameters"] for row in r["sweep"]]
    sweep.plot(params, [100 * row["mfu"] for row in r["sweep"]], marker="o")
    sweep.axhline(30, color="0.5", lw=0.8, ls="--", label="30%")
    sweep.set(xscale="log", xlabel="matmul weights", ylabel="MFU (%)")
    sweep.set_title(f"one device, {r['peak']['dtype']}: MFU against model size")
    sweep.legend(fontsize="small")
    sweep.grid(alpha=0.3)
    fig.tight_layout()
    return fig


Reader = tuple[Callable[[Mapping], list[Headline]], Callable[[Mapping], Figure]]
READERS: dict[str, Reader] = {
    "loop_overhead": (_loop_overhead, _plot_loop_overhead),
    "launch_overhead": (_launch_overhead, _plot_launch_overhead),
    "pipeline": (_pipeline, _plot_pipeline),
    "ddp_from_scratch": (_ddp_from_scratch, _plot_ddp_from_scratch),
    "allreduce": (_allreduce, _plot_allreduce),
    "sharding": (_sharding, _plot_sharding),
    "parallelisms": (_parallelisms, _plot_parallelisms),
    "lm": (_lm, _plot_lm),
}


def default_folder(now: datetime.date | None = None) -> Path:
    """benchmarks/results/<host>-<YYYY-MM-DD>: one folder per machine and day."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname()) or "host"
    return HERE / "results" / f"{host}-{(now or datetime.date.today()).isoformat()}"


def run_one(name: str, folder: Path, quick: bool, timeout: float) -> tuple[int, float]:
    """Run benchmarks/<name>.py with its JSON going to the folder; its output is kept too."""
    cmd = [sys.executable, str(HERE / f"{name}.py"), "--out", str(folder / f"{name}.json")]
    cmd += ["--quick"] if quick else []
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    with open(folder / f"{name}.txt", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:  # shown as it comes, and kept
            print(line, end="", flush=True)
            log.write(line)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            log.write(f"\n== killed after {timeout:.0f} s\n")
    return rc, time.perf_counter() - start


def summarize(folder: Path, names: Sequence[str]) -> tuple[list[Headline], list[str]]:
    """The headlines of the benchmarks whose JSON is in ``folder``, and pictures of them."""
    headlines, problems = [], []
    for name in names:
        path = folder / f"{name}.json"
        if not path.exists():
            problems.append(f"{name}: no results (see {name}.txt)")
            continue
        result = json.loads(path.read_text())
        headline, plot = READERS[name]
        headlines += headline(result)
        plot(result).savefig(folder / f"{name}.png", dpi=110)
    return headlines, problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default above)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=BENCHMARKS,
        default=None,
        metavar="NAME",
        help=f"some of: {', '.join(BENCHMARKS)}",
    )
    parser.add_argument("--quick", action="store_true", help="smoke runs: the numbers mean little")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per benchmark")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in BENCHMARKS if n in (args.only or BENCHMARKS)]
    folder = args.out or default_folder()
    folder.mkdir(parents=True, exist_ok=True)
    status = {}
    for name in names:
        rc, seconds = run_one(name, folder, args.quick, args.timeout)
        status[name] = {"exit_status": rc, "seconds": round(seconds, 1)}
    headlines, problems = summarize(folder, [n for n in names if status[n]["exit_status"] == 0])
    problems = [
        f"{n}: exited {s['exit_status']}" for n, s in status.items() if s["exit_status"] != 0
    ] + problems
    lines = [f"{'benchmark':<17} {'what':<44} {'measured':>9}   against"]
    lines += [h.row() for h in headlines]
    lines += [f"FAILED {p}" for p in problems]
    if args.quick:
        lines.append("(quick mode: smoke runs, the numbers mean little)")
    summary = "\n".join(lines)
    print(f"\n== summary ({folder})\n{summary}")
    (folder / "summary.txt").write_text(summary + "\n")
    write_json(
        folder / "summary.json",
        {
            "quick": args.quick,
            "runs": status,
            "headlines": [{**asdict(h), "met": h.met} for h in headlines],
            "problems": problems,
        },
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
