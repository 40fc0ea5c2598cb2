"""How much does the course's training loop cost over a bare PyTorch loop? (target: <= 3%)

`mgpu_helpers.train.fit` adds progress bars and per-epoch loss/accuracy/throughput to the few lines
every training loop has. This script trains the same model on the same data and device three
ways, in one process, taking turns (minimal, fit with bars, fit without bars, minimal, ...):

  minimal   the textbook loop: to(device), forward, cross_entropy, zero_grad, backward, step
  fit+bar   mgpu_helpers.train.fit as learners call it, progress bars on
  fit       mgpu_helpers.train.fit with progress=False

Every run starts from the same seed, so all three do the same arithmetic on the same batches
(the script checks that the final weights agree). Each run is timed with the device
synchronised at both ends; the table shows the median over the repeats, and the ratio
fit / minimal is the loop's overhead. Training only: no evaluation pass in any of them.

Where the overhead shows: a small model on a GPU, whose steps are bound by kernel launches, so
every extra operation per step counts. On a CPU the default (small CNN, batch 64) is bound by
arithmetic and hides the loop's cost; `--model mlp --batch-size 8` imitates the launch-bound
case there.

    PYTHONPATH=. python benchmarks/loop_overhead.py               # best device here
    PYTHONPATH=. python benchmarks/loop_overhead.py --device cpu --repeats 9
    PYTHONPATH=. python benchmarks/loop_overhead.py --out benchmarks/results/h200.json

The exit code is 0 whether or not the target is met; the output says which. The target is
judged on the ratio of the medians (progress bars on); the median of the per-round ratios is
printed beside it, since it is less sensitive to a machine whose load changes during the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# Run from a source checkout without installing: put the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu_helpers.config import LessonConfig  # noqa: E402
from mgpu_helpers.data import build_datasets, make_loader  # noqa: E402
from mgpu_helpers.models import build_model  # noqa: E402
from mgpu_helpers.timing import synchronize  # noqa: E402
from mgpu_helpers.train import fit, pick_device, seed_everything  # noqa: E402
from mgpu_helpers.util import write_json  # noqa: E402

TARGET = 1.03  # fit may take at most 3% longer than the minimal loop
VARIANTS = ("minimal", "fit+bar", "fit")


def minimal_loop(
    model: nn.Module,
    loader: torch.utils.data.DataLoader,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    epochs: int,
) -> None:
    """The loop with nothing added: no metrics, no progress bar."""
    model.train()
    for _ in range(epochs):
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def one_run(variant: str, cfg: LessonConfig, train_set, info, device: torch.device) -> tuple:
    """Build everything from the seed, train once; return (seconds, final parameters)."""
    seed_everything(cfg.seed)
    model = build_model(cfg.model, info).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    loader = make_loader(train_set, cfg.batch_size, device, shuffle=True, seed=cfg.seed)
    # The bars are drawn in full, but into /dev/null, so that they do not scroll the table away.
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        synchronize(device)
        start = time.perf_counter()
        if variant == "minimal":
            minimal_loop(model, loader, optimizer, device, cfg.epochs)
        else:
            fit(model, loader, None, optimizer, device, cfg.epochs, progress=variant == "fit+bar")
        synchronize(device)
        seconds = time.perf_counter() - start
    params = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    return seconds, params


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda:0 (default: best here)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each variant")
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs per run (default: 3 on a CPU, 20 on a GPU)"
    )
    parser.add_argument("--dataset", default="digits", help="digits (default) or synthetic")
    parser.add_argument("--model", default="cnn", help="cnn (default), mlp or resnet")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: 1 on the CPU device, torch's choice otherwise)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke test: numbers mean little")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if any(n is not None and n < 1 for n in (args.repeats, args.epochs, args.threads)):
        parser.error("--repeats, --epochs and --threads must be at least 1")
    if args.quick:
        args.repeats, args.epochs = min(args.repeats, 2), 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device) if args.device else pick_device()
    # One intra-op thread on the CPU unless asked otherwise: this measures the loop, not the
    # CPU's parallelism, and on a busy machine idle OpenMP threads spin against other work,
    # which made the repeats differ by 2x.
    if args.epochs is None:  # a digits epoch takes milliseconds on a GPU: time longer runs
        args.epochs = 3 if device.type == "cpu" else 20
    threads = args.threads
    if threads is None and device.type == "cpu":
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    cfg = LessonConfig(
        dataset=args.dataset,
        model=args.model,
        batch_size=args.batch_size,
        epochs=args.epochs,
        quick=False,  # the script sizes itself; MGPU_QUICK must not change the workload
        train_samples=256 if args.quick else None,
    )
    train_set, _, info = build_datasets(cfg)
    # Fixed-order GPU convolutions, so that all variants end with the same weights (both sides
    # pay the same; no effect on the CPU).
    torch.backends.cudnn.deterministic = True
    print(
        f"loop overhead: {cfg.model} on {cfg.dataset} ({len(train_set)} samples), batch "
        f"{cfg.batch_size}, {cfg.epochs} epoch(s) per run, {args.repeats} repeats, device {device}"
    )
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, "
        f"CPU threads: {torch.get_num_threads()}"
    )

    one_run("minimal", cfg, train_set, info, device)  # warm-up: allocator, kernels, caches
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    final: dict[str, list[torch.Tensor]] = {}
    for r in range(args.repeats):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]  # no variant always goes first
        for variant in order:
            seconds, final[variant] = one_run(variant, cfg, train_set, info, device)
            times[variant].append(seconds)

    # Same seed, same batches, same arithmetic: the final weights must agree, or the
    # comparison is unfair (this caught a progress bar that reshuffled the data).
    differ = [
        v
        for v in VARIANTS[1:]
        if not all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-6)
            for a, b in zip(final["minimal"], final[v], strict=True)
        )
    ]

    samples = len(train_set) * cfg.epochs
    med = {v: statistics.median(t) for v, t in times.items()}
    print(f"\n{'variant':<9} {'median s':>9} {'min s':>8} {'max s':>8} ", end="")
    print(f"{'samples/s':>10} {'ratio':>6}")
    for v in VARIANTS:
        ratio = med[v] / med["minimal"]
        print(
            f"{v:<9} {med[v]:9.4f} {min(times[v]):8.4f} {max(times[v]):8.4f} "
            f"{samples / med[v]:10,.0f} {ratio:6.3f}"
        )
    ratio_bar = med["fit+bar"] / med["minimal"]
    ratio_plain = med["fit"] / med["minimal"]
    met = ratio_bar <= TARGET
    # Each round's fit time over the same round's minimal time: slow drifts in the machine's
    # load cancel out of these, so they back up (or question) the ratio of the medians.
    paired = {
        v: statistics.median(f / m for f, m in zip(times[v], times["minimal"], strict=True))
        for v in VARIANTS[1:]
    }
    print(f"\nratio fit/minimal = {ratio_bar:.3f} (progress bars on), {ratio_plain:.3f} (off)")
    print(
        f"median of per-round ratios: {paired['fit+bar']:.3f} (bars on), {paired['fit']:.3f} (off)"
    )
    print(f"target <= {TARGET}: {'met' if met else 'NOT met'}")
    if differ:
        print(
            f"warning: {', '.join(differ)} ended with other weights than minimal: not the same work"
        )
    noisy = [v for v in VARIANTS if max(times[v]) > 1.25 * min(times[v])]
    if noisy:
        print(
            f"warning: the repeats of {', '.join(noisy)} differ by more than 25%; the machine "
            "was busy (other processes?), so rerun with more --repeats when it is idle"
        )

    if args.out:
        result = {
            "benchmark": "loop_overhead",
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_threads": torch.get_num_threads(),
            "dataset": cfg.dataset,
            "model": cfg.model,
            "batch_size": cfg.batch_size,
            "epochs": cfg.epochs,
            "train_samples": len(train_set),
            "repeats": args.repeats,
            "quick": args.quick,
            "seconds": times,
            "median_seconds": med,
            "ratio_fit_bar": ratio_bar,
            "ratio_fit_no_bar": ratio_plain,
            "paired_ratio_fit_bar": paired["fit+bar"],
            "paired_ratio_fit_no_bar": paired["fit"],
            "target": TARGET,
            "target_met": met,
            "noisy": noisy,
            "same_final_weights": not differ,
        }
        print(f"results written to {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
