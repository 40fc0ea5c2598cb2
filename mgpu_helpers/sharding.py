"""The machinery around lesson 08's sharding: schematics, traces, plots and checkpoint checks.

Lesson 08a writes ZeRO-1 and ZeRO-2 in its cells, 08b shards with FSDP2 and 08c saves sharded
checkpoints. What they only *measure or draw* with lives here: the schematic of what each rank
holds around a collective (:func:`plot_rank_holdings`), one FSDP2 step traced with the profiler
(:func:`trace_fsdp_step`) and drawn (:func:`plot_fsdp_traces`), the bytes each reduce-scatter
sends (:func:`counted_reduce_scatters`), the loss and memory plots, a
nested state-dict comparison (:func:`differing_tensors`), a save that is on the disk when it
returns (:func:`save_fsynced`), and the words of a refused checkpoint load
(:func:`explain_load_failure`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from torch import nn

__all__ = [
    "COLLECTIVES",
    "Event",
    "counted_reduce_scatters",
    "differing_tensors",
    "explain_load_failure",
    "plot_checkpointing",
    "plot_fsdp_traces",
    "plot_loss_agreement",
    "plot_rank_holdings",
    "plot_state_per_rank",
    "save_fsynced",
    "trace_fsdp_step",
]

Event = tuple[str, str, float, float]  # (kind, group, start ms, end ms)
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")
_RANK_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
_SUM = "0.35"  # a slice summed over every rank: dark grey


def _holdings(collective: str, n: int) -> tuple[list[list[str | None]], list[list[str | None]]]:
    """Per rank and slice, before and after: a rank colour, "sum", or None (not held)."""
    mine = [[_RANK_COLOURS[r % len(_RANK_COLOURS)]] * n for r in range(n)]  # a whole local vector
    colour = [_RANK_COLOURS[r % len(_RANK_COLOURS)] for r in range(n)]
    own = [[colour[r] if s == r else None for s in range(n)] for r in range(n)]
    if collective == "all-reduce":
        return mine, [[_SUM] * n for _ in range(n)]
    if collective == "reduce-scatter":
        return mine, [[_SUM if s == r else None for s in range(n)] for r in range(n)]
    if collective == "all-gather":
        return own, [[_RANK_COLOURS[s % len(_RANK_COLOURS)] for s in range(n)] for _ in range(n)]
    raise ValueError(f"collective={collective!r}: choose from {', '.join(COLLECTIVES)}")


def plot_rank_holdings(world_size: int, collectives: Sequence[str] = COLLECTIVES) -> Figure:
    """What each rank holds of a vector cut into N slices, before and after each collective.

    Lesson 08a draws it before it measures ZeRO; 08b before FSDP2. A coloured cell is a slice a
    rank holds (its own numbers in its colour, a sum over all ranks in grey); an empty cell is one
    it does not hold.
    """
    if not isinstance(world_size, int) or not 2 <= world_size <= 8:
        raise ValueError(f"world_size={world_size!r}: draw 2 to 8 ranks")
    fig = Figure(figsize=(9, 1.1 + 0.55 * world_size * len(collectives)))
    axes = fig.subplots(len(collectives), 2, squeeze=False)
    for row, collective in enumerate(collectives):
        pictures = zip(("before", "after"), _holdings(collective, world_size), strict=True)
        for col, (when, cells) in enumerate(pictures):
            ax = axes[row][col]
            for r, slices in enumerate(cells):
                for s, colour in enumerate(slices):
                    filled = colour is not None
                    ax.add_patch(Rectangle((s, world_size - 1 - r), 0.92, 0.8, linewidth=1,
                                           facecolor=colour if filled else "white",
                                           edgecolor="black" if filled else "0.75",
                                           linestyle="-" if filled else ":"))
            ax.set_xlim(-0.1, world_size)
            ax.set_ylim(-0.2, world_size)
            ax.set_yticks([world_size - 1 - r + 0.4 for r in range(world_size)],
                          [f"rank {r}" for r in range(world_size)])
            ax.set_xticks([s + 0.46 for s in range(world_size)],
                          [f"slice {s}" for s in range(world_size)], fontsize="small")
            ax.tick_params(length=0)
            for side in ax.spines.values():
                side.set_visible(False)
            ax.set_title(f"{collective}: {when}", size="medium")
    handles = [Patch(color=_RANK_COLOURS[r % len(_RANK_COLOURS)], label=f"rank {r}'s own numbers")
               for r in range(min(world_size, 3))]
    handles.append(Patch(color=_SUM, label="the sum over all ranks"))
    fig.legend(handles=handles, loc="lower center", ncols=len(handles), fontsize="small")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def trace_fsdp_step(model: nn.Module, blocks: Sequence[nn.Module], x: torch.Tensor,
                    y: torch.Tensor) -> tuple[list[Event], int, list[str]]:
    """One forward and backward of an FSDP2 model under the profiler (lesson 08b).

    Returns FSDP2's ranges as (kind, group, start ms, end ms), with the forward and backward
    passes as kinds too; the bytes of unsharded parameters ``blocks`` hold between the forward and
    the backward pass; and the operations that ran directly inside the first reduce-scatter range.
    """
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile, record_function

    from .memory import tensor_bytes

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("forward"):
            loss = nn.functional.cross_entropy(model(x), y)
        held = tensor_bytes(p for block in blocks for p in block.parameters()
                            if not isinstance(p, DTensor))
        with record_function("backward"):
            loss.backward()
    kinds = {"FSDP::all_gather": "all-gather", "FSDP::post_backward_reduce": "reduce-scatter"}
    events: list[Event] = []
    inside: list[str] = []
    for e in prof.events():
        if not inside and e.name.startswith("FSDP::post_backward_reduce"):
            inside = [child.name for child in e.cpu_children]
        kind, _, group = e.name.partition(" (")  # "FSDP::all_gather (blocks.0)"; the root: no group
        if e.name in ("forward", "backward") or kind in kinds:
            events.append((kinds.get(kind, e.name), group.rstrip(")") or "root",
                           e.time_range.start / 1e3, e.time_range.end / 1e3))
    return events, held, inside


def plot_fsdp_traces(
    traces: Mapping[bool, Sequence[Event]], groups: Sequence[str], title: str
) -> Figure:
    """One panel per ``reshard_after_forward`` setting: a row per group, a bar per collective."""
    colours = {"all-gather": "tab:blue", "reduce-scatter": "tab:orange"}
    fig = Figure(figsize=(10, 5.6))
    axes = fig.subplots(len(traces), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (reshard, events) in zip(axes, traces.items(), strict=True):
        t0 = min(e[2] for e in events)
        for kind, group, start, end in events:
            if kind == "backward":
                ax.axvspan(start - t0, end - t0, color="0.9", zorder=0)
            elif kind in colours:
                ax.barh(list(groups).index(group), end - start, 0.6, start - t0,
                        color=colours[kind], edgecolor="black")
        ax.set_yticks(range(len(groups)), groups)
        ax.invert_yaxis()
        ax.set_title(f"reshard_after_forward={reshard}", size="medium")
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(left=0)
    axes[-1].set_xlabel("time since the step began (ms), rank 0")
    handles = [Patch(color=c, label=k) for k, c in colours.items()]
    handles.append(Patch(color="0.9", label="backward pass"))
    fig.legend(handles=handles, loc="lower center", ncols=3, fontsize="small")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def plot_loss_agreement(losses: Mapping[str, Sequence[float]], reference: str,
                        tolerance: float) -> Figure:
    """Loss per step of each method, and each one's relative gap to ``reference`` (lesson 08b)."""
    if reference not in losses:
        raise ValueError(f"reference={reference!r} is not one of {sorted(losses)}")
    steps = range(1, len(losses[reference]) + 1)
    fig = Figure(figsize=(10, 3.6))
    ax, gap_ax = fig.subplots(1, 2)
    for name, values in losses.items():
        ax.plot(steps, values, marker="o", label=name)
        if name != reference:
            gaps = [abs(v - r) / r for v, r in zip(values, losses[reference], strict=True)]
            gap_ax.plot(steps, [max(g, 1e-12) for g in gaps], marker="o", label=name)
    gap_ax.axhline(tolerance, color="tab:red", ls="--", label=f"tolerance {tolerance:.0%}")
    gap_ax.axhline(2**-8, color="0.5", ls=":", label="one bf16 rounding, 2⁻⁸")
    ax.set(xlabel="step", ylabel="global mean loss", xticks=steps,
           title="loss per step (a new batch each step)")
    gap_ax.set(xlabel="step", ylabel=f"|loss − {reference}'s| / {reference}'s", yscale="log",
               xticks=steps, title=f"against {reference} (1e-12: equal)")
    ax.legend(fontsize="small")
    gap_ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_state_per_rank(sweep: Mapping[int, Mapping[str, int]], ideal: str = "DDP") -> Figure:
    """Model state per rank (MiB) against the number of ranks, with ``ideal``'s / N (lesson 08b)."""
    sizes = sorted(sweep)
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    for name in sweep[sizes[0]]:
        ax.plot(sizes, [sweep[n][name] / 2**20 for n in sizes], marker="o", label=name)
    ax.plot(sizes, [sweep[sizes[0]][ideal] * sizes[0] / n / 2**20 for n in sizes], "k--",
            label=f"{ideal} / N (ideal)")
    ax.set(xscale="log", xlabel="ranks N", ylabel="model state per rank (MiB)",
           title="parameters + gradients + Adam state, per rank")
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_checkpointing(saved: Mapping[str, Sequence[float]], times: Mapping[str, Sequence[object]],
                       batches: Sequence[int]) -> Figure:
    """Activation bytes and step times by batch size, one line per variant (lesson 08b).

    ``times`` holds :class:`mgpu_helpers.timing.Timing` values (``median`` and ``times``).
    """
    fig = Figure(figsize=(10, 3.8))
    ax, time_ax = fig.subplots(1, 2)
    for name, values in saved.items():
        ax.plot(batches, [v / 2**20 for v in values], marker="o", label=name)
        medians = [t.median * 1e3 for t in times[name]]
        spread = [[m - min(t.times) * 1e3 for m, t in zip(medians, times[name], strict=True)],
                  [max(t.times) * 1e3 - m for m, t in zip(medians, times[name], strict=True)]]
        time_ax.errorbar(batches, medians, yerr=spread, marker="o", capsize=3, label=name)
    ax.set(xscale="log", xlabel="batch size", ylabel="activations saved (MiB)",
           title="memory: what autograd keeps")
    time_ax.set(xscale="log", xlabel="batch size", ylabel="forward + backward (ms)",
                title="time: median, bars from fastest to slowest")
    for a in (ax, time_ax):
        a.set_xticks(batches, [str(b) for b in batches])
        a.minorticks_off()
        a.legend(fontsize="small")
    fig.tight_layout()
    return fig


def differing_tensors(a: object, b: object, where: str = "") -> list[str]:
    """The places where two nested state dicts differ, tensors compared bit for bit (lesson 08c)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            only = sorted(map(str, a.keys() ^ b.keys()))[:3]
            return [f"{where or 'the top level'}: keys {only} in one only"]
        return [d for key in a
                for d in differing_tensors(a[key], b[key], f"{where}.{key}".strip("."))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in differing_tensors(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.shape == b.shape and torch.equal(a, b) else [where or "the tensor"]
    return [] if a == b else [where or "the value"]


def save_fsynced(obj: object, path: str | Path) -> None:
    """``torch.save`` that returns once the file is on the disk, as ``dcp.save``'s files are.

    Lesson 08c times the two ways of saving like for like: DCP's writer fsyncs by default.
    """
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def explain_load_failure(dcp_dir: str | Path, cause: BaseException | str, wanted: str,
                         saved: str | None, entries: Sequence[str], fix: str) -> str:
    """The words of a refused load: DCP's cause, then what was saved and what to do (lesson 08c).

    ``wanted`` describes the model being filled, ``saved`` the model the metadata describes (None
    when the entries are not the lesson's model; ``entries`` then shows what they are).
    """
    cause_text = textwrap.fill(str(cause).rstrip(".") + ".", 96, subsequent_indent="  ")
    if saved is None:
        start = textwrap.fill(f"Its entries start: {', '.join(sorted(entries)[:4])}.", 96,
                              subsequent_indent="  ")
        return (f"the checkpoint in {dcp_dir} is not a checkpoint of {wanted}:\n{cause_text}\n"
                f"{start}\n{fix}")
    return (f"the checkpoint in {dcp_dir} does not fit this model:\n{cause_text}\n"
            f"It was saved from {saved};\nthis one is {wanted}.\n{fix}")


_REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")  # older and newer names


@contextlib.contextmanager
def counted_reduce_scatters() -> Iterator[list[tuple[int, torch.dtype]]]:
    """(bytes, dtype) of the input of every single-tensor reduce-scatter this process starts
    inside the block (lesson 08b: what ``reduce_dtype`` changes).

    It wraps ``torch.distributed``'s reduce-scatter under each name it has; FSDP2 looks the
    function up there at every call. The originals are back when the block ends.
    """
    import torch.distributed as dist

    seen: list[tuple[int, torch.dtype]] = []
    originals = {name: getattr(dist, name) for name in _REDUCE_SCATTERS if hasattr(dist, name)}

    def counting(original: Callable) -> Callable:
        @functools.wraps(original)
        def counted(*args: object, **kwargs: object) -> object:
            tensor = kwargs["input"] if "input" in kwargs else args[1]
            assert isinstance(tensor, torch.Tensor)
            seen.append((tensor.numel() * tensor.element_size(), tensor.dtype))
            return original(*args, **kwargs)

        return counted

    try:
        for name, original in originals.items():
            setattr(dist, name, counting(original))
        yield seen
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
