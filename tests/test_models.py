"""Models: shapes on every data set, build_model's choices, and batch independence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mgpu_helpers.data import INFO, DataInfo
from mgpu_helpers.models import (
    ResidualBlock,
    build_model,
    count_parameters,
    mlp,
    resnet_cifar,
    small_cnn,
)

MODEL_NAMES = ["auto", "cnn", "resnet", "mlp"]


def _batch(info: DataInfo, n: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, info.in_channels, info.image_size, info.image_size, generator=g)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("dataset", sorted(INFO))
def test_every_model_fits_every_dataset(name, dataset):
    info = INFO[dataset]
    torch.manual_seed(0)
    model = build_model(name, info)
    assert isinstance(model, nn.Sequential)  # lesson 05a cuts it between layers
    out = model(_batch(info, n=3))
    assert out.shape == (3, info.num_classes)
    assert torch.isfinite(out).all()


def test_models_follow_the_number_of_classes():
    info = DataInfo("custom", 2, 12, 7)
    for name in MODEL_NAMES:
        assert build_model(name, info)(_batch(info)).shape == (4, 7)


@pytest.mark.parametrize(
    ("dataset", "expected"),
    [("digits", "cnn"), ("fashionmnist", "cnn"), ("cifar10", "resnet"), ("synthetic", "resnet")],
)
def test_auto_picks_cnn_for_grey_and_resnet_for_colour(dataset, expected):
    info = INFO[dataset]
    torch.manual_seed(0)
    auto = build_model("auto", info)
    torch.manual_seed(0)
    chosen = build_model(expected, info)
    assert [type(m) for m in auto] == [type(m) for m in chosen]
    for a, b in zip(auto.state_dict().values(), chosen.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    has_bn = any(isinstance(m, nn.BatchNorm2d) for m in auto.modules())
    assert has_bn is (expected == "resnet")


@pytest.mark.parametrize("name", ["vgg", "CNN", "", "resnet18"])
def test_build_model_rejects_unknown_names(name):
    with pytest.raises(ValueError) as info:
        build_model(name, INFO["digits"])
    message = str(info.value)
    assert repr(name) in message
    for allowed in MODEL_NAMES:
        assert allowed in message


@pytest.mark.parametrize("depth", [0, -1])
def test_mlp_needs_a_hidden_layer(depth):
    with pytest.raises(ValueError, match="depth must be at least 1"):
        mlp(64, depth=depth)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_mlp_depth_counts_hidden_layers(depth):
    model = mlp(64, num_classes=10, hidden=16, depth=depth)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert len(linears) == depth + 1
    assert linears[0].in_features == 64 and linears[-1].out_features == 10


def test_count_parameters_by_hand():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert count_parameters(model) == (3 * 4 + 4) + (4 * 2 + 2)
    model[0].weight.requires_grad_(False)  # frozen parameters are not trainable
    assert count_parameters(model) == 4 + (4 * 2 + 2)
    assert count_parameters(nn.ReLU()) == 0


def test_count_parameters_of_the_course_models():
    assert count_parameters(mlp(64, 10, hidden=256, depth=2)) == (
        64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    )
    n_cnn = count_parameters(small_cnn(1, 10))
    assert 25_000 < n_cnn < 35_000  # "about 30k parameters at width=32"
    assert count_parameters(small_cnn(1, 10, width=64)) > n_cnn
    assert count_parameters(resnet_cifar(blocks=3)) > count_parameters(resnet_cifar(blocks=1))


def test_resnet_blocks_per_stage():
    for blocks in (1, 2):
        model = resnet_cifar(blocks=blocks)
        assert sum(isinstance(m, ResidualBlock) for m in model) == 3 * blocks


def test_residual_block_shapes_and_shortcut():
    x = torch.randn(2, 8, 16, 16)
    same = ResidualBlock(8, 8)
    assert isinstance(same.shortcut, nn.Identity)
    assert same(x).shape == (2, 8, 16, 16)
    down = ResidualBlock(8, 16, stride=2)
    assert not isinstance(down.shortcut, nn.Identity)
    assert down(x).shape == (2, 16, 8, 8)
    assert (down(x) >= 0).all()  # ends with a ReLU


@pytest.mark.parametrize("name", ["cnn", "mlp"])
@pytest.mark.parametrize("dataset", ["digits", "fashionmnist", "cifar10"])
@pytest.mark.parametrize("train_mode", [True, False])
def test_outputs_do_not_depend_on_the_rest_of_the_batch(name, dataset, train_mode):
    """Splitting a batch in two gives the whole batch's outputs (what lessons 03-05 rely on)."""
    info = INFO[dataset]
    torch.manual_seed(0)
    model = build_model(name, info).train(train_mode)
    x = _batch(info, n=6, seed=1)
    with torch.no_grad():
        whole = model(x)
        halves = torch.cat([model(x[:2]), model(x[2:])])
    torch.testing.assert_close(halves, whole)


def test_batch_norm_resnet_does_depend_on_the_batch_in_training():
    """The contrast: the ResNet's batch norm mixes samples, so the check above can fail."""
    info = INFO["cifar10"]
    torch.manual_seed(0)
    model = resnet_cifar(info.in_channels, info.num_classes, width=8).train()
    x = _batch(info, n=6, seed=1)
    with torch.no_grad():
        whole = model(x)
        halves = torch.cat([model(x[:3]), model(x[3:])])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(halves, whole)
