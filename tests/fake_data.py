"""CIFAR-10 and FashionMNIST files in the real on-disk formats, written by the tests.

No test may download, so the tests write the files torchvision's own dataset classes read: the
IDX files of (Fashion)MNIST and the pickled batches of ``cifar-10-batches-py``. The images are
learnable (each class a fixed template plus noise), so a lesson that checks its model learns
still passes on them, and small, so a lesson runs on them in seconds.

torchvision checks the MD5 sum of every CIFAR-10 file against the official archive, which files
written here cannot match. :func:`write_md5_bypass` writes a ``sitecustomize.py`` that replaces
that check with an existence check in every process that has its folder on ``PYTHONPATH`` (a
notebook kernel and the ranks it launches); tests in this process monkeypatch it instead.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np

__all__ = ["write_cifar10", "write_fashionmnist", "write_idx", "write_md5_bypass"]

CIFAR_LABELS = [
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip


def write_idx(path: Path, array: np.ndarray) -> None:
    """The IDX format MNIST uses: magic (0, 0, type 0x08 = uint8, ndim), big-endian sizes, data."""
    if array.dtype != np.uint8:
        raise ValueError(f"IDX files here hold uint8, got {array.dtype}")
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.tobytes())


def _images(
    rng: np.random.Generator, n: int, shape: tuple[int, ...], learnable: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` uint8 images of ``shape`` and labels; a class template plus noise if learnable."""
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    if not learnable:
        return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8), labels
    templates = np.random.default_rng(1234).integers(40, 216, size=(10, *shape))
    noise = rng.normal(0, 30, size=(n, *shape))
    images = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
    return images, labels


def write_fashionmnist(
    root: Path, n_train: int = 20, n_test: int = 10, *, learnable: bool = False, seed: int = 0
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``root/FashionMNIST/raw/*-ubyte`` as torchvision reads them; returns the arrays."""
    rng = np.random.default_rng(seed)
    raw = Path(root) / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images, labels = _images(rng, n, (28, 28), learnable)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
        arrays[prefix] = (images, labels)
    return arrays


def write_cifar10(
    root: Path, per_batch: int = 4, n_test: int = 6, *, learnable: bool = False, seed: int = 1
) -> dict[str, tuple[np.ndarray, list[int]]]:
    """``root/cifar-10-batches-py`` as the real archive holds it; returns each batch's data.

    The real files are Python 2 pickles whose str keys torchvision reads back (latin-1) as
    str, so the keys here are str too ("data", "labels"), and each row is 1024 red, then
    1024 green, then 1024 blue values, row-major.
    """
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = n_test if name == "test_batch" else per_batch
        images, labels = _images(rng, n, (3072,), learnable)
        entry = {
            "batch_label": name,
            "labels": labels.tolist(),
            "data": images,
            "filenames": [""] * n,
        }
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        batches[name] = (images, labels.tolist())
    meta = {"label_names": CIFAR_LABELS, "num_cases_per_batch": per_batch, "num_vis": 3072}
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return batches


_SITECUSTOMIZE = '''\
"""Written by the course's tests: CIFAR-10 files made by the tests pass torchvision's MD5 check.

Only the check is replaced (by "the file exists"); the real loading code reads the files.
It patches torchvision.datasets.cifar when that module is first imported, so a process that
never loads CIFAR pays nothing.
"""
import importlib.abc
import importlib.machinery
import os
import sys

_TARGET = "torchvision.datasets.cifar"


def _exists(fpath, md5=None):
    return os.path.isfile(fpath)


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            module.check_integrity = _exists

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
'''


def write_md5_bypass(folder: Path) -> Path:
    """Write the ``sitecustomize.py`` described above into ``folder``; returns its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sitecustomize.py"
    path.write_text(_SITECUSTOMIZE)
    return path
