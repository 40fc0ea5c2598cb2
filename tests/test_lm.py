"""Lesson 11's data and model (mgpu_helpers.lm): the split, the batches, the GPT, sampling."""

from __future__ import annotations

import pytest
import torch

from mgpu_helpers.lm import (
    GPT,
    GPTConfig,
    evaluate,
    generate,
    get_batch,
    lm_loss,
    split_of,
    stdlib_bytes,
    stdlib_files,
)

TINY = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _model(cfg: GPTConfig = TINY, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def test_stdlib_files_leave_out_installed_packages():
    files = stdlib_files()
    rels = [rel for rel, _ in files]
    assert rels == sorted(rels) and len(rels) > 100
    assert not any("site-packages" in rel for rel in rels)
    assert "os.py" in rels  # the standard library itself is there


def test_split_is_by_file_deterministic_and_about_ten_percent():
    rels = [rel for rel, _ in stdlib_files()]
    val = [rel for rel in rels if split_of(rel) == "val"]
    assert 0.05 < len(val) / len(rels) < 0.15
    assert [split_of(r) for r in rels] == [split_of(r) for r in rels]


def test_stdlib_bytes_limit_and_splits_differ():
    train = stdlib_bytes("train", limit=5000)
    val = stdlib_bytes("val", limit=5000)
    assert train.dtype == torch.uint8 and len(train) == 5000 and len(val) == 5000
    assert not torch.equal(train, val)
    assert torch.equal(stdlib_bytes("train", limit=5000), train)  # the same bytes every call
    assert torch.equal(stdlib_bytes("train", limit=9000)[:5000], train)  # a prefix of the longer
    # The first train file starts the train text; a val file never appears in it.
    first = next(p for rel, p in stdlib_files() if split_of(rel) == "train")
    head = first.read_bytes()[:100]
    assert bytes(train[: len(head)].tolist()) == head


@pytest.mark.parametrize("split, limit", [("test", None), ("train", 0)])
def test_stdlib_bytes_rejects_bad_input(split, limit):
    with pytest.raises(ValueError, match="split|limit"):
        stdlib_bytes(split, limit)


def test_stdlib_bytes_says_when_no_file_is_found(monkeypatch):
    monkeypatch.setattr("mgpu_helpers.lm.stdlib_files", lambda: ())
    with pytest.raises(FileNotFoundError, match="no .py files"):
        stdlib_bytes("val")


def test_get_batch_shift_dtype_and_determinism():
    data = torch.arange(200, dtype=torch.uint8)
    x, y = get_batch(data, step=3, batch_size=4, seq_len=8, seed=1)
    assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x moved on by one byte
    assert torch.equal(y[:, -1], x[:, -1] + 1)  # data is 0, 1, 2, ...
    x2, _ = get_batch(data, step=3, batch_size=4, seq_len=8, seed=1)
    assert torch.equal(x, x2)
    assert not torch.equal(x, get_batch(data, step=4, batch_size=4, seq_len=8, seed=1)[0])
    assert not torch.equal(x, get_batch(data, step=3, batch_size=4, seq_len=8, seed=2)[0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_together_hold_the_one_device_batch(world_size):
    data = stdlib_bytes("train", limit=4000)
    whole_x, whole_y = get_batch(data, 5, 8, 16, seed=3)
    parts = [get_batch(data, 5, 8, 16, 3, r, world_size) for r in range(world_size)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), whole_y)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 6, "world_size": 4}, "multiple of 4"),
        ({"rank": 2, "world_size": 2}, "rank must be"),
        ({"seq_len": 500}, "at least seq_len"),
        ({"step": -1}, "not negative"),
    ],
)
def test_get_batch_rejects_bad_input(kwargs, match):
    args = {"step": 0, "batch_size": 4, "seq_len": 8} | kwargs
    with pytest.raises(ValueError, match=match):
        get_batch(torch.zeros(100, dtype=torch.uint8), **args)


@pytest.mark.parametrize(
    "kwargs, match", [({"d_model": 30, "n_heads": 4}, "multiple"), ({"n_layers": 0}, "positive")]
)
def test_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_gpt_shapes_tied_head_and_seeded_init():
    model = _model()
    idx = torch.randint(256, (3, 16))
    assert model(idx).shape == (3, 16, 256)
    assert model.head.weight is model.tok_emb.weight
    assert isinstance(model.pos_emb, torch.nn.Embedding) and len(model.blocks) == 2
    # Tied: the embedding counts once among the parameters.
    n = sum(p.numel() for p in model.parameters())
    assert n == 256 * 32 + 16 * 32 + 2 * (4 * 32 * 32 + 2 * 4 * 32 * 32 + 4 * 32) + 2 * 32
    same = _model()
    pairs = zip(model.parameters(), same.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    other = _model(seed=1)
    assert not torch.equal(model.tok_emb.weight, other.tok_emb.weight)
    with pytest.raises(ValueError, match="longer than seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_attention_is_causal():
    model = _model()
    idx = torch.randint(256, (2, 16))
    later = idx.clone()
    later[:, 10:] = (later[:, 10:] + 1) % 256  # change only the bytes from position 10 on
    a, b = model(idx), model(later)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_attention_runs_on_a_column_cut_of_its_heads():
    """A tensor-parallel rank holds some heads' q/k/v columns and out's rows: the module copes."""
    torch.manual_seed(0)
    attn = _model().blocks[0].attn
    x = torch.randn(2, 16, 32)
    full = attn(x)
    halves = []
    for part in (slice(0, 16), slice(16, 32)):  # heads 0-1, then heads 2-3
        cut = type(attn)(TINY)
        for name in ("q", "k", "v"):
            getattr(cut, name).weight = torch.nn.Parameter(getattr(attn, name).weight[part])
        cut.out.weight = torch.nn.Parameter(attn.out.weight[:, part])
        halves.append(cut(x))
    torch.testing.assert_close(halves[0] + halves[1], full)


def test_loss_starts_near_uniform_and_falls():
    model = _model()
    data = stdlib_bytes("train", limit=20_000)
    x, y = get_batch(data, 0, 8, 16)
    first = lm_loss(model(x), y).item()
    assert abs(first - torch.log(torch.tensor(256.0)).item()) < 0.3  # small init: ~uniform
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(60):
        x, y = get_batch(data, step, 8, 16)
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    val = stdlib_bytes("val", limit=20_000)
    assert evaluate(model, val, 4, 8, 16) < first - 1.5
    assert model.training  # evaluate restores the mode


def test_generate_is_deterministic_for_a_seed():
    model = _model()
    a = generate(model, b"def ", 20, seed=1)
    assert isinstance(a, bytes) and len(a) == 20
    assert generate(model, b"def ", 20, seed=1) == a
    assert generate(model, b"def ", 20, seed=2) != a
    assert len(generate(model, b"x" * 40, 3)) == 3  # a prompt longer than seq_len is cut
    assert generate(model, b"def ", 0) == b""


@pytest.mark.parametrize(
    "prompt, n, temperature, match",
    [(b"", 3, 1.0, "at least one byte"), (b"a", -1, 1.0, "n must"), (b"a", 3, 0.0, "temperature")],
)
def test_generate_rejects_bad_input(prompt, n, temperature, match):
    with pytest.raises(ValueError, match=match):
        generate(_model(), prompt, n, temperature)
