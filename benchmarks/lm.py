"""Lesson 11's GPT: tokens per second and MFU, one device against each parallelism (lesson 11)

Every variant trains the same GPT (mgpu_helpers.lm) on the same global batch of standard-library
bytes, built by the same code scripts/train_lm.py runs (mgpu_helpers.lm_train: parallelize,
make_optimizer), in ONE launch of N ranks:

  single   the unwrapped model on rank 0, the whole batch (the others wait): the baseline
  ddp      DistributedDataParallel, 1/N of the batch per rank
  fsdp     FSDP2 (lesson 08b's apply_fsdp), 1/N of the batch per rank
  fsdp_tp  a (N / 2, 2) mesh: tensor parallelism over 2 ranks, FSDP2 over the rest (N >= 4)

Time: one training step (forward, backward, AdamW) per timed call, the variants taking turns in
every round (timing.measure_alternating: the order changes from round to round, the ranks line up
before each call, two untimed warm-up steps each); rank 0's median over the rounds and their
spread. A step of a parallel variant ends with a barrier, so it lasts until the slowest rank is
done. Tokens per second = the global batch's tokens / that median.

MFU = tokens/s x FLOPs per token (mfu.flops_per_token: 6N + 12 L d T) / (the devices used x the
peak of one), the peak MEASURED as a large matmul in the training dtype (mfu.matmul_work;
bfloat16 on GPUs from compute capability 8.0, float16 before, float32 on the CPU) on rank 0 with
the threads each rank has, timed as one more entry of the same rounds, so that a busy spell of
the machine moves both alike (measured apart, a shared CPU gave peaks 3x apart within minutes,
and MFU above 100%); on GPUs the datasheet's dense figure is printed next to it where
mgpu_helpers.mfu knows the GPU. What keeps a parallel variant below one device's MFU:
its scaling efficiency (one device's step time / (N x its own)) is printed, and the remainder is
communication and the wraps' overhead (no pipeline here: no bubble). For DDP the communication
is measured: the same DDP step inside no_sync() (no gradient all-reduce) is timed in the same
rounds, and 1 - its time / DDP's is the share of the step the all-reduce adds: its exposed
part, not what backward hides. Small matmuls show in the sweep: the MFU of one device for
growing models (on GPUs: the size at which it passes 30%).

On GPUs the matmuls run in bfloat16 under torch.autocast (float16 before compute capability 8.0:
a throughput measurement, no loss scaling), on the CPU in float32. No target on CPUs: CPU
processes that share cores measure the waiting, and the report says when the rounds' spread
makes a difference meaningless.

    PYTHONPATH=. python benchmarks/lm.py                  # 4 ranks (CPU), or the GPUs there are
    PYTHONPATH=. python benchmarks/lm.py --device cpu --world-size 2 --repeats 7
    PYTHONPATH=. python benchmarks/lm.py --quick --out /tmp/lm.json
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

# Run from a source checkout without installing: put the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_helpers.devices import describe_hardware, gpu_count, hardware_as_dict  # noqa: E402
from mgpu_helpers.dist_env import DistEnv  # noqa: E402
from mgpu_helpers.launch import launch  # noqa: E402
from mgpu_helpers.lm import GPT, GPTConfig, get_batch, lm_loss, stdlib_bytes  # noqa: E402
from mgpu_helpers.lm_train import (  # noqa: E402
    LMRun,
    make_optimizer,
    parallelize,
    training_autocast,
)
from mgpu_helpers.mfu import (  # noqa: E402
    Peak,
    compile_available,
    datasheet_peak,
    flops_per_token,
    matmul_params,
    matmul_work,
    mfu,
)
from mgpu_helpers.placement import place, usable_cpus  # noqa: E402
from mgpu_helpers.timing import Timing, compare, measure_alternating  # noqa: E402
from mgpu_helpers.util import write_json  # noqa: E402

VARIANTS = ("single", "ddp", "fsdp", "fsdp_tp")
NOISY = 0.5  # a spread (max - min) / median of the rounds above this is called noisy
TARGET_MFU = 0.30  # the sweep says at which size one device's MFU first passes this
PEAK = "matmul peak"  # the peak's entry in the timed rounds
NO_SYNC = "ddp, no all-reduce"  # DDP's step without its communication, timed alongside
WARMUP = 2  # untimed steps per variant: DDP rebuilds its buckets at the second, FSDP2 sets up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: 4 on CPU)")
    parser.add_argument("--d-model", type=int, default=None, help="the variants' model width")
    parser.add_argument("--layers", type=int, default=None, help="the variants' model depth")
    parser.add_argument("--heads", type=int, default=None, help="attention heads")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step, in all")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds")
    parser.add_argument("--quick", action="store_true", help="tiny smoke test: times mean little")
    parser.add_argument(
        "--no-compile", action="store_true", help="skip torch.compile against eager (--quick does)"
    )
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    gpus = gpu_count() if args.device != "cpu" else 0
    if args.device == "cuda" and gpus == 0:
        parser.error("--device cuda: no GPU visible; use --device cpu")
    on_gpu = gpus > 0
    n = args.world_size if args.world_size is not None else (gpus if on_gpu else 4)
    if n < 1 or (on_gpu and n > gpus):
        parser.error(f"--world-size {n}: need 1 to {gpus or 'any number of'} ranks here")
    args.world_size = n
    if args.quick:
        sizes = dict(d_model=32, layers=2, heads=4, seq=32, batch=8, repeats=2)
    elif on_gpu:
        sizes = dict(d_model=1024, layers=8, heads=16, seq=512, batch=32, repeats=5)
    else:
        sizes = dict(d_model=128, layers=4, heads=4, seq=128, batch=8, repeats=5)
    sizes["batch"] = n * -(-sizes["batch"] // n)  # the default rounded up to split over n ranks
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.batch % n:
        parser.error(f"--batch {args.batch} does not split over {n} ranks: choose a multiple")
    args.variants = variants_for(n, args.heads)
    args.placement = place(n, "cuda" if on_gpu else "cpu")
    return args


def variants_for(world_size: int, heads: int) -> tuple[str, ...]:
    """The variants a world size runs: the parallel ones need 2 ranks, fsdp_tp 4 (2 x 2)."""
    if world_size == 1:
        return ("single",)
    fits_tp = world_size >= 4 and world_size % 2 == 0 and heads % 2 == 0
    return VARIANTS if fits_tp else VARIANTS[:-1]


def sweep_configs(on_gpu: bool, quick: bool) -> list[GPTConfig]:
    """The models of the one-device sweep, smallest first; lesson 11's own model among them."""
    if quick:
        return [GPTConfig(seq_len=32, d_model=d, n_layers=2, n_heads=4) for d in (16, 32)]
    if on_gpu:
        grown = [GPTConfig(seq_len=1024, d_model=d, n_layers=8, n_heads=d // 64)
                 for d in (256, 512, 1024, 2048)]  # fmt: skip
        return [GPTConfig(), *grown]
    return [GPTConfig(d_model=64), GPTConfig(), GPTConfig(d_model=256)]


class Trainer:
    """One variant's model, optimizer and batch counter on this rank; ``step()`` trains once."""

    def __init__(
        self, env: DistEnv, variant: str, cfg: GPTConfig, batch: int, data: torch.Tensor,
        no_sync: bool = False,
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
            self.model, self.dp_rank, self.dp_size = parallelize(model, run, env)
        self.optimizer = make_optimizer(self.model, LMRun(model=cfg))

    def step(self) -> None:
        if self.idle:
            return
        x, y = get_batch(self.data, self.done, self.batch, self.cfg.seq_len, 0, self.dp_rank,
                         self.dp_size, self.env.device)  # fmt: skip
        with training_autocast(self.env.device):
            loss = lm_loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        with self.model.no_sync() if self.no_sync else contextlib.nullcontext():
            loss.backward()
        self.optimizer.step()
        self.done += 1
        if self.together:
            # the step lasts until the slowest rank is done (NCCL: on this rank's own GPU)
            cuda = self.env.device.type == "cuda"
            dist.barrier(device_ids=[self.env.device.index] if cuda else None)


def worker(env: DistEnv, cfg: GPTConfig, batch: int, variants: tuple, sizes: dict) -> dict:
    """On every rank: build each variant once, then time one step of each per round.

    Rank 0's matmul peak is one more entry of the rounds (the other ranks wait), so a busy
    spell of the machine falls on the peak and the steps alike.
    """
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # as in lesson 09b
    data = stdlib_bytes("train", sizes["data_limit"])
    trainers = {name: Trainer(env, name, cfg, batch, data) for name in variants}
    if "ddp" in variants:
        trainers[NO_SYNC] = Trainer(env, "ddp", cfg, batch, data, no_sync=True)
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
    """A function that trains ``model`` one step on its next batch, and the list of its losses.

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


def sweep_row(
    device: torch.device,
    cfg: GPTConfig,
    batch: int,
    data: torch.Tensor,
    repeats: int,
    peak_size: int | None,
) -> dict:
    """One model on one device: tokens/s and MFU, its steps taking turns with the matmul peak."""
    torch.manual_seed(0)
    step, _ = one_device_steps(GPT(cfg).to(device), cfg, batch, data, device)
    work, as_peak = matmul_work(device, size=peak_size)
    both = measure_alternating({"step": step, PEAK: work}, device, warmup=WARMUP,
                               repeats=repeats, sync_ranks=False)  # fmt: skip
    timing, peak = both["step"], as_peak(both[PEAK]).median
    speed = batch * cfg.seq_len / timing.median
    return {"config": asdict(cfg), "lesson_model": cfg == GPTConfig(), "peak": peak,
            "parameters": matmul_params(cfg), "flops_per_token": flops_per_token(cfg),
            "tokens_per_s": speed, "seconds": list(timing.times), "spread": timing.spread,
            "mfu": mfu(speed, flops_per_token(cfg), peak)}  # fmt: skip


def sweep(
    device: torch.device, configs: list[GPTConfig], batch: int, repeats: int, peak_size: int | None
) -> tuple[list[dict], str | None]:
    """One device's tokens/s and MFU for each model, smallest first, in the training dtype.

    A model that does not fit in the GPU's memory ends the sweep (the larger ones would not fit
    either); the second value then says where it stopped.
    """
    data = stdlib_bytes("train", 2_000_000)
    rows = []
    for cfg in configs:
        try:
            rows.append(sweep_row(device, cfg, batch, data, repeats, peak_size))
        except torch.OutOfMemoryError:
            return rows, f"d_model {cfg.d_model} x {cfg.n_layers} layers: out of memory, stopped"
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows, None


# Eager against compiled losses, step by step from one seed. Inductor fuses the norms, GELU and
# the softmax and sums in another order: float32 on the CPU differs in the last digits (1e-6 on
# a loss of 5.5) and a few AdamW steps grow that; bfloat16 on GPUs keeps 8 bits of mantissa.
COMPILE_TOLERANCE = {"cpu": 1e-4, "cuda": 2e-2}


def compile_check(
    device: torch.device, cfg: GPTConfig, batch: int, steps: int, repeats: int
) -> dict:
    """torch.compile against eager on one device: the losses of ``steps`` steps, the speed-up.

    Both start from the same seed and see the same batches; the compiled model's first call
    compiles (a warm-up call, untimed). Then ``repeats`` rounds of one step each, alternating.
    """
    ok, why = compile_available(device)
    if not ok:
        return {"available": False, "why": why}
    # inductor's C++ build asks torch.utils.cpp_extension, which logs a warning about CUDA_HOME
    # on a machine without CUDA: irrelevant to a CPU build, and a 180-character line
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    data = stdlib_bytes("train", 200_000)
    runs = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        forward = torch.compile(model) if name == "compiled" else model
        runs[name] = one_device_steps(model, cfg, batch, data, device, forward)
    for _ in range(steps):  # the same steps, the losses compared
        for step, _ in runs.values():
            step()
    eager, compiled = ([float(v) for v in losses] for _, losses in runs.values())
    diff = max(abs(a - b) for a, b in zip(eager, compiled, strict=True))
    timings = measure_alternating({k: step for k, (step, _) in runs.items()}, device, warmup=1,
                                  repeats=repeats, sync_ranks=False)  # fmt: skip
    speedup = compare(timings["compiled"], timings["eager"])
    return {"available": True, "why": why, "eager_loss": eager, "compiled_loss": compiled,
            "max_abs_diff": diff, "tolerance": COMPILE_TOLERANCE[device.type],
            "speedup": speedup.median, "speedup_meaningful": speedup.meaningful,
            "speedup_text": speedup.describe("compiled", "eager"),
            "seconds": {k: list(t.times) for k, t in timings.items()}}  # fmt: skip


def peak_row(peak: Peak) -> dict:
    """The measured peak as JSON, with the datasheet's dense figure where the GPU is known."""
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


def summarize(times: dict, variants: tuple, n: int, batch: int, cfg: GPTConfig, peak: dict) -> dict:
    """tokens/s, MFU, speed-up over one device (with the rounds' verdict) per variant."""
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
    return results


def passes_at(rows: list[dict]) -> dict | None:
    """The first model of the sweep whose MFU passes TARGET_MFU, or None."""
    return next((row for row in rows if row["mfu"] > TARGET_MFU), None)


def _print_report(args: argparse.Namespace, data: dict) -> None:
    peak, res = data["peak"], data["results"]
    print(f"peak (measured): {peak['text']}")
    if peak.get("datasheet"):
        sheet = peak["datasheet"]
        print(f"  datasheet, dense: {sheet['flops'] / 1e12:.0f} TFLOP/s ({sheet['source']});"
              f" measured = {peak['flops'] / sheet['flops']:.0%} of it")  # fmt: skip
    elif peak.get("gpu"):
        print(f"  no datasheet figure known for {peak['gpu']} in mgpu_helpers.mfu")
    print(f"\n{'variant':8} {'ms/step':>9} {'spread':>7} {'tokens/s':>10} {'MFU':>7} "
          f"{'vs single':>24} {'efficiency':>10}")  # fmt: skip
    for name, row in res.items():
        versus = row.get("speedup_text", "baseline")
        eff = f"{row['scaling_efficiency']:.0%}" if "scaling_efficiency" in row else ""
        print(f"{name:8} {row['median_s'] * 1e3:9.1f} {row['spread']:7.0%} "
              f"{row['tokens_per_s']:10.0f} {row['mfu']:7.2%} {versus:>24} {eff:>10}")  # fmt: skip
    if "communication_share" in res.get("ddp", {}):
        ddp = res["ddp"]
        print(
            f"ddp without its gradient all-reduce (no_sync, same rounds): "
            f"{ddp['no_sync_s'] * 1e3:.1f} ms/step\n  so the all-reduce that backward does not "
            f"hide is ~{ddp['communication_share']:.0%} of ddp's step"
        )
    print(
        "MFU divides by the devices a variant uses x one device's peak; efficiency = one device's"
        "\n  step time / (N x the variant's): the rest is communication and the wraps' overhead"
    )
    print("\none device, growing models (small matmuls waste the device):")
    for row in data["sweep"]:
        c = row["config"]
        mark = "  <- lesson 11's model" if row["lesson_model"] else ""
        print(f"  d_model {c['d_model']:5} x {c['n_layers']} layers, seq {c['seq_len']:5}: "
              f"{row['parameters'] / 1e6:8.2f}M matmul weights, {row['tokens_per_s']:10.0f} "
              f"tokens/s, MFU {row['mfu']:6.2%}{mark}")  # fmt: skip
    if data["sweep_stopped"]:
        print(f"  {data['sweep_stopped']}")
    first = data["passes_30"]
    if first is not None:
        print(
            f"MFU passes {TARGET_MFU:.0%} from d_model {first['config']['d_model']} "
            f"({first['parameters'] / 1e6:.1f}M matmul weights)"
        )
    else:
        print(f"MFU stays under {TARGET_MFU:.0%} for every model of the sweep")
    if data["target"] is None:
        print("(CPU: reported without a target; the 30% mark is a GPU figure)")
    _print_compile(data["compile"])
    for warning in data["warnings"]:
        print(textwrap.fill(f"warning: {warning}", width=100, subsequent_indent="  "))


def _print_compile(result: dict | None) -> None:
    if result is None:
        print("torch.compile: not measured (--quick or --no-compile)")
    elif not result["available"]:
        print(
            textwrap.fill(f"torch.compile: skipped: {result['why']}", 100, subsequent_indent="  ")
        )
    else:
        agree = "agree" if result["max_abs_diff"] <= result["tolerance"] else "DISAGREE"
        print(
            f"torch.compile against eager, {len(result['eager_loss'])} steps: losses {agree} "
            f"(max |diff| {result['max_abs_diff']:.1e}, tolerance {result['tolerance']:g})"
        )
        print(
            textwrap.fill(result["speedup_text"], 100, initial_indent="  ", subsequent_indent="  ")
        )


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """This process's torch threads set to ``n`` for a while (the ranks' count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cautions(results: dict, rows: list[dict], noisy: list, crowded: bool, n: int) -> list[str]:
    """What makes the numbers mean less than they seem, one sentence each."""
    found = []
    if noisy:
        found.append(
            f"the rounds of {', '.join(noisy)} spread by more than {NOISY:.0%}: the machine is"
            " busy, and differences between those variants mean little; more --repeats on an"
            " idle one"
        )
    if crowded:
        found.append(
            f"{n} CPU processes on {usable_cpus()} usable core(s): the ranks take turns, so the"
            " parallel variants' times and MFU measure the waiting, not the method"
        )
    vague = [name for name, row in results.items() if row.get("speedup_meaningful") is False]
    if vague:
        found.append(
            f"no verdict on {', '.join(vague)} against single: the rounds disagree on which is"
            " faster (or are too few), so their difference is within the noise"
        )
    over = [name for name, row in results.items() if row["mfu"] > 1]
    over += [f"d_model {row['config']['d_model']}" for row in rows if row["mfu"] > 1]
    if over:
        found.append(
            f"MFU above 100% ({', '.join(over)}): the matmul peak was measured below what this"
            " device reached in the steps (a busier moment, or a size that misses the peak), so"
            " those MFUs are not meaningful here"
        )
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n, placement = args.world_size, args.placement
    on_gpu = placement.device_type == "cuda"
    cfg = GPTConfig(seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads)  # fmt: skip
    sizes = {"repeats": args.repeats, "data_limit": 200_000 if args.quick else 2_000_000,
             "peak_size": 256 if args.quick else None}  # fmt: skip
    print(
        f"lm: lesson 11's GPT, d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads,"
        f" seq {cfg.seq_len}, {args.batch} sequences a step in all\n"
        f"  {matmul_params(cfg) / 1e6:.2f}M matmul weights, {flops_per_token(cfg) / 1e6:.1f} MFLOP"
        f" a token (6N + 12 L d T); torch {torch.__version__}"
    )
    print(f"{placement.describe()}\n  variants {', '.join(args.variants)}; {args.repeats} rounds")
    start = time.perf_counter()
    ranks = launch(worker, placement, cfg, args.batch, args.variants, sizes, echo=False,
                   timeout=300)  # fmt: skip
    print(f"one launch: {time.perf_counter() - start:.1f} s")
    peak = ranks[0]["peak"]
    results = summarize(ranks[0]["times"], args.variants, n, args.batch, cfg, peak)
    device = torch.device(placement.devices[0])
    with _threads(placement.threads_per_rank):  # like for like with the ranks
        rows, stopped = sweep(device, sweep_configs(on_gpu, args.quick), 8 if not on_gpu else 16,
                     3 if args.quick else 5, sizes["peak_size"])  # fmt: skip
        compiled = None
        if not (args.quick or args.no_compile):
            compiled = compile_check(device, cfg, args.batch, 3, args.repeats)
    noisy = [name for name, row in results.items() if row["spread"] > NOISY]
    crowded = not on_gpu and n > usable_cpus()
    data = {
        "benchmark": "lm",
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "hardware": hardware_as_dict(describe_hardware()),
        "placement": asdict(placement),
        "world_size": n,
        "quick": args.quick,
        "config": asdict(cfg),
        "batch": args.batch,
        "repeats": args.repeats,
        "parameters": matmul_params(cfg),
        "flops_per_token": flops_per_token(cfg),
        "variants": list(args.variants),
        "peak": peak,
        "results": results,
        "sweep": rows,
        "passes_30": passes_at(rows),
        "sweep_stopped": stopped,
        "compile": compiled,
        "target": TARGET_MFU if on_gpu else None,
        "noisy": noisy,
        "crowded": crowded,
        "timings_meaningful": not noisy and not crowded,
        "warnings": cautions(results, rows, noisy, crowded, n),
    }
    _print_report(args, data)
    if args.out:
        print(f"results written to {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
