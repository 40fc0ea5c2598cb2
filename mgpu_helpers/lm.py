"""A small byte-level GPT and its data, for lesson 11 (the capstone).

The text is the Python standard library's own source, read as bytes: every machine with Python
has it, so nothing is downloaded and the vocabulary is the 256 byte values (no tokenizer). The
model is a GPT-style decoder (pre-norm blocks, causal attention, a GELU MLP, tied input and
output embeddings) with no dropout, so two runs with the same seeds are bit for bit the same.

Batches are a function of ``(seed, step)`` alone and each rank takes its contiguous slice of the
rows, so any number of ranks together see the one-device batch: that is what lets the lesson
compare DDP, FSDP2 and tensor parallelism with one device step by step, and resume exactly.
"""

from __future__ import annotations

import functools
import math
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "GPT",
    "SPLITS",
    "VAL_PERCENT",
    "Attention",
    "Block",
    "GPTConfig",
    "MLP",
    "evaluate",
    "generate",
    "get_batch",
    "lm_loss",
    "split_of",
    "stdlib_bytes",
    "stdlib_files",
]

SPLITS = ("train", "val")
VAL_PERCENT = 10  # share of the files, in percent, that go to validation


def split_of(relative_path: str) -> str:
    """The split a file belongs to (lesson 11): a CRC-32 of its relative path, ~10% to "val".

    CRC-32 rather than ``hash()``: Python salts ``hash()`` per process, so two ranks (or two
    runs) would disagree on the split.
    """
    return "val" if zlib.crc32(relative_path.encode()) % 100 < VAL_PERCENT else "train"


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[tuple[str, Path], ...]:
    """Every standard-library ``.py`` file as (relative POSIX path, path), sorted (lesson 11).

    The root is ``sysconfig.get_paths()["stdlib"]``; anything under ``site-packages`` is left
    out, so installed packages never change the text.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts or not path.is_file():
            continue
        found.append((rel.as_posix(), path))
    return tuple(sorted(found))


def stdlib_bytes(split: str, limit: int | None = None) -> Tensor:
    """The standard library's ``.py`` files of one split, joined as a uint8 tensor (lesson 11).

    Files come in sorted relative-path order and each goes wholly to "train" or "val"
    (``split_of``). ``limit`` caps the bytes (quick mode): reading stops once it is reached.
    The text differs between Python versions, so compare results within one machine only.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of bytes or None, got {limit}")
    files = [path for rel, path in stdlib_files() if split_of(rel) == split]
    if not files:
        root = sysconfig.get_paths()["stdlib"]
        raise FileNotFoundError(
            f"no .py files of the {split!r} split under the standard library at {root}: this "
            "Python may ship only compiled files; install its source (e.g. the libpython3-dev "
            "or python3-full package) or use another Python"
        )
    chunks: list[bytes] = []
    total = 0
    for path in files:
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if limit is not None and total >= limit:
            break
    text = b"".join(chunks)[:limit]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def get_batch(
    data: Tensor,
    step: int,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor]:
    """This rank's rows of the global batch of ``step``: inputs and next-byte targets (lesson 11).

    The global batch (``batch_size`` windows of ``seq_len + 1`` bytes at random offsets) depends
    only on ``(seed, step)``; rank r takes rows ``r * batch_size // world_size`` onwards, so the
    ranks together hold exactly the one-device batch. Returns int64 ``(x, y)``, y = x shifted by
    one byte.
    """
    if batch_size < 1 or seq_len < 1 or step < 0 or seed < 0:
        raise ValueError(
            f"batch_size and seq_len must be positive, step and seed not negative; got "
            f"batch_size={batch_size}, seq_len={seq_len}, step={step}, seed={seed}"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got {rank=}, {world_size=}")
    if batch_size % world_size:
        raise ValueError(
            f"batch_size={batch_size} does not split evenly over world_size={world_size} ranks: "
            f"choose a multiple of {world_size}"
        )
    if data.dim() != 1 or len(data) < seq_len + 1:
        raise ValueError(
            f"data must be 1-D with at least seq_len + 1 = {seq_len + 1} bytes, got shape "
            f"{tuple(data.shape)}: raise the byte limit or shorten seq_len"
        )
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # one stream per (seed, step)
    starts = torch.randint(len(data) - seq_len, (batch_size,), generator=g)
    per_rank = batch_size // world_size
    mine = starts[rank * per_rank : (rank + 1) * per_rank]
    windows = data[mine[:, None] + torch.arange(seq_len + 1)].long()
    x, y = windows[:, :-1], windows[:, 1:]
    return x.contiguous().to(device), y.contiguous().to(device)


@dataclass(frozen=True)
class GPTConfig:
    """The GPT's shape (lesson 11); the defaults train on two CPU cores in a couple of minutes."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        bad = [f"{k}={v!r}" for k, v in values.items() if not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"GPTConfig fields must be positive integers: {', '.join(bad)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads} (each head "
                f"gets d_model // n_heads features)"
            )


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v and out projections (lesson 11).

    The head count is read from the local width (``view(B, T, -1, head_dim)``), so when a
    tensor-parallel plan cuts q/k/v column-wise each rank simply runs its own heads.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Up-projection, GELU, down-projection (lesson 11); TP cuts ``up`` by columns, ``down`` by
    rows."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm transformer block (lesson 11): x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """A byte-level GPT (lesson 11): embeddings, pre-norm blocks, final norm, tied head.

    ``head.weight`` IS ``tok_emb.weight``. Weights start as in GPT-2 (normal, std 0.02; the
    residual output projections scaled by 1/sqrt(2 * n_layers)); seed with ``torch.manual_seed``
    before building.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                residual = name.endswith(("attn.out.weight", "mlp.down.weight"))
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if residual else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-byte cross-entropy over every position (lesson 11), in nats."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: Tensor,
    batches: int,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
) -> float:
    """Mean loss over ``batches`` fixed batches of ``data`` (steps 0.. of ``seed``) (lesson 11).

    The same batches every call, so validation losses along a run are comparable. With several
    ranks each returns the loss of its own rows; average them across ranks (equal row counts).
    """
    if batches < 1:
        raise ValueError(f"batches must be at least 1, got {batches}")
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(batches):
        x, y = get_batch(data, i, batch_size, seq_len, seed, rank, world_size, device)
        total += lm_loss(model(x), y).item()
    model.train(was_training)
    return total / batches


@torch.no_grad()
def generate(
    model: nn.Module, prompt: bytes, n: int, temperature: float = 1.0, seed: int = 0
) -> bytes:
    """``n`` bytes sampled after ``prompt``, deterministic for a seed (lesson 11).

    Sampling draws on the CPU from a generator seeded with ``seed``, so the bytes do not depend
    on the device's random state. The context is cut to the model's last ``seq_len`` bytes.
    """
    if not prompt:
        raise ValueError("prompt must hold at least one byte (the model needs a context)")
    if n < 0 or temperature <= 0:
        raise ValueError(f"n must be >= 0 and temperature > 0, got {n=}, {temperature=}")
    cfg = getattr(model, "cfg", None) or getattr(getattr(model, "module", None), "cfg", None)
    if not isinstance(cfg, GPTConfig):
        raise TypeError("generate needs a GPT (or a wrapper whose .module is one): no .cfg found")
    device = next(model.parameters()).device
    seq_len = cfg.seq_len
    g = torch.Generator().manual_seed(seed)
    out = list(prompt)
    was_training = model.training
    model.eval()
    for _ in range(n):
        idx = torch.tensor([out[-seq_len:]], dtype=torch.long, device=device)
        logits = model(idx)[0, -1].float().cpu() / temperature
        out.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)))
    model.train(was_training)
    return bytes(out[len(prompt):])
