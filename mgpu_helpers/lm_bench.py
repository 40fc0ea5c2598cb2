"""Lesson 11's side-by-side measurement: tokens/s and MFU of one device and each parallelism.

Lesson 11's notebook and ``benchmarks/lm.py`` measure the same thing with the code here, in ONE
launch of N ranks that all build the GPT of :mod:`mgpu_helpers.lm` the way
:mod:`mgpu_helpers.lm_train` does (``parallelize``, ``make_optimizer``):

  single   the unwrapped model on rank 0, the whole batch (the other ranks wait): the baseline
  ddp      DistributedDataParallel, 1/N of the batch per rank
  fsdp     FSDP2 (lesson 08b's apply_fsdp), 1/N of the batch per rank
  fsdp_tp  a (N / 2, 2) mesh: tensor parallelism over 2 ranks, FSDP2 over the rest (N >= 4)

Each timed call is one training step (forward, backward, AdamW); the variants take turns in every
round (``timing.measure_alternating``), and a parallel variant's step ends with a barrier, so it
lasts until its slowest rank is done. The peak that MFU divides by is a large matmul in the
training dtype on rank 0, timed as one more entry of the same rounds, so a busy spell of the
machine falls on the peak and the steps alike. DDP's step inside ``no_sync()`` (no gradient
all-reduce) is timed there too: 1 - its time / DDP's is the share of the step the all-reduce adds.

One line each: :func:`measure_variants` (the launch and the summary), :func:`variants_table` and
:func:`peak_text` (its text), :func:`plot_variants` (its picture), :func:`compile_check` and
:func:`compile_text` (``torch.compile`` against eager on one device).
"""

from __future__ import annotations

import contextlib
import logging
import textwrap
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict

import torch
import torch.distributed as dist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from torch import nn

from .dist_env import DistEnv
from .launch import launch
from .lm import GPT, GPTConfig, get_batch, lm_loss, stdlib_bytes
from .lm_train import LMRun, make_optimizer, parallelize, training_autocast
from .mfu import Peak, compile_available, datasheet_peak, flops_per_token, matmul_work, mfu
from .placement import Placement
from .timing import Timing, compare, measure_alternating

__all__ = [
    "COMPILE_TOLERANCE",
    "NO_SYNC",
    "NOISY",
    "PEAK",
    "VARIANTS",
    "WARMUP",
    "Trainer",
    "Wrap",
    "compile_check",
    "compile_text",
    "draw_variant_bars",
    "measure_variants",
    "one_device_steps",
    "peak_row",
    "peak_text",
    "plot_variants",
    "summarize",
    "variants_for",
    "variants_table",
    "worker",
]

VARIANTS = ("single", "ddp", "fsdp", "fsdp_tp")
NOISY = 0.5  # a spread (max - min) / median of the rounds above this is called noisy
PEAK = "matmul peak"  # the peak's entry in the timed rounds
NO_SYNC = "ddp, no all-reduce"  # DDP's step without its communication, timed alongside
WARMUP = 2  # untimed steps per variant: DDP rebuilds its buckets at the second, FSDP2 sets up

# What wraps the model for a variant: lm_train.parallelize's signature (the model, the run, this
# rank) -> (the wrapped model, this rank's data-parallel index, the data-parallel size)
Wrap = Callable[[GPT, LMRun, DistEnv], tuple[nn.Module, int, int]]

# Eager against compiled losses, step by step from one seed. Inductor fuses the norms, GELU and
# the softmax and sums in another order: float32 on the CPU differs in the last digits (1e-6 on
# a loss of 5.5) and a few AdamW steps grow that; bfloat16 on GPUs keeps 8 bits of mantissa.
COMPILE_TOLERANCE = {"cpu": 1e-4, "cuda": 2e-2}


def variants_for(world_size: int, heads: int) -> tuple[str, ...]:
    """The variants a world size runs: the parallel ones need 2 ranks, fsdp_tp 4 (lesson 11)."""
    if world_size == 1:
        return ("single",)
    fits_tp = world_size >= 4 and world_size % 2 == 0 and heads % 2 == 0
    return VARIANTS if fits_tp else VARIANTS[:-1]


class Trainer:
    """One variant's model, optimizer and batch counter on this rank; ``step()`` trains once.

    Lesson 11: every rank builds the same weights from one seed, and the variant's wrap (none,
    DDP, FSDP2, FSDP2 x TP) cuts them: ``wrap``, default ``lm_train.parallelize``, which the real
    training uses too.
    """

    def __init__(
        self, env: DistEnv, variant: str, cfg: GPTConfig, batch: int, data: torch.Tensor,
        no_sync: bool = False, wrap: Wrap | None = None,
    ):  # fmt: skip
        self.env, self.cfg, self.batch, self.data, self.done = env, cfg, batch, data, 0
        # ddp only: the backward inside DDP's no_sync(), without the gradient all-reduce: the
        # same step less its communication (the gradients then differ: timing only)
        self.no_sync = no_sync
        self.idle = variant == "single" and not env.is_main
        self.together = variant != "single"
        torch.manual_seed(0)  # every rank builds the same weights; the wraps cut them
        model = GPT(cfg).to(env.device)
        if variant == "single":
            self.model, self.dp_rank, self.dp_size = model, 0, 1
        else:
            run = LMRun(model=cfg, batch_size=batch, parallel=variant, tp=2)
            wrap = wrap if wrap is not None else parallelize
            self.model, self.dp_rank, self.dp_size = wrap(model, run, env)
        self.optimizer = make_optimizer(self.model, LMRun(model=cfg))

    def step(self) -> None:
        """One training step on this rank's rows of the next global batch (lesson 11)."""
        if self.idle:
            return
        x, y = get_batch(self.data, self.done, self.batch, self.cfg.seq_len, 0, self.dp_rank,
                         self.dp_size, self.env.device)  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
        # DDP decides in its forward whether the backward all-reduces: both go inside no_sync()
        with self.model.no_sync() if self.no_sync else contextlib.nullcontext():
            with training_autocast(self.env.device):
                loss = lm_loss(self.model(x), y)
            loss.backward()
        self.optimizer.step()
        self.done += 1
        if self.together:
            # the step lasts until the slowest rank is done (NCCL: on this rank's own GPU)
            cuda = self.env.device.type == "cuda"
            dist.barrier(device_ids=[self.env.device.index] if cuda else None)


def worker(
    env: DistEnv, cfg: GPTConfig, batch: int, variants: tuple, sizes: dict, wrap: Wrap | None = None
) -> dict:
    """On every rank: build each variant once, then time one step of each per round (lesson 11).

    ``sizes``: ``repeats`` (rounds), ``data_limit`` (bytes of text read), ``peak_size`` (the
    matmul's n, None: the device's default); ``wrap``: see :class:`Trainer`. Rank 0's matmul peak
    is one more entry of the rounds (the other ranks wait), so a busy spell of the machine falls
    on the peak and the steps alike.
    """
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # as in lesson 09b
    data = stdlib_bytes("train", sizes["data_limit"])
    trainers = {name: Trainer(env, name, cfg, batch, data, wrap=wrap) for name in variants}
    if "ddp" in variants:
        trainers[NO_SYNC] = Trainer(env, "ddp", cfg, batch, data, no_sync=True, wrap=wrap)
    fns = {name: t.step for name, t in trainers.items()}
    as_peak = None
    if env.is_main:
        fns[PEAK], as_peak = matmul_work(env.device, size=sizes["peak_size"])
    else:
        fns[PEAK] = lambda: None
    timings = measure_alternating(fns, env.device, warmup=WARMUP, repeats=sizes["repeats"])
    out = {"times": {name: list(timings[name].times) for name in trainers}}
    if as_peak is not None:
        out["peak"] = peak_row(as_peak(timings[PEAK]))
    return out


def one_device_steps(
    model: nn.Module,
    cfg: GPTConfig,
    batch: int,
    data: torch.Tensor,
    device: torch.device,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """A function that trains ``model`` one step on its next batch, and its losses (lesson 11).

    ``forward`` (default: the model) computes the logits: a ``torch.compile``d model, say.
    """
    optimizer = make_optimizer(model, LMRun(model=cfg))
    forward = forward if forward is not None else model
    losses: list[torch.Tensor] = []

    def step() -> None:
        x, y = get_batch(data, len(losses), batch, cfg.seq_len, device=device)
        with training_autocast(device):
            loss = lm_loss(forward(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    return step, losses


COMPILE_BACKENDS = ("inductor", "aot_eager")  # aot_eager: the graph capture, no code generated


def compile_check(
    device: torch.device, cfg: GPTConfig, batch: int, steps: int, repeats: int,
    backend: str = "inductor",
) -> dict:  # fmt: skip
    """torch.compile against eager on one device: the losses of ``steps`` steps, the speed-up.

    Lesson 11. Both start from the same seed and see the same batches; the compiled model's first
    call compiles (a warm-up call, untimed). Then ``repeats`` rounds of one step each, alternating.
    Where it cannot compile (no C++ compiler for the CPU, say): ``available`` False and ``why``.
    ``backend="aot_eager"`` captures the same graphs (forward and backward) but runs them with
    eager kernels: seconds instead of a minute's C++ build on a CPU (lesson 11's quick mode),
    with eager's speed.
    """
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"backend must be one of {COMPILE_BACKENDS}, got {backend!r}")
    ok, why = True, f"{backend}: no compiler needed"
    if backend == "inductor":
        ok, why = compile_available(device)
    if not ok:
        return {"available": False, "why": why, "backend": backend}
    # inductor's C++ build asks torch.utils.cpp_extension, which logs a warning about CUDA_HOME
    # on a machine without CUDA: irrelevant to a CPU build, and a 180-character line
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    data = stdlib_bytes("train", 200_000)
    runs = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        forward = torch.compile(model, backend=backend) if name == "compiled" else model
        runs[name] = one_device_steps(model, cfg, batch, data, device, forward)
    for _ in range(steps):  # the same steps, the losses compared
        for step, _ in runs.values():
            step()
    eager, compiled = ([float(v) for v in losses] for _, losses in runs.values())
    diff = max(abs(a - b) for a, b in zip(eager, compiled, strict=True))
    timings = measure_alternating({k: step for k, (step, _) in runs.items()}, device, warmup=1,
                                  repeats=repeats, sync_ranks=False)  # fmt: skip
    speedup = compare(timings["compiled"], timings["eager"])
    return {"available": True, "why": why, "backend": backend, "eager_loss": eager,
            "compiled_loss": compiled,
            "max_abs_diff": diff, "tolerance": COMPILE_TOLERANCE[device.type],
            "speedup": speedup.median, "speedup_meaningful": speedup.meaningful,
            "speedup_text": speedup.describe("compiled", "eager"),
            "seconds": {k: list(t.times) for k, t in timings.items()}}  # fmt: skip


def compile_text(result: Mapping) -> str:
    """:func:`compile_check`'s result in words: the losses' verdict and the speed-up (lesson 11)."""
    if not result["available"]:
        return textwrap.fill(
            f"torch.compile: skipped: {result['why']}", 100, subsequent_indent="  "
        )
    agree = "agree" if result["max_abs_diff"] <= result["tolerance"] else "DISAGREE"
    backend = result.get("backend", "inductor")
    speed, name = result["speedup_text"], "torch.compile"
    if backend != "inductor":  # the same kernels as eager: the ratio measures the wrapper only
        speed = f"{speed} ({backend} runs eager's kernels: no speed-up is expected from it)"
        name = f"torch.compile ({backend})"
    return (
        f"{name} against eager, {len(result['eager_loss'])} steps: losses {agree} "
        f"(max |diff| {result['max_abs_diff']:.1e}, tolerance {result['tolerance']:g})\n"
        + textwrap.fill(speed, 100, initial_indent="  ", subsequent_indent="  ")
    )


def peak_row(peak: Peak) -> dict:
    """The measured peak as JSON, with the datasheet's dense figure where the GPU is known.

    Lesson 11: ``flops``, ``spread``, ``dtype``, ``size``, ``threads``, ``text``, ``datasheet``
    (None, or its ``flops`` and ``source``) and, on a GPU, ``gpu`` (its name).
    """
    row = {"flops": peak.median, "spread": peak.spread, "dtype": peak.dtype, "size": peak.size,
           "threads": peak.threads, "text": str(peak), "datasheet": None}  # fmt: skip
    device = torch.device(peak.device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sheet = datasheet_peak(name, getattr(torch, peak.dtype))
        row["gpu"] = name
        if sheet is not None:
            row["datasheet"] = {"flops": sheet.flops[peak.dtype], "source": sheet.source}
    return row


def peak_text(peak: Mapping) -> str:
    """A :func:`peak_row` in words, with the datasheet's figure where it is known (lesson 11)."""
    lines = [f"peak (measured): {peak['text']}"]
    if peak.get("datasheet"):
        sheet = peak["datasheet"]
        lines.append(f"  datasheet, dense: {sheet['flops'] / 1e12:.0f} TFLOP/s ({sheet['source']});"
                     f" measured = {peak['flops'] / sheet['flops']:.0%} of it")  # fmt: skip
    elif peak.get("gpu"):
        lines.append(f"  no datasheet figure known for {peak['gpu']} in mgpu_helpers.mfu")
    return "\n".join(lines)


def summarize(times: dict, variants: tuple, n: int, batch: int, cfg: GPTConfig, peak: dict) -> dict:
    """tokens/s, MFU, speed-up over one device (with the rounds' verdict) per variant (lesson 11).

    ``times``: each variant's seconds per round (and :data:`NO_SYNC`'s, which adds DDP's exposed
    all-reduce share); ``n`` ranks; ``batch`` sequences a step in all; ``peak`` a
    :func:`peak_row` (its ``flops``: one device's).
    """
    tokens = batch * cfg.seq_len
    fpt = flops_per_token(cfg)
    single = Timing(tuple(times["single"]))
    results = {}
    for name in variants:
        timing = Timing(tuple(times[name]))
        devices = 1 if name == "single" else n
        speed = tokens / timing.median
        row = {"seconds_per_round": list(timing.times), "median_s": timing.median,
               "spread": timing.spread, "devices": devices, "tokens_per_s": speed,
               "mfu": mfu(speed, fpt, devices * peak["flops"])}  # fmt: skip
        if name != "single":
            comparison = compare(timing, single)
            row["speedup"] = comparison.median
            row["speedup_meaningful"] = comparison.meaningful
            row["speedup_text"] = comparison.brief()
            row["scaling_efficiency"] = single.median / (devices * timing.median)
        results[name] = row
    if NO_SYNC in times:  # DDP's step less its all-reduce, in the same rounds
        compute = Timing(tuple(times[NO_SYNC]))
        ddp = results["ddp"]
        ddp["no_sync_s"] = compute.median
        ddp["communication_share"] = max(0.0, 1 - compute.median / ddp["median_s"])
        # the rounds agree that the step without its all-reduce is the faster one
        ddp["communication_meaningful"] = compare(compute, Timing(tuple(times["ddp"]))).meaningful
    return results


def _check_request(
    placement: Placement, cfg: GPTConfig, batch: int, repeats: int, variants: tuple[str, ...]
) -> None:
    """ValueError saying what to change, before any process starts."""
    n = placement.world_size
    fits = variants_for(n, cfg.n_heads)
    if "single" not in variants:
        raise ValueError(f"variants {variants}: 'single' is the baseline the others compare to")
    if unknown := [v for v in variants if v not in fits]:
        raise ValueError(
            f"variants {unknown} do not run on {n} rank(s) with {cfg.n_heads} heads; "
            f"choose among {fits} (fsdp_tp needs an even world size >= 4 and an even head count)"
        )
    if len(set(variants)) != len(variants):
        raise ValueError(f"variants {variants}: each at most once")
    if batch < 1 or batch % n:
        raise ValueError(f"batch {batch} does not split over {n} ranks: choose a multiple of {n}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")


def measure_variants(
    placement: Placement,
    cfg: GPTConfig,
    batch: int,
    repeats: int,
    variants: tuple[str, ...] | None = None,
    data_limit: int = 200_000,
    peak_size: int | None = None,
    timeout: float = 300,
    wrap: Wrap | None = None,
) -> dict:
    """Tokens/s and MFU of each variant and the matmul peak, in one launch (lesson 11).

    ``batch``: sequences a step in all (a multiple of the ranks); ``repeats``: timed rounds;
    ``variants``: default all that fit the placement (:func:`variants_for`), "single" among them;
    ``data_limit``: bytes of standard-library text read; ``peak_size``: the matmul's n (None: the
    device's default); ``timeout``: seconds a collective may wait; ``wrap``: what wraps the model
    for a variant (default ``lm_train.parallelize``; a notebook may pass its own cell's).

    Returns ``peak`` (a :func:`peak_row`), ``results`` (:func:`summarize`'s, per variant),
    ``variants``, ``world_size``, ``batch``, ``repeats``, ``config`` (the GPTConfig as a dict),
    ``noisy`` (the variants whose rounds spread by more than :data:`NOISY`) and ``launch_s`` (the
    launch's seconds).
    """
    variants = variants_for(placement.world_size, cfg.n_heads) if variants is None else variants
    variants = tuple(variants)
    _check_request(placement, cfg, batch, repeats, variants)
    sizes = {"repeats": repeats, "data_limit": data_limit, "peak_size": peak_size}
    start = time.perf_counter()
    ranks = launch(worker, placement, cfg, batch, variants, sizes, wrap, echo=False,
                   timeout=timeout)  # fmt: skip
    launch_s = time.perf_counter() - start
    peak = ranks[0]["peak"]
    results = summarize(ranks[0]["times"], variants, placement.world_size, batch, cfg, peak)
    return {"peak": peak, "results": results, "variants": list(variants),
            "world_size": placement.world_size, "batch": batch, "repeats": repeats,
            "config": asdict(cfg), "launch_s": launch_s,
            "noisy": [name for name, row in results.items() if row["spread"] > NOISY]}  # fmt: skip


def variants_table(data: Mapping) -> str:
    """The variants side by side: ms/step, spread, tokens/s, MFU, against single (lesson 11).

    ``data``: :func:`measure_variants`'s result (its ``results``); DDP's exposed all-reduce share
    follows the table when it was measured.
    """
    res = data["results"]
    lines = [f"{'variant':8} {'ms/step':>9} {'spread':>7} {'tokens/s':>10} {'MFU':>7} "
             f"{'vs single':>24} {'efficiency':>10}"]  # fmt: skip
    for name, row in res.items():
        versus = row.get("speedup_text", "baseline")
        eff = f"{row['scaling_efficiency']:.0%}" if "scaling_efficiency" in row else ""
        lines.append(
            f"{name:8} {row['median_s'] * 1e3:9.1f} {row['spread']:7.0%} "
            f"{row['tokens_per_s']:10.0f} {row['mfu']:7.2%} {versus:>24} {eff:>10}"
        )
    if "communication_share" in res.get("ddp", {}):
        ddp = res["ddp"]
        head = (f"ddp without its gradient all-reduce (no_sync, same rounds): "
                f"{ddp['no_sync_s'] * 1e3:.1f} ms/step\n  ")  # fmt: skip
        if ddp["no_sync_s"] >= ddp["median_s"]:  # the share would read 0%: say why instead
            tail = ("no faster than ddp's step: at this size the all-reduce is too small to show"
                    "\n  against the rounds' noise")  # fmt: skip
        else:
            tail = (f"so the all-reduce that backward does not hide is "
                    f"~{ddp['communication_share']:.0%} of ddp's step")  # fmt: skip
            if not ddp.get("communication_meaningful", True):
                tail += "\n  (within the rounds' noise: no verdict)"
        lines.append(head + tail)
    return "\n".join(lines)


def draw_variant_bars(
    ax: Axes, data: Mapping, key: str = "tokens_per_s", scale: float = 1.0
) -> None:
    """Bars of ``results[v][key] * scale`` per variant; whiskers: slowest to fastest round.

    Lesson 11: tokens/s and MFU are both proportional to 1 / seconds, so a round's value is the
    median's times ``median_s`` / that round's seconds.
    """
    res = data["results"]
    names = list(res)
    med = [res[n][key] * scale for n in names]
    rounds = [[m * res[n]["median_s"] / s for s in res[n]["seconds_per_round"]]
              for m, n in zip(med, names, strict=True)]  # fmt: skip
    low = [m - min(r) for m, r in zip(med, rounds, strict=True)]
    high = [max(r) - m for m, r in zip(med, rounds, strict=True)]
    ax.bar(names, med, color=[f"C{i}" for i in range(len(names))])
    ax.errorbar(range(len(names)), med, [low, high], fmt="none", ecolor="black", capsize=4)
    ax.grid(axis="y", alpha=0.3)


def plot_variants(data: Mapping) -> Figure:
    """Tokens/s and MFU per variant, whiskers from the slowest to the fastest round (lesson 11).

    ``data``: :func:`measure_variants`'s result; the titles say NOISY when a variant's rounds
    spread by more than :data:`NOISY`.
    """
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    speed, util = fig.subplots(1, 2)
    draw_variant_bars(speed, data, "tokens_per_s")
    draw_variant_bars(util, data, "mfu", scale=100)
    dtype = data["peak"]["dtype"]
    speed.set(ylabel="tokens per second", title="tokens/s (median, range of rounds)")
    util.set(ylabel="MFU (%)", title=f"MFU against the measured {dtype} peak")
    if data["noisy"]:
        fig.suptitle(f"NOISY: the rounds of {', '.join(data['noisy'])} spread by > {NOISY:.0%}")
    return fig
