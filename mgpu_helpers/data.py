"""Data sets and loaders (lesson 02; reused by every later lesson).

``digits`` (scikit-learn's bundled 8x8 handwritten digits) needs no download. CIFAR-10 and
FashionMNIST come through torchvision and download into the course's ``data/`` folder (see
:func:`~mgpu_helpers.config.resolve_data_dir`). ``synthetic`` is random images for benchmarks.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, TensorDataset

from .config import DATASETS, LessonConfig, resolve_data_dir
from .placement import usable_cpus

__all__ = [
    "INFO",
    "DataInfo",
    "EncodedImages",
    "build_datasets",
    "digits",
    "loader_settings",
    "make_loader",
    "synthetic",
    "torchvision_dataset",
]


@dataclass(frozen=True)
class DataInfo:
    """Shape facts a model needs: channels, side length and number of classes."""

    name: str
    in_channels: int
    image_size: int
    num_classes: int


INFO = {
    "digits": DataInfo("digits", 1, 8, 10),
    "fashionmnist": DataInfo("fashionmnist", 1, 28, 10),
    "cifar10": DataInfo("cifar10", 3, 32, 10),
    "synthetic": DataInfo("synthetic", 3, 32, 10),
}


def _digits_table(csv: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels (1,797 x 64) and labels, as scikit-learn's ``load_digits`` gives them
    (lesson 02's default data set, behind :func:`digits`).

    Read from the gzipped table inside the installed scikit-learn, as ``load_digits`` reads it,
    without importing scikit-learn: that import takes about a second in every process that
    loads the data (each torchrun rank of lesson 07). ``csv``: that table elsewhere (tests). If
    the file is missing (a future scikit-learn), ``load_digits`` itself.
    """
    if csv is None:
        spec = importlib.util.find_spec("sklearn")  # finds the package, runs none of it
        places = spec.submodule_search_locations if spec is not None else None
        csv = Path(places[0], "datasets", "data", "digits.csv.gz") if places else None
    if csv is None or not csv.is_file():
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.data, bunch.target
    with gzip.open(csv, mode="rt", encoding="utf-8") as table:
        rows = np.loadtxt(table, delimiter=",")
    return rows[:, :-1], rows[:, -1].astype(int)


def digits(train: bool = True, test_fraction: float = 0.2) -> TensorDataset:
    """scikit-learn's 1,797 handwritten digits as 1x8x8 images, standardised.

    The train/test split is fixed (seed 0), whatever the lesson's seed, so that every lesson
    and every run evaluates on the same held-out digits.
    """
    pixels, labels = _digits_table()
    x = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = int(round(len(y) * test_fraction))
    train_idx, test_idx = order[n_test:], order[:n_test]
    mean, std = x[train_idx].mean(), x[train_idx].std()  # statistics of the training part only
    x = (x - mean) / std
    idx = train_idx if train else test_idx
    return TensorDataset(x[idx], y[idx])


def synthetic(
    n: int = 2048, shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10, seed: int = 0
) -> TensorDataset:
    """Random images with random labels, for throughput benchmarks (nothing to learn)."""
    if n < 1:
        raise ValueError(f"synthetic data needs n >= 1 samples, got {n}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return TensorDataset(x, y)


def torchvision_dataset(
    name: str,
    root: str | os.PathLike[str] | None = None,
    train: bool = True,
    download: bool = True,
    augment: bool = True,
) -> Dataset:
    """CIFAR-10 or FashionMNIST through torchvision's own classes, stored under ``root``.

    ``root`` goes through :func:`~mgpu_helpers.config.resolve_data_dir` (None: the course's
    data folder); files on disk are used as they are, else downloaded when ``download`` is true.
    ``augment`` adds random crops and flips to CIFAR-10's training images. A failure raises a
    one-line RuntimeError that names the offline data set, digits; offline, within seconds
    (a probe of the server comes first, see ``PROBE_SECONDS``).
    """
    from torchvision import datasets, transforms

    root = str(resolve_data_dir(root))
    if name == "cifar10":
        cls = datasets.CIFAR10
        norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
        steps = [transforms.ToTensor(), norm]
        if train and augment:  # the usual light augmentation: random 4-pixel shifts, mirroring
            steps = [
                transforms.RandomCrop(32, padding=4),
                transforms.RandomHorizontalFlip(),
                *steps,
            ]
    elif name == "fashionmnist":
        cls = datasets.FashionMNIST
        steps = [transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))]
    else:
        raise ValueError(
            f"{name!r} is not a torchvision data set here; use cifar10 or fashionmnist"
        )
    transform = transforms.Compose(steps)
    try:
        return cls(root=root, train=train, download=False, transform=transform)
    except RuntimeError:
        if not download:
            raise RuntimeError(
                f"{name} is not in {root!r}; allow the download or use dataset='digits', "
                "which needs none"
            ) from None
    unreachable = _unreachable(list(getattr(cls, "mirrors", None) or [cls.url]))
    if unreachable:
        raise RuntimeError(
            f"could not download {name} into {root!r} ({unreachable}); "
            "offline? use dataset='digits', which ships with scikit-learn"
        )
    try:
        return cls(root=root, train=train, download=True, transform=transform)
    except Exception as exc:  # URLError, HTTPError, checksum errors, ...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(
            f"could not download {name} into {root!r} ({reason}); "
            "offline? use dataset='digits', which ships with scikit-learn"
        ) from None


# torchvision downloads through urllib without a timeout. Offline, where DNS does not answer,
# the network drops packets or a firewall holds the connection open, urllib waits for the
# operating system's own timeouts (55 s measured, or for ever) before "offline? use digits"
# appears. The probe first asks each server for the headers of its URL (HTTP HEAD, through any
# proxy urllib would use) under a deadline, so an offline machine hears it within seconds;
# online it costs one small request, then torchvision downloads as before.
PROBE_SECONDS = 5.0


def _unreachable(urls: Sequence[str], timeout: float | None = None) -> str | None:
    """Why no server of ``urls`` answered within ``timeout`` s; None when one did (lesson 02).

    ``timeout`` None: ``PROBE_SECONDS``, read at each call. Any HTTP answer counts (a 404 too:
    the network works). Each probe runs in a daemon thread,
    because the name lookup (``getaddrinfo``) has no timeout of its own; a probe still waiting
    at the deadline is left to end by itself.
    """
    urls = list(dict.fromkeys(urls))  # each server once
    if not urls:
        raise ValueError("no URL to probe")
    timeout = PROBE_SECONDS if timeout is None else timeout
    lock, done = threading.Lock(), threading.Event()
    answered: list[str] = []
    errors: dict[str, str] = {}

    def probe(url: str) -> None:
        request = urllib.request.Request(url, method="HEAD")
        try:
            urllib.request.urlopen(request, timeout=timeout).close()
        except urllib.error.HTTPError:
            pass  # the server answered, with an error status: the network works
        except Exception as exc:  # URLError, TimeoutError, http.client errors, ...
            reason = getattr(exc, "reason", None) or exc
            with lock:
                errors[url] = (str(reason).strip().splitlines() or [type(exc).__name__])[0]
                if len(errors) == len(urls):
                    done.set()
            return
        with lock:
            answered.append(url)
        done.set()

    for url in urls:
        threading.Thread(target=probe, args=(url,), daemon=True, name="mgpu-probe").start()
    done.wait(timeout)
    with lock:
        if answered:
            return None
        late = f"no answer within {timeout:g} s"
        return "; ".join(
            f"{urllib.parse.urlsplit(url).hostname}: {errors.get(url, late)}" for url in urls
        )


def build_datasets(cfg: LessonConfig) -> tuple[Dataset, Dataset, DataInfo]:
    """Training set, test set and shape facts for ``cfg.dataset``, capped as ``cfg`` asks."""
    if cfg.dataset not in DATASETS:  # LessonConfig already checks; kept for direct callers
        raise ValueError(f"dataset={cfg.dataset!r} is unknown; choose one of {', '.join(DATASETS)}")
    if cfg.dataset == "digits":
        train, test = digits(train=True), digits(train=False)
    elif cfg.dataset == "synthetic":
        info = INFO["synthetic"]
        shape = (info.in_channels, info.image_size, info.image_size)
        train = synthetic(cfg.train_samples or 4096, shape, info.num_classes, seed=cfg.seed)
        test = synthetic(cfg.test_samples or 1024, shape, info.num_classes, seed=cfg.seed + 1)
    else:
        # data_dir is resolved now ($MGPU_DATA as it is now), not when the config was made
        train = torchvision_dataset(cfg.dataset, cfg.data_dir, train=True, augment=cfg.augment)
        test = torchvision_dataset(cfg.dataset, cfg.data_dir, train=False)
    return _cap(train, cfg.train_samples), _cap(test, cfg.test_samples), INFO[cfg.dataset]


def _cap(ds: Dataset, limit: int | None) -> Dataset:
    n = len(ds)  # type: ignore[arg-type]
    return ds if limit is None or limit >= n else Subset(ds, range(limit))


def loader_settings(device: torch.device | str, dataset: Dataset) -> dict:
    """``num_workers`` and ``pin_memory`` that suit this device and data set (lesson 02).

    In-memory tensors need no workers (they would only copy them); data decoded from files gets
    a few per GPU. Pinned memory speeds host-to-GPU copies; on the CPU it only costs.
    """
    on_gpu = torch.device(device).type == "cuda"
    in_memory = isinstance(_base(dataset), TensorDataset)
    if in_memory or not on_gpu:
        workers = 0
    else:
        per_gpu = usable_cpus() // max(1, torch.cuda.device_count())  # this process's cores
        workers = max(1, min(4, per_gpu - 1))
    return {"num_workers": workers, "pin_memory": on_gpu, "persistent_workers": workers > 0}


def _base(ds: Dataset) -> Dataset:
    while isinstance(ds, Subset):
        ds = ds.dataset
    return ds


def make_loader(
    dataset: Dataset,
    batch_size: int,
    device: torch.device | str,
    *,
    shuffle: bool = False,
    seed: int = 0,
    sampler: Sampler | None = None,
    drop_last: bool = False,
) -> DataLoader:
    """A DataLoader with a seeded shuffle and the worker/pinning settings for ``device``.

    Pass a ``sampler`` (a ``DistributedSampler`` in lesson 04a) instead of ``shuffle``.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    if sampler is not None and shuffle:
        raise ValueError("pass either shuffle=True or a sampler (the sampler does the shuffling)")
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        sampler=sampler,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed) if shuffle else None,
        **loader_settings(device, dataset),
    )


class EncodedImages(Dataset):
    """Images kept compressed and decoded, cropped, mirrored and blurred per sample (lesson 02).

    It does on the CPU what a real image loader does for every sample it hands out: decompress
    (zlib, standing in for PNG/JPEG), convert to float, take a random crop, maybe mirror,
    normalise; ``blur_passes`` 3x3 blurs set how much work that is. Elementwise operations only,
    which run on the calling thread at this size: the cost per sample does not depend on the
    process's torch threads (conv2d's would, badly so on a busy machine). Items are
    ``(image, label)``, or ``(image, label, index)`` with ``return_index``. It lives in the
    package because DataLoader workers started with the spawn method (macOS, Windows) or
    forkserver (Linux's default from Python 3.14) import the dataset's class by name, which
    fails for a class defined in a notebook.
    """

    def __init__(
        self,
        n: int = 1024,
        side: int = 16,
        channels: int = 1,
        num_classes: int = 10,
        blur_passes: int = 4,
        seed: int = 0,
        return_index: bool = False,
    ) -> None:
        sizes = {
            "n": (n, 1),
            "side": (side, 4),
            "channels": (channels, 1),
            "num_classes": (num_classes, 1),
            "blur_passes": (blur_passes, 0),
        }
        for name, (value, least) in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"EncodedImages: {name}={value!r}; it must be a whole number >= {least}"
                )
        g = torch.Generator().manual_seed(seed)
        self.side, self.channels, self.blur_passes = side, channels, blur_passes
        self.margin = side // 8  # the random crop moves by up to this many pixels each way
        stored = side + 2 * self.margin
        # smooth pictures (coarse random shapes, upsampled) with a little noise, as 8-bit pixels
        coarse = torch.rand(n, channels, 4, 4, generator=g)
        pictures = F.interpolate(coarse, size=(stored, stored), mode="bilinear")
        pictures = pictures + 0.05 * torch.randn(pictures.shape, generator=g)
        pixels = (pictures.clamp(0, 1) * 255).round().to(torch.uint8)
        self.blobs = [zlib.compress(p.numpy().tobytes()) for p in pixels]  # the "files"
        self.labels = torch.randint(0, num_classes, (n,), generator=g)
        self.return_index = return_index

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        stored = self.side + 2 * self.margin
        raw = bytearray(zlib.decompress(self.blobs[index]))  # decode
        image = torch.frombuffer(raw, dtype=torch.uint8).view(self.channels, stored, stored)
        image = image.float() / 255
        top, left = torch.randint(0, 2 * self.margin + 1, (2,)).tolist()  # augment: crop, mirror
        image = image[:, top : top + self.side, left : left + self.side]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        image = (image - 0.5) / 0.25
        for _ in range(self.blur_passes):
            image = _box_blur(image)
        label = self.labels[index]
        return (image, label, torch.tensor(index)) if self.return_index else (image, label)


def _box_blur(image: torch.Tensor) -> torch.Tensor:
    """A 3x3 box blur of a (C, H, W) image, edge pixels kept (EncodedImages' augmentation)."""
    rows = image.clone()
    rows[..., 1:-1] = (image[..., :-2] + image[..., 1:-1] + image[..., 2:]) / 3
    out = rows.clone()
    out[..., 1:-1, :] = (rows[..., :-2, :] + rows[..., 1:-1, :] + rows[..., 2:, :]) / 3
    return out
