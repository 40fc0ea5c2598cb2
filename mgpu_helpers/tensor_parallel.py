"""The machinery around lesson 09's tensor parallelism: counts, checks and pictures.

Lesson 09a writes tensor parallelism in its cells (by hand, then with ``parallelize_module``);
09b combines it with FSDP2 on a 2-D mesh. What they only *count, check or draw* with lives here:
readable names for what ``CommDebugMode`` counted (:func:`counted`, :func:`module_counts`,
:func:`comm_table`), torch's log notes caught instead of printed (:func:`caught_log_notes`), the
checks run in the kernel before any rank starts (:func:`check_heads`, :func:`largest_tp`,
:func:`check_whole`, :func:`check_positive`, and 09b's :func:`check_microbatches`), Megatron's f
and g operators drawn (:func:`plot_tp_schematic`), a placement's pieces per rank
(:func:`plot_placements`), the weight splits at one scale (:func:`plot_tp_split`) and a 2-D
mesh's blocks found by value (:func:`locate`, :func:`plot_mesh_blocks`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence

import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

__all__ = [
    "caught_log_notes",
    "check_heads",
    "check_microbatches",
    "check_positive",
    "check_whole",
    "collective_name",
    "comm_table",
    "counted",
    "largest_tp",
    "locate",
    "module_counts",
    "plot_mesh_blocks",
    "plot_placements",
    "plot_tp_schematic",
    "plot_tp_split",
]

_KINDS = (
    ("all_gather", "all-gather"),
    ("allgather", "all-gather"),
    ("reduce_scatter", "reduce-scatter"),
    ("all_reduce", "all-reduce"),
    ("allreduce", "all-reduce"),
    ("alltoall", "all-to-all"),
    ("all_to_all", "all-to-all"),
)


def _colour(rank: int) -> str:
    return f"C{rank % 10}"


def _rank_legend(fig: Figure, n: int, loc: str, alpha: float = 1.0, suffix: str = "") -> None:
    """One coloured square per rank, in a row at ``loc``."""
    fig.legend(
        handles=[Rectangle((0, 0), 1, 1, color=_colour(r), alpha=alpha) for r in range(n)],
        labels=[f"rank {r}{suffix}" for r in range(n)],
        loc=loc,
        ncol=min(n, 8),
        frameon=False,
    )


def collective_name(op: object) -> str:
    """A readable name ("all-reduce") for an operator ``CommDebugMode`` counted (lesson 09a).

    Functional collectives (``all_reduce``) and c10d's (``allreduce_``) get the same name; an
    operator that is no collective keeps its own.
    """
    name = str(op)
    return next((kind for key, kind in _KINDS if key in name), name)


def counted(mode: object) -> dict[str, int]:
    """``{"all-gather": 1, ...}``: what ran inside a ``CommDebugMode``, by readable name (09a)."""
    counts: dict[str, int] = {}
    for op, k in mode.get_comm_counts().items():
        counts[collective_name(op)] = counts.get(collective_name(op), 0) + k
    return counts


def module_counts(mode: object, fqn: str) -> dict[str, dict[str, int]] | None:
    """``{"forward": {...}, "backward": {...}}``: the collectives seen inside module ``fqn`` (09a).

    ``fqn`` is the module's full name as ``CommDebugMode`` keeps it (``"Net.layers.1.attn"``, or
    ``"Global"`` for the whole step). ``comm_module_counts`` is public but not documented: None
    when this torch lacks it or never saw ``fqn``, so a lesson can fall back to the totals.
    """
    per_module = getattr(mode, "comm_module_counts", None)
    if not isinstance(per_module, dict) or fqn not in per_module:
        return None
    found = per_module[fqn]
    return {
        d: {collective_name(op): k for op, k in found.get(d, {}).items()}
        for d in ("forward", "backward")
    }


def comm_table(blocks: Mapping[str, Mapping[str, Mapping[str, int]] | None]) -> list[str]:
    """One line per block: its collectives in forward and in backward (lesson 09a).

    ``blocks`` maps a block's name to :func:`module_counts`' result; a block without counts
    reads "not counted".
    """
    lines = [f"  {'block':10} {'forward':34} {'backward':34}"]
    for name, counts in blocks.items():
        if counts is None:
            lines.append(f"  {name:10} not counted (this torch keeps no per-module counts)")
            continue
        f_, b_ = (
            ", ".join(f"{k} x{c}" for k, c in counts.get(d, {}).items()) or "-"
            for d in ("forward", "backward")
        )
        lines.append(f"  {name:10} {f_:34} {b_}")
    return lines


@contextlib.contextmanager
def caught_log_notes(logger: str, level: int = logging.WARNING) -> Iterator[list[str]]:
    """Keep what ``logger`` logs at ``level`` or above in a list instead of printing it (09a).

    DTensor logs a one-time note when it falls back from an all-to-all on a CPU mesh; a lesson
    prints it once, beside the count it explains. The logger's settings come back afterwards.
    """
    notes: list[str] = []
    log = logging.getLogger(logger)
    catcher = logging.Handler(level)
    catcher.emit = lambda record: notes.append(record.getMessage())  # type: ignore[method-assign]
    propagate = log.propagate
    log.addHandler(catcher)
    log.propagate = False
    try:
        yield notes
    finally:
        log.removeHandler(catcher)
        log.propagate = propagate


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_whole(**values: object) -> None:
    """ValueError naming the first of ``values`` that is not a whole number >= 1 (09a, 09b)."""
    for name, value in values.items():
        if not _whole(value):
            raise ValueError(f"{name}={value!r}: it must be a whole number >= 1")


def check_positive(**values: object) -> None:
    """ValueError naming the first of ``values`` that is not a number > 0 (09a, 09b)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{name}={value!r}: it must be a number > 0")


def _heads_fix(n_heads: int, tp: int, width: int | None, names: tuple[str, str, str | None]) -> str:
    """One change that satisfies every rule of :func:`check_heads` (lesson 09a, 09b)."""
    heads, wide, ranks = names
    fits = [h for h in range(tp, 8 * n_heads + tp, tp) if width is None or width % h == 0]
    if fits:
        h = min(fits, key=lambda c: (abs(c - n_heads), -c))
        tip = f"for example {heads}={h}" + (f" ({wide}={width} fits)" if width is not None else "")
    else:  # no head count fits both: change the width too
        h = tp * -(-n_heads // tp)
        tip = f"for example {heads}={h} and {wide}={h * max(1, (width or h) // h)}"
    others = [d for d in range(2, n_heads + 1) if n_heads % d == 0]
    if ranks is not None and n_heads % tp and others:
        w = None if width is None else n_heads * max(1, width // n_heads)
        tip += f", or {ranks}={others[0]}" + (f" and {wide}={w}" if w != width else "")
    return tip


def check_heads(
    n_heads: int,
    tp: int,
    n_kv_heads: int | None = None,
    width: int | None = None,
    names: tuple[str, str, str | None] = ("n_heads", "width", "tp"),
) -> None:
    """Refuse head counts that tensor parallelism over ``tp`` ranks cannot split (09a, 09b).

    Each rank computes whole heads: ``n_heads`` (and ``n_kv_heads``, grouped-query attention's
    key and value heads) must be multiples of ``tp``, ``n_heads`` a multiple of ``n_kv_heads``,
    and ``width`` (if given) a multiple of ``n_heads``. Runs in the kernel, before any rank
    starts, so the message comes at once instead of a shape error on every rank. ``names``: the
    parameters a lesson sets for the heads, the width and the ranks (None: a size it cannot
    change); the message names every broken rule at once and one change that mends them all.
    """
    check_whole(n_heads=n_heads, tp=tp)
    problems = []
    if width is not None:
        check_whole(width=width)
        if width % n_heads:
            problems.append(
                f"{names[1]}={width} is not a multiple of {names[0]}={n_heads}: "
                "every head needs width // heads features"
            )
    if n_heads % tp:
        source = f" ({names[2]})" if names[2] is not None else ""
        problems.append(
            f"{n_heads} heads do not split over {tp} tensor-parallel ranks{source}: each rank "
            "computes whole heads"
        )
    if problems:
        raise ValueError(";\n".join(problems) + ";\n" + _heads_fix(n_heads, tp, width, names))
    if n_kv_heads is not None:
        check_whole(n_kv_heads=n_kv_heads)
        if n_heads % n_kv_heads:
            raise ValueError(
                f"{n_heads} heads do not share {n_kv_heads} key/value heads evenly: "
                "n_heads must be a multiple of n_kv_heads"
            )
        if n_kv_heads % tp:
            fits = [d for d in range(1, n_kv_heads + 1) if n_kv_heads % d == 0]
            raise ValueError(
                f"{n_kv_heads} key/value heads do not split over {tp} tensor-parallel ranks: each "
                f"rank computes whole heads;\nchoose a tensor-parallel size that divides "
                f"{n_kv_heads} ({', '.join(map(str, fits))}) or a multiple of {tp} key/value heads"
            )


def check_microbatches(microbatches: int, batch_size: int, n_stages: int) -> None:
    """Refuse a pipeline step that ``Schedule1F1B`` cannot run, one rule per message (09b).

    1F1B starts with one micro-batch in flight per stage, so ``microbatches`` must be at least
    ``n_stages``; the schedule cuts the batch into equal micro-batches, so ``batch_size`` must
    be a multiple of ``microbatches``. Names the lesson's parameters (MICROBATCHES, BATCH_SIZE).
    """
    check_whole(MICROBATCHES=microbatches, BATCH_SIZE=batch_size, n_stages=n_stages)
    if microbatches < n_stages:
        raise ValueError(
            f"MICROBATCHES={microbatches}: Schedule1F1B needs at least one micro-batch per "
            f"stage; choose MICROBATCHES >= {n_stages} (the stages)"
        )
    if batch_size % microbatches:
        fits = [m for m in range(n_stages, batch_size + 1) if batch_size % m == 0]
        tip = f" or MICROBATCHES in {fits}" if fits else ""
        raise ValueError(
            f"BATCH_SIZE={batch_size} does not cut into {microbatches} equal micro-batches: "
            f"choose a BATCH_SIZE that is a multiple of {microbatches}{tip}"
        )


def largest_tp(n_heads: int, n_ranks: int, n_kv_heads: int | None = None) -> int:
    """The most ranks, at most ``n_ranks``, that split the heads into whole heads (09a)."""
    check_whole(n_heads=n_heads, n_ranks=n_ranks)
    kv = n_heads if n_kv_heads is None else n_kv_heads
    return max(d for d in range(1, n_ranks + 1) if n_heads % d == 0 and kv % d == 0)


def plot_placements(local: Sequence[Mapping[str, torch.Tensor]], title: str) -> Figure:
    """A panel per placement: the 4 x 8 ``arange`` matrix, each element in its holders' colours
    (lesson 09a).

    ``local[r]`` maps a placement's name to rank r's ``to_local()`` piece of
    ``torch.arange(32.).reshape(4, 8)``; the holders of an element are found by its value.
    """
    if not local:
        raise ValueError("no ranks to draw: pass each rank's local pieces")
    n = len(local)
    fig = Figure(figsize=(10, 2.6))
    axes = fig.subplots(1, len(local[0]), squeeze=False)[0]
    for ax, name in zip(axes, local[0], strict=True):
        holders: dict[int, list[int]] = {}
        for rank, pieces in enumerate(local):
            for v in pieces[name].flatten().tolist():
                holders.setdefault(int(v), []).append(rank)
        for v in range(32):
            row, col, ranks = v // 8, v % 8, holders.get(v, [])
            for i, r in enumerate(ranks):  # one stripe per rank holding the element
                ax.add_patch(
                    Rectangle((col + i / len(ranks), row), 1 / len(ranks), 1, color=_colour(r))
                )
            ax.text(col + 0.5, row + 0.5, str(v), ha="center", va="center", size=8)
        ax.set(xlim=(0, 8), ylim=(4, 0), aspect="equal", xticks=[], yticks=[], title=name)
    _rank_legend(fig, n, "lower center")
    fig.suptitle(title)
    fig.subplots_adjust(bottom=0.2)
    return fig


def plot_tp_split(n: int, width: int, hidden: int | None = None) -> Figure:
    """Which rank holds which block of each split weight W (out x in), all at one scale (09a).

    Column-parallel layers (q, k, v, up) are cut into bands of rows (output features),
    row-parallel ones (out, down) into bands of columns (input features). Every panel uses the
    same units per feature, so ``down`` (width x 4 width) is as wide as ``up`` is tall.
    """
    check_whole(n=n, width=width)
    hidden = 4 * width if hidden is None else hidden
    shapes = {
        "attn.q / k / v": (width, width, 0),
        "attn.out": (width, width, 1),
        "ff.up": (hidden, width, 0),
        "ff.down": (width, hidden, 1),
    }
    tallest = max(rows for rows, _, _ in shapes.values())
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, len(shapes), width_ratios=[cols for _, cols, _ in shapes.values()])
    for ax, (name, (rows, cols, dim)) in zip(axes, shapes.items(), strict=True):
        for r in range(n):
            if dim == 0:  # ColwiseParallel: Shard(0) of W, a band of output features
                ax.add_patch(Rectangle((0, r * rows / n), cols, rows / n, color=_colour(r)))
            else:  # RowwiseParallel: Shard(1) of W, a band of input features
                ax.add_patch(Rectangle((r * cols / n, 0), cols / n, rows, color=_colour(r)))
        ax.add_patch(Rectangle((0, 0), cols, rows, fill=False, edgecolor="black"))
        ax.set(
            xlim=(0, cols), ylim=(tallest, 0), aspect="equal", xticks=[0, cols], yticks=[0, rows]
        )
        ax.set_title(
            f"{name}\n{'Colwise' if dim == 0 else 'Rowwise'}, W {rows} x {cols}", size="small"
        )
        ax.tick_params(labelsize="x-small")
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
    axes[0].set_ylabel("out_features (rows of W)", size="small")
    fig.supxlabel("in_features (columns of W)", size="small")
    _rank_legend(fig, n, "upper right")
    return fig


_SCHEMATIC = {  # row title -> boxes: (label, kind); kind: "whole", "split" (per rank) or "comm"
    "MLP, tensor parallel": [
        ("x (whole)", "whole"),
        ("f\nfwd: copy\nbwd: all-reduce", "comm"),
        ("up\ncolumn-parallel", "split"),
        ("gelu", "split"),
        ("down\nrow-parallel", "split"),
        ("g\nfwd: all-reduce\nbwd: copy", "comm"),
        ("y (whole)", "whole"),
    ],
    "attention, tensor parallel": [
        ("norm(x) (whole)", "whole"),
        ("f\nfwd: copy\nbwd: all-reduce", "comm"),
        ("q, k, v\nheads/N each", "split"),
        ("attention\nper head", "split"),
        ("out\nrow-parallel", "split"),
        ("g\nfwd: all-reduce\nbwd: copy", "comm"),
        ("y (whole)", "whole"),
    ],
    "MLP, sequence parallel": [
        ("norm on\ns/N tokens", "split"),
        ("all-gather\n(bwd: reduce-\nscatter)", "comm"),
        ("up\ncolumn-parallel", "split"),
        ("gelu", "split"),
        ("down\nrow-parallel", "split"),
        ("reduce-scatter\n(bwd: all-\ngather)", "comm"),
        ("y on\ns/N tokens", "split"),
    ],
}


def plot_tp_schematic(n: int = 2) -> Figure:
    """Where Megatron's f and g operators sit in an MLP and an attention block, and what
    sequence parallelism puts in their place (lesson 09a, drawn before the counts are measured).

    A split box is drawn as ``n`` stacked bands, one per rank; a grey box is a collective (or
    its conjugate, f: copy forward, all-reduce backward; g: the reverse).
    """
    if not isinstance(n, int) or not 2 <= n <= 8:
        raise ValueError(f"n={n!r}: draw 2 to 8 ranks")
    fig = Figure(figsize=(12, 1.6 * len(_SCHEMATIC) + 0.6))
    axes = fig.subplots(len(_SCHEMATIC), 1, squeeze=False)[:, 0]
    for ax, (title, boxes) in zip(axes, _SCHEMATIC.items(), strict=True):
        for i, (label, kind) in enumerate(boxes):
            x = i * 1.5
            if kind == "split":
                for r in range(n):
                    ax.add_patch(Rectangle((x, r / n), 1.2, 1 / n, color=_colour(r), alpha=0.35))
            face = {"whole": "white", "split": "none", "comm": "0.8"}[kind]
            ax.add_patch(
                FancyBboxPatch(
                    (x, 0), 1.2, 1, boxstyle="round,pad=0.02", facecolor=face, edgecolor="black"
                )
            )
            ax.text(x + 0.6, 0.5, label, ha="center", va="center", size="x-small")
            if i:
                ax.annotate("", (x - 0.02, 0.5), (x - 0.28, 0.5), arrowprops={"arrowstyle": "->"})
        ax.set(xlim=(-0.1, 1.5 * len(boxes)), ylim=(-0.1, 1.1))
        ax.set_title(title, size="small", loc="left")
        ax.axis("off")
    _rank_legend(fig, n, "lower center", alpha=0.35, suffix="'s part")
    fig.subplots_adjust(hspace=0.5, bottom=0.12)
    return fig


def locate(full: torch.Tensor, local: torch.Tensor) -> tuple[list[int], int]:
    """The rows of ``full`` that ``local`` holds and its first column, found by value (09b).

    ``local`` must be a block of whole rows' pieces starting at a multiple of its own width;
    RuntimeError if it is not in ``full``.
    """
    if full.dim() != 2 or local.dim() != 2 or local.shape[1] > full.shape[1]:
        raise ValueError(
            f"shapes {tuple(full.shape)} and {tuple(local.shape)}: pass two matrices, "
            "the block no wider than the full one"
        )
    width = local.shape[1]
    for col in range(0, full.shape[1] - width + 1, width):
        hits = [
            (full[:, col : col + width] == row).all(dim=1).nonzero().flatten().tolist()
            for row in local
        ]
        if all(len(h) == 1 for h in hits):
            return [h[0] for h in hits], col
    raise RuntimeError("this rank's block is not in the full matrix")


def plot_mesh_blocks(
    full: Mapping[str, torch.Tensor],
    blocks: Sequence[Mapping[str, torch.Tensor]],
    coords: Sequence[tuple[int, int]],
) -> Figure:
    """Which rank of a 2-D mesh holds which block of each matrix, found by value (09b).

    ``full[name]`` is a whole matrix, ``blocks[r][name]`` rank r's local block of it and
    ``coords[r]`` its (dp, tp) coordinates. Every panel at one scale, each framed around its
    matrix only (the axes' own frame hidden); AssertionError if a block
    is not contiguous rows or some element is held by no rank.
    """
    names = list(full)
    widths = [full[name].shape[1] for name in names]
    tallest = max(full[name].shape[0] for name in names)
    fig = Figure(figsize=(10, 4.4))
    axes = fig.subplots(1, len(names), width_ratios=widths, squeeze=False)[0]
    for ax, name in zip(axes, names, strict=True):
        matrix = full[name]
        owner = torch.full(matrix.shape, -1)
        for rank, block in enumerate(b[name] for b in blocks):
            rows, col = locate(matrix, block)
            assert rows == list(range(rows[0], rows[0] + len(rows))), (
                f"{name}: rank {rank}'s rows are not contiguous"
            )
            owner[rows[0] : rows[-1] + 1, col : col + block.shape[1]] = rank
            ax.add_patch(Rectangle((col, rows[0]), block.shape[1], len(rows), color=_colour(rank)))
            dp, tp = coords[rank]
            ax.text(
                col + block.shape[1] / 2,
                rows[0] + len(rows) / 2,
                f"rank {rank}\ndp {dp}, tp {tp}",
                ha="center",
                va="center",
                color="white",
                size="x-small",
            )
        assert (owner >= 0).all(), f"{name}: some elements are held by no rank"
        rows, cols = matrix.shape  # the frame: the matrix only, the axes below it left blank
        ax.add_patch(Rectangle((0, 0), cols, rows, fill=False, edgecolor="black"))
        ax.set(
            xlim=(0, cols),
            ylim=(tallest, 0),
            aspect="equal",
            title=f"{name}\n{tuple(matrix.shape)}",
            xticks=[0, cols],
            yticks=[0, rows],
        )
        ax.xaxis.tick_top()  # beside the matrix, not under the blank below a short one
        ax.title.set_size("small")
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
    axes[0].set_ylabel("row (output feature)")
    fig.supxlabel("column (input feature)", size="small")
    fig.tight_layout()
    return fig
