"""The training loop: it learns, repeats exactly, and follows the devices it is given."""

from __future__ import annotations

import copy
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from mgpu_helpers.data import INFO, make_loader
from mgpu_helpers.models import build_model, mlp, resnet_cifar
from mgpu_helpers.train import (
    EpochResult,
    History,
    evaluate,
    fit,
    pick_device,
    seed_everything,
    train_epoch,
)


def _digits_run(digits_data, *, seed: int = 0, epochs: int = 4, wrap=None) -> tuple:
    """Seeded MLP training on the full digits; returns (history, model)."""
    train, test = digits_data
    seed_everything(seed)
    model = build_model("mlp", INFO["digits"])
    if wrap is not None:
        model = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    history = fit(
        model,
        make_loader(train, 32, "cpu", shuffle=True, seed=seed),
        make_loader(test, 512, "cpu"),
        opt,
        "cpu",
        epochs,
        progress=False,
    )
    return history, model


def _tiny_data(n: int = 24, features: int = 4, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)
    )


def test_fit_learns_digits(digits_data):
    history, _ = _digits_run(digits_data, epochs=4)
    assert history.test_acc[-1] > 0.9
    assert history.train_loss[-1] < history.train_loss[0]


def test_fit_is_deterministic_under_a_seed(digits_data):
    first, model_a = _digits_run(digits_data, seed=3, epochs=2)
    second, model_b = _digits_run(digits_data, seed=3, epochs=2)
    for key in ("epoch", "train_loss", "train_acc", "test_loss", "test_acc"):
        assert getattr(first, key) == getattr(second, key), key
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
    other, _ = _digits_run(digits_data, seed=4, epochs=2)
    assert other.train_loss != first.train_loss  # the seed matters, so the test can fail


def test_fit_with_data_parallel_on_cpu_matches_the_plain_model(digits_data):
    """nn.DataParallel without GPUs just calls the module: the loop needs no change."""
    plain, _ = _digits_run(digits_data, seed=1, epochs=1)
    wrapped, model = _digits_run(digits_data, seed=1, epochs=1, wrap=nn.DataParallel)
    assert isinstance(model, nn.DataParallel)
    assert wrapped.train_loss == plain.train_loss
    assert wrapped.test_acc == plain.test_acc


def test_history_has_one_entry_per_epoch():
    data = _tiny_data()
    torch.manual_seed(0)
    model = mlp(4, 3, hidden=8, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(
        model,
        make_loader(data, 8, "cpu"),
        make_loader(data, 8, "cpu"),
        opt,
        "cpu",
        3,
        progress=False,
    )
    assert history.epoch == [1, 2, 3]
    for values in history.as_dict().values():
        assert len(values) == 3
    assert all(0 <= a <= 1 for a in history.train_acc + history.test_acc)
    assert all(s > 0 for s in history.samples_per_sec)


def test_fit_without_a_test_loader_records_nan():
    data = _tiny_data()
    model = mlp(4, 3, hidden=8, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(model, make_loader(data, 8, "cpu"), None, opt, "cpu", 2, progress=False)
    assert len(history.test_acc) == 2
    assert all(np.isnan(v) for v in history.test_acc + history.test_loss)
    assert not any(np.isnan(v) for v in history.train_loss)


class _Stream(IterableDataset):
    """A data set without a length (streamed data): its DataLoader has no len() either."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        return iter(self.data)


def test_fit_accepts_loaders_without_a_length():
    data = _tiny_data()
    stream = make_loader(_Stream(data), 8, "cpu")
    with pytest.raises(TypeError):
        len(stream)
    torch.manual_seed(0)
    model = mlp(4, 3, hidden=8, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(model, stream, stream, opt, "cpu", 2, progress=False)
    assert not any(np.isnan(v) for v in history.test_acc)
    expected = evaluate(model, make_loader(data, 8, "cpu"), "cpu")
    assert history.test_loss[-1] == pytest.approx(expected.loss)


def test_fit_with_an_empty_test_loader_raises_instead_of_skipping_it():
    model = mlp(4, 3, hidden=8, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    empty = TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    train = make_loader(_tiny_data(), 8, "cpu")
    with pytest.raises(ValueError, match="no batches"):
        fit(model, train, make_loader(empty, 8, "cpu"), opt, "cpu", 1, progress=False)


def test_fit_progress_bar_reads_samples_per_second(capsys):
    """The epoch bar's postfix ends with the throughput as a reader says it: N samples/s."""
    data = _tiny_data()
    model = mlp(4, 3, hidden=8, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fit(model, make_loader(data, 8, "cpu"), make_loader(data, 8, "cpu"), opt, "cpu", 2)
    err = capsys.readouterr().err
    final = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("epochs")][-1]
    assert "2/2" in final and "loss=" in final and "test_acc=" in final, final
    assert re.search(r"[\d,]+ samples/s\]", final), final
    assert "samples_s" not in err, final


@pytest.mark.parametrize("epochs", [0, -1, 1.5, "2", None])
def test_fit_rejects_bad_epochs(epochs):
    model = mlp(4, 3, hidden=8, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="epochs must be a whole number >= 1"):
        fit(model, [], None, opt, "cpu", epochs, progress=False)


def test_on_epoch_start_gets_each_epoch_before_it_runs():
    data = _tiny_data()
    model = mlp(4, 3, hidden=8, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[int] = []
    steps = {"n": 0}

    class CountingLoader:
        def __iter__(self):
            steps["n"] += 1
            return iter(make_loader(data, 8, "cpu"))

    def on_epoch_start(epoch: int) -> None:
        assert steps["n"] == epoch  # called before that epoch's pass
        seen.append(epoch)

    fit(model, CountingLoader(), None, opt, "cpu", 4, progress=False, on_epoch_start=on_epoch_start)
    assert seen == [0, 1, 2, 3]


def test_evaluate_changes_no_parameters_or_buffers():
    """Uses a batch-norm ResNet: evaluating in training mode would move its running statistics."""
    torch.manual_seed(0)
    model = resnet_cifar(3, 10, width=4)
    data = TensorDataset(torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    before = copy.deepcopy(model.state_dict())
    result = evaluate(model, make_loader(data, 4, "cpu"), "cpu")
    assert isinstance(result, EpochResult) and result.samples == 8
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not model.training


def test_evaluate_matches_a_hand_computed_loss_and_accuracy():
    torch.manual_seed(0)
    model = mlp(4, 3, hidden=8, depth=1)
    data = _tiny_data(n=10)
    result = evaluate(model, make_loader(data, 3, "cpu"), "cpu")  # uneven last batch
    x, y = data.tensors
    with torch.no_grad():
        out = model(x)
    assert result.loss == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-5)
    assert result.accuracy == pytest.approx((out.argmax(1) == y).float().mean().item())
    assert result.samples == 10


def test_train_epoch_updates_the_model_and_sets_train_mode():
    torch.manual_seed(0)
    model = mlp(4, 3, hidden=8, depth=1).eval()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = train_epoch(model, make_loader(_tiny_data(), 8, "cpu"), opt, "cpu", progress=False)
    assert model.training
    assert result.samples == 24 and result.seconds >= 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("progress", [True, False])
def test_train_epoch_equals_a_plain_training_loop(progress):
    """The loop every later lesson compares against: same batches, same steps, same result."""
    data = _tiny_data(n=40)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(mlp(4, 3, hidden=8, depth=1))
    ours, plain = models
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    loader_ours = make_loader(data, 8, "cpu", shuffle=True, seed=5)
    loader_plain = make_loader(data, 8, "cpu", shuffle=True, seed=5)
    for _ in range(2):  # two epochs: each must draw the same shuffle as the plain loop
        result = train_epoch(ours, loader_ours, opt_ours, "cpu", progress=progress)
        total = 0.0
        for x, y in loader_plain:
            opt_plain.zero_grad()
            loss = F.cross_entropy(plain(x), y)
            loss.backward()
            opt_plain.step()
            total += loss.item() * len(y)
        assert result.loss == pytest.approx(total / len(data), rel=1e-6)
    for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_train_epoch_on_an_empty_loader_raises():
    model = mlp(4, 3, hidden=8, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    empty = TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="no batches"):
        train_epoch(model, make_loader(empty, 4, "cpu"), opt, "cpu", progress=False)
    with pytest.raises(ValueError, match="no batches"):
        evaluate(model, [], "cpu")


class _OutputElsewhere(nn.Module):
    """Stands for a model split across devices: inputs arrive on one device (here "meta"),
    outputs come out on another (the CPU), like the last stage of lesson 05a's split model."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(classes))
        self.input_devices: list[torch.device] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input_devices.append(x.device)
        return self.logits.expand(x.shape[0], -1)  # on the CPU, whatever x's device


def test_inputs_go_to_device_and_targets_follow_the_outputs():
    model = _OutputElsewhere()
    target_devices: list[torch.device] = []

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        target_devices.append(targets.device)
        return F.cross_entropy(outputs, targets)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader(_tiny_data(), 8, "cpu")
    history = fit(model, loader, loader, opt, "meta", 2, loss_fn=loss_fn, progress=False)
    assert set(model.input_devices) == {torch.device("meta")}
    assert set(target_devices) == {torch.device("cpu")}
    assert len(target_devices) == 2 * 2 * 3  # epochs x (train + test) x batches
    assert history.train_loss[1] < history.train_loss[0]  # it trained on the CPU outputs


def test_pick_device_here():
    device = pick_device()
    if torch.cuda.is_available():
        assert device == torch.device("cuda", 0)
    elif torch.backends.mps.is_available():
        assert device == torch.device("mps")
    else:
        assert device == torch.device("cpu")


def test_pick_device_on_a_cpu_only_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert pick_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device() == torch.device("cuda", 0)  # only names the device; touches no GPU


def test_seed_everything_seeds_python_numpy_and_torch():
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(2).tolist()

    seed_everything(11)
    first = draw()
    seed_everything(11)
    assert draw() == first
    seed_everything(12)
    assert draw() != first


def test_epoch_result_and_history_helpers():
    r = EpochResult(loss=1.0, accuracy=0.5, samples=100, seconds=2.0)
    assert r.samples_per_sec == 50
    assert np.isnan(EpochResult(1.0, 0.5, 100, 0.0).samples_per_sec)
    h = History()
    h.append(1, r, None)
    h.append(2, r, r)
    assert h.epoch == [1, 2] and h.test_acc[1] == 0.5 and np.isnan(h.test_acc[0])


@pytest.mark.gpu
def test_fit_on_a_gpu_matches_the_cpu(digits_data):
    train, test = digits_data
    results = {}
    for device in ("cpu", "cuda:0"):
        seed_everything(0)
        model = build_model("mlp", INFO["digits"]).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        results[device] = fit(
            model,
            make_loader(train, 64, device, shuffle=True),
            make_loader(test, 512, device),
            opt,
            device,
            2,
            progress=False,
        )
    assert results["cuda:0"].test_acc[-1] == pytest.approx(results["cpu"].test_acc[-1], abs=0.02)


@pytest.mark.multigpu
def test_split_model_targets_follow_the_last_device():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU()).to("cuda:0"),
        _ToDevice("cuda:1"),
        nn.Linear(8, 3).to("cuda:1"),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader(_tiny_data(), 8, "cuda:0")
    history = fit(model, loader, loader, opt, "cuda:0", 2, progress=False)
    assert history.train_loss[-1] < history.train_loss[0]


class _ToDevice(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device)
