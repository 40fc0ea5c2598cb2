"""Lesson 11's GPT: tokens per second and MFU, one device against each parallelism (lesson 11)

Every variant trains the same GPT (mgpu_helpers.lm) on the same global batch of standard-library
bytes, built by the same code scripts/train_lm.py runs (mgpu_helpers.lm_train: parallelize,
make_optimizer), in ONE launch of N ranks. The measurement lives in mgpu_helpers.lm_bench
(measure_variants, variants_table, compile_check), shared with lesson 11's notebook; this
script adds the one-device sweep, the cautions and the JSON:

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
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

# Run from a source checkout without installing: put the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_helpers.devices import describe_hardware, gpu_count, hardware_as_dict  # noqa: E402
from mgpu_helpers.lm import GPT, GPTConfig, stdlib_bytes  # noqa: E402
from mgpu_helpers.lm_bench import (  # noqa: E402
    NOISY,
    PEAK,
    WARMUP,
    compile_check,
    compile_text,
    measure_variants,
    one_device_steps,
    peak_text,
    variants_for,
    variants_table,
)
from mgpu_helpers.mfu import flops_per_token, matmul_params, matmul_work, mfu  # noqa: E402
from mgpu_helpers.placement import place, usable_cpus  # noqa: E402
from mgpu_helpers.timing import measure_alternating  # noqa: E402
from mgpu_helpers.util import write_json  # noqa: E402

TARGET_MFU = 0.30  # the sweep says at which size one device's MFU first passes this


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


def sweep_configs(on_gpu: bool, quick: bool) -> list[GPTConfig]:
    """The models of the one-device sweep, smallest first; lesson 11's own model among them."""
    if quick:
        return [GPTConfig(seq_len=32, d_model=d, n_layers=2, n_heads=4) for d in (16, 32)]
    if on_gpu:
        grown = [GPTConfig(seq_len=1024, d_model=d, n_layers=8, n_heads=d // 64)
                 for d in (256, 512, 1024, 2048)]  # fmt: skip
        return [GPTConfig(), *grown]
    return [GPTConfig(d_model=64), GPTConfig(), GPTConfig(d_model=256)]


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


def passes_at(rows: list[dict]) -> dict | None:
    """The first model of the sweep whose MFU passes TARGET_MFU, or None."""
    return next((row for row in rows if row["mfu"] > TARGET_MFU), None)


def _print_report(args: argparse.Namespace, data: dict) -> None:
    print(peak_text(data["peak"]))
    print(f"\n{variants_table(data)}")
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
    else:
        print(compile_text(result))


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
    peak_size = 256 if args.quick else None
    print(
        f"lm: lesson 11's GPT, d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads,"
        f" seq {cfg.seq_len}, {args.batch} sequences a step in all\n"
        f"  {matmul_params(cfg) / 1e6:.2f}M matmul weights, {flops_per_token(cfg) / 1e6:.1f} MFLOP"
        f" a token (6N + 12 L d T); torch {torch.__version__}"
    )
    print(f"{placement.describe()}\n  variants {', '.join(args.variants)}; {args.repeats} rounds")
    measured = measure_variants(placement, cfg, args.batch, args.repeats, args.variants,
                                200_000 if args.quick else 2_000_000, peak_size)  # fmt: skip
    print(f"one launch: {measured['launch_s']:.1f} s")
    peak, results, noisy = measured["peak"], measured["results"], measured["noisy"]
    device = torch.device(placement.devices[0])
    with _threads(placement.threads_per_rank):  # like for like with the ranks
        rows, stopped = sweep(device, sweep_configs(on_gpu, args.quick), 8 if not on_gpu else 16,
                     3 if args.quick else 5, peak_size)  # fmt: skip
        compiled = None
        if not (args.quick or args.no_compile):
            compiled = compile_check(device, cfg, args.batch, 3, args.repeats)
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
