"""Data, tensor, pipeline and 2-D parallelism side by side: step time, traffic, memory (lesson 09)

Lessons 09a and 09b split one model four ways with PyTorch's own APIs. This script runs that
code as the lessons' cells write it (read from the notebooks with
mgpu_helpers.lesson_code.load_lesson_code: 09a's make_model, make_batch, make_mesh, apply_tp;
09b's make_stage, make_pipeline, pipeline_step, apply_2d), on the same model and the same global
batch per step, in ONE launch of N ranks:

  one device  the unsplit model on rank 0 (the others wait): the baseline
  DDP         every rank the whole model, 1/N of the batch; gradients all-reduced
  TP          apply_tp over all N ranks (a 1-D mesh): every rank the whole batch, 1/N of each layer
  GPipe       make_stage: N stages of DEPTH / N layers, M micro-batches, ScheduleGPipe
  1F1B        the same stages with Schedule1F1B
  dp x tp     apply_2d on a (2, N / 2) mesh: FSDP2 over dp, tensor parallel over tp (N >= 4)

Each is printed next to its model:
  communication: bytes each rank sends per step, COMPUTED FROM THE SHAPES (a ring all-reduce
    sends 2 (n - 1) / n of its tensor, an all-gather or reduce-scatter (n - 1) / n; a pipeline
    stage sends each micro-batch's boundary activation forward and its gradient back). The
    all-reduces are COUNTED with CommDebugMode in one step: tensor parallelism's activations,
    and DDP's gradient buckets (its reducer's c10d.allreduce_ goes through the dispatcher, where
    CommDebugMode sees it; measured on gloo, torch 2.14). The pipeline's point-to-point messages
    are not among the collectives CommDebugMode counts, so those are computed only.
  pipelines: the bubble (S - 1) / (M + S - 1) of lesson 05a, and the ideal speed-up over one
    device it leaves, S M / (M + S - 1).
Memory: parameters + gradients + Adam's state each rank holds after a step, counted from the
tensors (a DTensor counts its local shard), the largest over the ranks; on GPUs also the
allocator's peak per method (activations and buffers included).

Time: seconds per step (a barrier before and after each step: the slowest rank's time), the
median of each round's timed steps; the first two steps of each run are not timed (DDP rebuilds
its buckets at the second forward, FSDP2 and the pipeline schedules set themselves up in the
first). The methods take turns in every round, the order rotating; the median and the spread of
the rounds are reported, and a line says when the spread, or more ranks than cores, make the
timings meaningless. No timing target: CPU processes show what the communication costs on this
machine, not GPU speed.

    PYTHONPATH=. python benchmarks/parallelisms.py                    # 4 ranks
    PYTHONPATH=. python benchmarks/parallelisms.py --device cpu --repeats 7
    PYTHONPATH=. python benchmarks/parallelisms.py --quick --out /tmp/parallelisms.json

Ranks: one GPU each (NCCL) when there are at least --world-size GPUs, else CPU processes over
gloo. With 2 or 3 GPUs, --world-size 2 runs on them, without the dp x tp row (it needs 4).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel as DDP

# Run from a source checkout without installing: put the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_helpers.devices import describe_hardware, gpu_count, hardware_as_dict  # noqa: E402
from mgpu_helpers.dist_env import DistEnv  # noqa: E402
from mgpu_helpers.launch import launch  # noqa: E402
from mgpu_helpers.lesson_code import lesson_imports, load_lesson_code  # noqa: E402
from mgpu_helpers.memory import optimizer_state_bytes, tensor_bytes  # noqa: E402
from mgpu_helpers.model_parallel import bubble_fraction  # noqa: E402
from mgpu_helpers.placement import place, usable_cpus  # noqa: E402
from mgpu_helpers.timing import Timing, synchronize  # noqa: E402
from mgpu_helpers.util import write_json  # noqa: E402

METHODS = ("one device", "DDP", "TP", "GPipe", "1F1B", "dp x tp")
PIPELINES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
NOISY = 0.5  # a spread (max - min) / median of the rounds above this is called noisy
UNTIMED = 2  # steps left out of every run's timing: set-up, DDP's bucket rebuild
KINDS = ("parameters", "gradients", "optimizer")

# The lessons' code, run as their cells write it; the namespace holds what that code reads: the
# lessons' imports and their head's names (main() sets the sizes before the launch).
PART_A = (
    "Attention", "FeedForward", "Layer", "Net", "make_model", "make_batch", "make_mesh", "apply_tp",
)  # fmt: skip
PART_B = ("make_stage", "make_pipeline", "pipeline_step", "apply_2d")
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMESPACE = {
    **lesson_imports("09a", NOTEBOOKS),  # the lessons' own imports
    **lesson_imports("09b", NOTEBOOKS),
    # the head's names (main() overrides the sizes)
    "WIDTH": 64, "HEADS": 4, "DEPTH": 4, "SEQ": 16, "BATCH_SIZE": 8, "MICROBATCHES": 4,
    "LR": 1e-3, "SEED": 0, "IN_FEATURES": 16, "CLASSES": 10,
}  # fmt: skip
load_lesson_code("09a", PART_A, NAMESPACE, folder=NOTEBOOKS)
load_lesson_code("09b", PART_B, NAMESPACE, folder=NOTEBOOKS)
lesson = types.SimpleNamespace(**{name: NAMESPACE[name] for name in PART_A + PART_B})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--world-size", type=int, default=4, help="ranks (even; 4+ for dp x tp)")
    parser.add_argument("--width", type=int, default=None, help="model width")
    parser.add_argument("--heads", type=int, default=None, help="attention heads")
    parser.add_argument("--depth", type=int, default=None, help="transformer layers")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=None, help="samples per step, in all")
    parser.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (2 untimed)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds")
    parser.add_argument("--quick", action="store_true", help="tiny smoke test: times mean little")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    n = args.world_size
    gpus = gpu_count() if args.device != "cpu" else 0
    if args.device == "cuda" and gpus < n:
        parser.error(f"--device cuda: {gpus} GPU(s) visible for {n} ranks; use --device cpu")
    if n < 2 or n % 2:
        parser.error(f"--world-size {n}: splitting a model needs an even number of ranks >= 2")
    on_gpu = gpus >= n
    if args.quick:
        sizes = dict(width=32, heads=4, depth=4, seq=8, batch=8, microbatches=4, steps=3, repeats=2)
    elif on_gpu:
        sizes = dict(
            width=1024, heads=16, depth=8, seq=256, batch=32, microbatches=8, steps=6, repeats=5
        )
    else:
        sizes = dict(
            width=128, heads=4, depth=4, seq=32, batch=16, microbatches=4, steps=5, repeats=5
        )
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in sizes:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.steps < UNTIMED + 1:
        parser.error(f"--steps {args.steps}: the first {UNTIMED} are not timed; pass at least 3")
    problems = {
        f"--width {args.width} is not a multiple of --heads {args.heads}": args.width % args.heads,
        f"--heads {args.heads} do not split over {n} tensor-parallel ranks": args.heads % n,
        f"--depth {args.depth} gives fewer layers than the {n} pipeline stages": args.depth < n,
        f"--batch {args.batch} does not split over {n} DDP ranks": args.batch % n,
        f"--batch {args.batch} does not split into {args.microbatches} micro-batches": (
            args.batch % args.microbatches
        ),
        f"1F1B needs --microbatches >= {n} stages (got {args.microbatches})": args.microbatches < n,
    }
    if wrong := [what for what, bad in problems.items() if bad]:
        parser.error("; ".join(wrong) + ": change the sizes")
    args.placement = place(n, "cuda" if on_gpu else "cpu")
    return args


def build(
    env: DistEnv, name: str, sizes: dict, code: object, meshes: dict
) -> tuple[nn.Module, dict]:
    """The method's model on this rank, and what its steps need."""
    model = code.make_model(sizes["width"], sizes["heads"], sizes["depth"]).to(env.device)
    n, batch = env.world_size, sizes["batch"]
    if name == "one device":
        return model, {"shard": 0, "per_rank": batch, "idle": not env.is_main}
    if name == "DDP":
        ids = [env.device.index] if env.device.type == "cuda" else None
        return DDP(model, device_ids=ids), {"shard": env.rank, "per_rank": batch // n}
    if name == "TP":
        return code.apply_tp(model, meshes["TP"]["tp"]), {"shard": 0, "per_rank": batch}
    if name in PIPELINES:
        stage_model = code.make_stage(model, env.rank, n)
        stage, schedule = code.make_pipeline(
            env, stage_model, PIPELINES[name], sizes["microbatches"]
        )
        return stage_model, {"shard": 0, "per_rank": batch, "pipe": (stage, schedule)}
    mesh = meshes["dp x tp"]
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # see lesson 09b, section 2
    model = code.apply_2d(model, mesh)
    return model, {"shard": mesh.get_local_rank("dp"), "per_rank": batch // 2}


def step(model: nn.Module, how: dict, x: torch.Tensor, y: torch.Tensor, code: object) -> None:
    """One forward and backward of this rank's part (no optimizer step)."""
    if "pipe" in how:
        code.pipeline_step(*how["pipe"], x, y)
    elif not how.get("idle"):
        F.cross_entropy(model(x), y).backward()


def run(env: DistEnv, name: str, sizes: dict, code: object, meshes: dict) -> dict:
    """`steps` training steps of one method on this rank: step times, collectives, memory."""
    if env.device.type == "cuda":
        synchronize(env.device)
        torch.cuda.reset_peak_memory_stats(env.device)
        before = torch.cuda.memory_allocated(env.device)
    model, how = build(env, name, sizes, code, meshes)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    seconds, counts, memory = [], {}, {}
    for s in range(sizes["steps"]):
        x, y = (t.to(env.device) for t in code.make_batch(how["shard"], s, how["per_rank"]))
        counter = CommDebugMode()
        synchronize(env.device)  # the batch's copy to the GPU is done before the clock starts
        dist.barrier()  # every rank starts the step together
        start = time.perf_counter()
        if s == 1:  # an untimed step: count what CommDebugMode sees
            with counter:
                step(model, how, x, y, code)
        else:
            step(model, how, x, y, code)
        # TP mixes DTensor and plain parameters; Adam's foreach path (the GPU default) needs
        # the plain ones treated as replicated (lesson 09a, section 2.2)
        with implicit_replication():
            optimizer.step()
        synchronize(env.device)
        dist.barrier()  # the step ends when the slowest rank is done
        seconds.append(time.perf_counter() - start)
        if s == 1:
            for op, k in counter.get_comm_counts().items():
                counts[str(op)] = counts.get(str(op), 0) + k
        if s == sizes["steps"] - 1:  # before the gradients are freed
            params = list(model.parameters())
            memory = {
                "parameters": tensor_bytes(params),
                "gradients": tensor_bytes(p.grad for p in params),
                "optimizer": optimizer_state_bytes(optimizer),
            }
        optimizer.zero_grad(set_to_none=True)
    peak = None
    if env.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(env.device) - before
    local = tensor_bytes(p for p in model.parameters() if isinstance(p, DTensor))  # local shards
    return {
        "seconds": statistics.median(seconds[UNTIMED:]),
        "counts": counts,
        "memory": memory,
        "peak_cuda": peak,
        "dtensor_bytes": local,
    }


def worker(env: DistEnv, sizes: dict, methods: tuple[str, ...], code: object) -> dict:
    """On every rank: each method once per round, the order rotating."""
    out = {name: {"seconds": [], "run_seconds": []} for name in methods}
    n = env.world_size
    # the meshes once (each builds process groups); every round's models are new
    meshes = {"TP": code.make_mesh(env, (n,), ("tp",))}
    if "dp x tp" in methods:
        meshes["dp x tp"] = code.make_mesh(env, (2, n // 2), ("dp", "tp"))
    for r in range(sizes["repeats"]):
        for name in methods[r % len(methods) :] + methods[: r % len(methods)]:
            start = time.perf_counter()
            result = run(env, name, sizes, code, meshes)
            out[name]["run_seconds"].append(time.perf_counter() - start)  # set-up and all steps
            out[name]["seconds"].append(result.pop("seconds"))
            out[name].update(result)  # the same every round
    return out


def communication(name: str, sizes: dict, n: int, n_params: int, rank0: dict) -> dict:
    """Bytes each rank sends per step, from the shapes (the all-reduce count: CommDebugMode)."""
    w, t, b, m = sizes["width"], sizes["seq"], sizes["batch"], sizes["microbatches"]

    def act(samples: int) -> int:  # bytes of one float32 (samples, seq, width) activation
        return samples * t * w * 4

    # functional all_reduce (tensor parallelism) and c10d.allreduce_ (DDP's buckets)
    all_reduces = sum(
        k for op, k in rank0["counts"].items() if "all_reduce" in op or "allreduce" in op
    )
    if name == "one device":
        return {"what": "nothing", "collectives": 0, "bytes_each": 0, "sent_per_rank": 0}
    if name == "DDP":
        grads = n_params * 4
        return {
            "what": "all-reduce of every gradient (in buckets)",
            "collectives": all_reduces or None,  # DDP's buckets; None if CommDebugMode missed them
            "bytes_each": grads,
            "sent_per_rank": 2 * (n - 1) / n * grads,
        }
    if name == "TP":
        return {
            "what": "all-reduce of a (batch, seq, width) activation",
            "collectives": all_reduces,
            "bytes_each": act(b),
            "sent_per_rank": all_reduces * 2 * (n - 1) / n * act(b),
        }
    if name in PIPELINES:
        sends = 2 if n > 2 else 1  # a middle stage sends forward and back; an end stage one way
        return {
            "what": "point to point: a micro-batch's boundary activation, and its gradient back",
            "collectives": sends * m,  # messages a middle rank sends
            "bytes_each": act(b // m),
            "sent_per_rank": sends * m * act(b // m),
        }
    dp, tp = 2, n // 2
    shard = rank0["dtensor_bytes"]  # this rank's shard of the parameters
    return {
        "what": f"tp: all-reduce of (batch/{dp}, seq, width); dp: FSDP2's gathers, reduce-scatter",
        "collectives": all_reduces,
        "bytes_each": act(b // dp),
        "sent_per_rank": all_reduces * 2 * (tp - 1) / tp * act(b // dp) + 3 * (dp - 1) * shard,
    }


def _size(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n = args.world_size
    keys = ("width", "heads", "depth", "seq", "batch", "microbatches", "steps", "repeats")
    sizes = {k: getattr(args, k) for k in keys}
    NAMESPACE.update(SEQ=args.seq)  # make_batch reads SEQ when it runs
    methods = METHODS if n >= 4 else METHODS[:-1]
    n_params = sum(
        p.numel() for p in lesson.make_model(args.width, args.heads, args.depth).parameters()
    )
    print(
        f"parallelisms: the lesson 09a model, {args.depth} layers of width {args.width}, "
        f"{args.heads} heads ({n_params / 1e6:.2f}M parameters),\n  {args.seq} tokens a sample, "
        f"{args.batch} samples a step in all; torch {torch.__version__}"
    )
    print(f"{args.placement.describe()}")
    print(
        f"{args.steps} steps per run (the first {UNTIMED} untimed), {args.repeats} rounds, "
        "the methods' order rotating; medians reported"
    )
    start = time.perf_counter()
    ranks = launch(worker, args.placement, sizes, methods, lesson, echo=False, timeout=180)
    print(f"one launch: {time.perf_counter() - start:.1f} s")

    s, m = n, args.microbatches
    results = {}
    for name in methods:
        timing = Timing(tuple(ranks[0][name]["seconds"]))  # the barriers: every rank's clock agrees
        worst = max((r[name]["memory"] for r in ranks), key=lambda mem: sum(mem.values()))
        peaks = [r[name]["peak_cuda"] for r in ranks]
        results[name] = {
            "seconds_per_round": list(timing.times),
            "run_seconds": ranks[0][name]["run_seconds"],  # each run: set-up and all its steps
            "median_s": timing.median,
            "spread": timing.spread,
            "memory": {**worst, "total": sum(worst.values())},
            "total_per_rank": [sum(r[name]["memory"].values()) for r in ranks],
            "peak_cuda": max(peaks) if all(p is not None for p in peaks) else None,
            "comm_counts": ranks[0][name]["counts"],
            "comm": communication(name, sizes, n, n_params, ranks[0][name]),
        }
        if name in PIPELINES:
            results[name]["bubble"] = bubble_fraction(s, m)
            results[name]["ideal_speedup"] = s * m / (m + s - 1)
    base = results["one device"]["median_s"]
    for res in results.values():
        res["speedup"] = base / res["median_s"]

    head = f"{'ms/step':>9} {'spread':>7} {'speed-up':>9} {'state/rank':>11} {'sent/rank':>10}"
    print(f"\n{'method':11} {head}")
    for name, res in results.items():
        print(
            f"{name:11} {res['median_s'] * 1e3:9.2f} {res['spread']:7.0%} {res['speedup']:9.2f} "
            f"{res['memory']['total'] / 2**20:8.2f} MiB "
            f"{res['comm']['sent_per_rank'] / 2**20:6.2f} MiB"
        )
    print("\nthe model next to each (sent/rank above is computed from it):")
    for name, res in results.items():
        comm, size = res["comm"], _size(res["comm"]["bytes_each"])
        if name == "one device":
            lines = ["the baseline: no communication"]
        elif name == "DDP":
            buckets = comm["collectives"] or "its"
            lines = [f"{buckets} bucket all-reduce(s), {size} of gradients: 2(N-1)/N a rank"]
        elif name in PIPELINES:
            lines = [
                f"bubble (S-1)/(M+S-1) = {res['bubble']:.2f} (S={s}, M={m}): "
                f"ideal speed-up {res['ideal_speedup']:.2f}",
                f"{comm['collectives']} messages of {size} from a middle stage (p2p)",
            ]
        else:
            lines = [f"{comm['collectives']} all-reduces of {size}: 2(n-1)/n of each a rank"]
            if name == "dp x tp":
                lines[0] = lines[0].replace("a rank", "over tp")
                lines.append("+ FSDP2 over dp: 2 all-gathers, 1 reduce-scatter, 3 (dp-1) shards")
        for label, line in zip((name, *[""] * (len(lines) - 1)), lines, strict=True):
            print(f"  {label:11} {line}")
    for name, res in results.items():
        if res["peak_cuda"]:
            print(
                f"{name}: allocator peak a GPU {res['peak_cuda'] / 2**20:.1f} MiB (activations in)"
            )
    print(
        "all-reduce counts: CommDebugMode's, over one step; the pipeline's point-to-point\n"
        "messages are not collectives it counts: those come from the schedule"
    )
    noisy = [name for name, res in results.items() if res["spread"] > NOISY]
    crowded = args.placement.device_type == "cpu" and n > usable_cpus()
    if noisy:
        print(
            f"warning: the rounds of {', '.join(noisy)} spread by more than {NOISY:.0%}:\n"
            "  the machine is busy, and those step times mean little; more --repeats on an idle one"
        )
    if crowded:
        print(
            f"warning: {n} CPU processes on {usable_cpus()} usable core(s): the ranks take turns,\n"
            "  so the step times measure the waiting, not the method; read the bytes and the memory"
        )
    if args.out:
        data = {
            "benchmark": "parallelisms",
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "hardware": hardware_as_dict(describe_hardware()),
            "placement": asdict(args.placement),
            "world_size": n,
            "quick": args.quick,
            **sizes,
            "parameters": n_params,
            "methods": list(methods),
            "results": results,
            "noisy": noisy,
            "crowded": crowded,
            "timings_meaningful": not noisy and not crowded,
        }
        print(f"results written to {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
