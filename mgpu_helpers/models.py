"""Models for the lessons (lesson 02; split across devices in lesson 05a).

Every model is a flat ``nn.Sequential``, so lesson 05a can cut it between any two layers. The
small CNN and the MLP have no batch normalisation, so a sample's output does not depend on the
rest of its batch: split across devices, a batch gives exactly the single-device result.
"""

from __future__ import annotations

from itertools import pairwise

from torch import Tensor, nn

from .data import DataInfo

__all__ = ["ResidualBlock", "build_model", "count_parameters", "mlp", "resnet_cifar", "small_cnn"]


def small_cnn(in_channels: int = 1, num_classes: int = 10, width: int = 32) -> nn.Sequential:
    """Two convolution stages and a linear head; about 30k parameters at ``width=32``.

    Works on any image side of 8 or more (digits 8x8, FashionMNIST 28x28): the adaptive pool
    makes the head independent of the input size.
    """
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 4, num_classes),
    )


def mlp(
    in_features: int, num_classes: int = 10, hidden: int = 256, depth: int = 2
) -> nn.Sequential:
    """A multi-layer perceptron over flattened images: the fastest model for demonstrations."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1 hidden layer, got {depth}")
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in pairwise([in_features] + [hidden] * depth):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, num_classes))


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut; ``stride=2`` halves the image."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:  # match shape with a 1x1 convolution
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        return (self.body(x) + self.shortcut(x)).relu()


def resnet_cifar(
    in_channels: int = 3, num_classes: int = 10, width: int = 32, blocks: int = 1
) -> nn.Sequential:
    """A ResNet-style CNN for 32x32 images: a stem, three stages of residual blocks, a head.

    ``blocks`` residual blocks per stage (1 gives a ResNet-8, 3 a ResNet-20).
    """
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
    ]
    c = width
    for stage, c_out in enumerate((width, 2 * width, 4 * width)):
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1  # each later stage halves the image
            layers.append(ResidualBlock(c, c_out, stride))
            c = c_out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes))


def build_model(name: str, info: DataInfo) -> nn.Sequential:
    """The model ``name`` ("auto", "cnn", "resnet" or "mlp") shaped for the data in ``info``.

    "auto" picks the small CNN for the one-channel data sets and the ResNet for colour images.
    """
    if name == "auto":
        name = "cnn" if info.in_channels == 1 else "resnet"
    if name == "cnn":
        return small_cnn(info.in_channels, info.num_classes)
    if name == "resnet":
        return resnet_cifar(info.in_channels, info.num_classes)
    if name == "mlp":
        return mlp(info.in_channels * info.image_size**2, info.num_classes)
    raise ValueError(f"model={name!r} is unknown; choose auto, cnn, resnet or mlp")


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
