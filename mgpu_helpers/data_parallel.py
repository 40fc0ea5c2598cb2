"""How ``nn.DataParallel`` splits a batch across devices (lesson 03).

Lesson 03 writes the data-parallel step itself (scatter, replicate, the weighted gradient
average); the package keeps only the split rule, which ``plots.plot_batch_split`` draws.
"""

from __future__ import annotations

__all__ = ["shard_sizes"]


def shard_sizes(batch_size: int, n_devices: int) -> list[int]:
    """Per-device batch sizes when ``batch_size`` samples are split like ``torch.chunk``.

    Each shard gets ``ceil(batch_size / n_devices)`` samples and the last one the rest, so a
    batch can use fewer devices than given: 6 samples on 4 devices give [2, 2, 2].
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"n_devices must be a whole number >= 1, got {n_devices!r}")
    chunk = -(-batch_size // n_devices)  # ceiling division
    sizes = [chunk] * (batch_size // chunk)
    if batch_size % chunk:
        sizes.append(batch_size % chunk)
    return sizes
