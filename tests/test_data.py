"""Data sets and loaders: digits, synthetic, torchvision (offline, real file formats), loaders."""

from __future__ import annotations

import dataclasses
import http.server
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from mgpu_helpers import data as data_module
from mgpu_helpers.config import QUICK_LIMITS, LessonConfig, apply_quick
from mgpu_helpers.data import (
    INFO,
    PROBE_SECONDS,
    _unreachable,
    build_datasets,
    digits,
    loader_settings,
    make_loader,
    synthetic,
    torchvision_dataset,
)

FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
CIFAR_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
CIFAR_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)

# --- digits ---------------------------------------------------------------------------------


def test_digits_split_sizes_and_shapes(digits_data):
    train, test = digits_data
    assert len(train) + len(test) == 1797  # scikit-learn's digits, all of them
    assert len(test) == round(1797 * 0.2)
    x, y = train.tensors
    assert x.shape == (len(train), 1, 8, 8) and x.dtype == torch.float32
    assert y.dtype == torch.long and set(y.tolist()) == set(range(10))


def test_digits_table_is_load_digits_read_without_importing_scikit_learn(tmp_path):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    for where in (None, tmp_path / "missing.csv.gz"):  # the bundled table; load_digits itself
        pixels, labels = data_module._digits_table(where)
        assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target)
        assert pixels.dtype == bunch.data.dtype and labels.dtype == bunch.target.dtype
    code = "import sys\nfrom mgpu_helpers.data import digits\n"
    code += "digits()\nprint('sklearn' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr  # about a second saved in every process


def test_digits_split_is_fixed_whatever_the_global_seed(digits_data):
    train, test = digits_data
    torch.manual_seed(12345)
    again_train, again_test = digits(train=True), digits(train=False)
    for a, b in ((train, again_train), (test, again_test)):
        torch.testing.assert_close(a.tensors[0], b.tensors[0], rtol=0, atol=0)
        assert torch.equal(a.tensors[1], b.tensors[1])


def test_digits_train_and_test_do_not_overlap(digits_data):
    train, test = digits_data
    train_rows = {tuple(r.tolist()) for r in train.tensors[0].flatten(1)}
    test_rows = [tuple(r.tolist()) for r in test.tensors[0].flatten(1)]
    # scikit-learn's digits contain no exact duplicates across our split
    assert not any(r in train_rows for r in test_rows)


def test_digits_standardised_with_training_statistics(digits_data):
    train, test = digits_data
    x = train.tensors[0]
    assert abs(x.mean().item()) < 1e-5
    assert abs(x.std().item() - 1) < 1e-5
    # the test part uses the training statistics: close to, not exactly, standard
    assert abs(test.tensors[0].mean().item()) < 0.1
    assert abs(test.tensors[0].mean().item()) > 1e-6


def test_digits_test_fraction():
    assert len(digits(train=False, test_fraction=0.5)) == round(1797 * 0.5)


# --- synthetic ------------------------------------------------------------------------------


def test_synthetic_is_deterministic_per_seed():
    a, b, c = synthetic(16, seed=3), synthetic(16, seed=3), synthetic(16, seed=4)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert not torch.equal(a.tensors[0], c.tensors[0])


def test_synthetic_shapes_and_labels():
    ds = synthetic(50, shape=(1, 5, 5), num_classes=3)
    x, y = ds.tensors
    assert x.shape == (50, 1, 5, 5)
    assert y.min() >= 0 and y.max() < 3


def test_synthetic_does_not_touch_the_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    synthetic(8)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("n", [0, -1])
def test_synthetic_needs_at_least_one_sample(n):
    with pytest.raises(ValueError, match="n >= 1"):
        synthetic(n)


# --- build_datasets -------------------------------------------------------------------------


def test_build_datasets_digits_full(no_quick, digits_data):
    train, test, info = build_datasets(LessonConfig())
    assert (len(train), len(test)) == (len(digits_data[0]), len(digits_data[1]))
    assert info == INFO["digits"]


def test_build_datasets_caps_in_quick_mode(no_quick):
    train, test, info = build_datasets(apply_quick(LessonConfig(), True))
    assert len(train) == QUICK_LIMITS["train_samples"]
    assert len(test) == QUICK_LIMITS["test_samples"]
    assert isinstance(train, Subset) and info.image_size == 8


def test_build_datasets_explicit_caps_and_caps_larger_than_data(no_quick):
    train, test, _ = build_datasets(LessonConfig(train_samples=100, test_samples=10_000))
    assert len(train) == 100
    assert len(test) == round(1797 * 0.2)  # a cap above the size keeps everything
    assert not isinstance(test, Subset)


def test_build_datasets_synthetic_follows_caps_and_seed(no_quick):
    cfg = LessonConfig(dataset="synthetic", train_samples=40, test_samples=20, seed=5)
    train, test, info = build_datasets(cfg)
    assert (len(train), len(test)) == (40, 20)
    x, _ = train[0]
    assert x.shape == (info.in_channels, info.image_size, info.image_size)
    train2, _, _ = build_datasets(cfg)
    assert torch.equal(train.tensors[0], train2.tensors[0])
    assert not torch.equal(train.tensors[0][:20], test.tensors[0])  # different seeds


def test_build_datasets_rejects_unknown_names_from_direct_callers(no_quick):
    cfg = LessonConfig()
    object.__setattr__(cfg, "dataset", "imagenet")  # bypass the dataclass check on purpose
    with pytest.raises(ValueError, match="dataset='imagenet' is unknown"):
        build_datasets(cfg)


# --- torchvision data sets, offline, in their real on-disk formats ---------------------------


def _write_idx(path: Path, array: np.ndarray) -> None:
    """The IDX format MNIST uses: magic (0, 0, type 0x08 = uint8, ndim), big-endian sizes, data."""
    assert array.dtype == np.uint8
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.tobytes())


def _write_fashionmnist(root: Path, n_train: int = 20, n_test: int = 10) -> dict:
    rng = np.random.default_rng(0)
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
        arrays[prefix] = (images, labels)
    return arrays


@pytest.fixture
def fashion_root(tmp_path):
    return tmp_path, _write_fashionmnist(tmp_path)


@pytest.mark.parametrize(("train", "prefix", "n"), [(True, "train", 20), (False, "t10k", 10)])
def test_fashionmnist_from_idx_files(fashion_root, train, prefix, n):
    root, arrays = fashion_root
    ds = torchvision_dataset("fashionmnist", str(root), train=train, download=False)
    assert isinstance(ds, torchvision.datasets.FashionMNIST)
    assert len(ds) == n
    images, labels = arrays[prefix]
    for i in (0, n - 1):
        x, y = ds[i]
        assert x.shape == (1, 28, 28) and x.dtype == torch.float32
        assert y == int(labels[i])
        expected = (torch.from_numpy(images[i]).float() / 255 - FASHION_MEAN) / FASHION_STD
        torch.testing.assert_close(x[0], expected)


def test_fashionmnist_through_build_datasets(fashion_root, no_quick):
    root, arrays = fashion_root
    train, test, info = build_datasets(LessonConfig(dataset="fashionmnist", data_dir=str(root)))
    assert (len(train), len(test)) == (20, 10)
    assert info == INFO["fashionmnist"]
    x, y = next(iter(DataLoader(test, batch_size=10)))
    assert x.shape == (10, info.in_channels, info.image_size, info.image_size)
    assert y.tolist() == arrays["t10k"][1].tolist()
    capped, _, _ = build_datasets(
        LessonConfig(dataset="fashionmnist", data_dir=str(root), train_samples=5)
    )
    assert len(capped) == 5


def _write_cifar10(root: Path, per_batch: int = 4, n_test: int = 6) -> dict:
    """cifar-10-batches-py as the real archive holds it: pickled dicts, N x 3072 uint8 rows.

    The real files are Python 2 pickles whose str keys torchvision reads back (latin-1) as
    str, so the keys here are str too ("data", "labels"), and each row is 1024 red, then
    1024 green, then 1024 blue values, row-major.
    """
    rng = np.random.default_rng(1)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else per_batch
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).tolist()
        entry = {"batch_label": name, "labels": labels, "data": data, "filenames": [""] * n}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        batches[name] = (data, labels)
    label_names = ["airplane", "automobile", "bird", "cat", "deer"]
    label_names += ["dog", "frog", "horse", "ship", "truck"]
    meta = {"label_names": label_names, "num_cases_per_batch": per_batch, "num_vis": 3072}
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return batches


@pytest.fixture
def cifar_root(tmp_path, monkeypatch):
    # torchvision checks the MD5 sum of every CIFAR-10 file against the official archive,
    # which files written here cannot match. Both CIFAR10._check_integrity and _load_meta
    # (for batches.meta) go through the module's check_integrity, so replacing that one
    # function with an existence check lets the real loading code read our real-format files.
    import torchvision.datasets.cifar as cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    return tmp_path, _write_cifar10(tmp_path)


def test_cifar10_test_split_from_pickles(cifar_root):
    root, batches = cifar_root
    ds = torchvision_dataset("cifar10", str(root), train=False, download=False)
    assert isinstance(ds, torchvision.datasets.CIFAR10)
    data, labels = batches["test_batch"]
    assert len(ds) == len(labels)
    assert ds.classes[0] == "airplane"  # batches.meta was read
    for i in range(len(ds)):
        x, y = ds[i]
        assert y == labels[i]
        raw = torch.from_numpy(data[i]).reshape(3, 32, 32).float() / 255
        torch.testing.assert_close(x, (raw - CIFAR_MEAN) / CIFAR_STD)


def test_cifar10_train_split_is_augmented(cifar_root):
    root, batches = cifar_root
    ds = torchvision_dataset("cifar10", str(root), train=True, download=False)
    labels = [y for i in range(1, 6) for y in batches[f"data_batch_{i}"][1]]
    assert len(ds) == len(labels) == 20
    assert [ds[i][1] for i in range(len(ds))] == labels
    torch.manual_seed(0)
    views = [ds[0][0] for _ in range(8)]
    assert all(v.shape == (3, 32, 32) for v in views)
    # random crops and flips: the same image comes out differently
    assert any(not torch.equal(views[0], v) for v in views[1:])


def test_cifar10_without_augmentation_gives_the_same_image_every_time(cifar_root, no_quick):
    root, _ = cifar_root
    cfg = LessonConfig(dataset="cifar10", data_dir=str(root), augment=False)
    train, _, _ = build_datasets(cfg)
    views = [train[0][0] for _ in range(8)]
    assert all(torch.equal(views[0], v) for v in views[1:])
    augmented, _, _ = build_datasets(dataclasses.replace(cfg, augment=True))
    torch.manual_seed(0)
    assert any(not torch.equal(augmented[0][0], views[0]) for _ in range(8))


def test_augment_must_be_a_bool(no_quick):
    with pytest.raises(ValueError, match="augment"):
        LessonConfig(augment="no")


def test_cifar10_through_build_datasets(cifar_root, no_quick):
    root, _ = cifar_root
    train, test, info = build_datasets(LessonConfig(dataset="cifar10", data_dir=str(root)))
    assert (len(train), len(test)) == (20, 6)
    assert info == INFO["cifar10"]
    x, y = next(iter(DataLoader(train, batch_size=8)))
    assert x.shape == (8, 3, 32, 32) and y.shape == (8,)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("fashionmnist", torchvision.datasets.FashionMNIST),
        ("cifar10", torchvision.datasets.CIFAR10),
    ],
)
def test_failed_download_names_the_offline_default(tmp_path, monkeypatch, name, cls):
    calls = []

    def offline(self):
        calls.append(self)
        raise urllib.error.URLError("offline")

    monkeypatch.setattr(cls, "download", offline)  # nothing touches the network
    monkeypatch.setattr(data_module, "_unreachable", lambda urls: None)  # as if online
    with pytest.raises(RuntimeError) as info:
        torchvision_dataset(name, str(tmp_path), train=True)
    message = str(info.value)
    assert calls, "the download was not attempted"
    assert "\n" not in message
    assert "digits" in message and "offline" in message
    assert str(tmp_path) in message
    assert info.value.__cause__ is None  # one clean error, not a chained traceback


def _assert_offline_message(message: str, name: str, root: Path) -> None:
    assert "\n" not in message
    assert "digits" in message and "offline" in message
    assert name in message and str(root) in message


@pytest.fixture
def no_dns(monkeypatch):
    """Name lookups of other machines fail at once, as on a machine without a network."""
    real = socket.getaddrinfo

    def lookup(host, *args, **kwargs):
        if host in ("localhost", "127.0.0.1", "::1"):
            return real(host, *args, **kwargs)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)


@pytest.fixture
def silent_dns(monkeypatch):
    """Name lookups that never answer (an unreachable DNS server); released after the test."""
    release = threading.Event()

    def lookup(*args, **kwargs):
        release.wait(60)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    yield
    release.set()  # the probe threads still waiting end now


@pytest.fixture
def direct(monkeypatch):
    """No proxy from the environment: the probe talks to the test's own local server."""
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


def test_the_probe_deadline_is_a_few_seconds():
    assert 1 <= PROBE_SECONDS <= 5


@pytest.mark.parametrize("name", ["fashionmnist", "cifar10"])
def test_offline_the_download_fails_at_once_naming_digits(tmp_path, no_dns, name):
    # no name resolves, and conftest's _offline guard refuses any connection that is not local
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
        torchvision_dataset(name, str(tmp_path), train=True)
    assert time.perf_counter() - start < 3
    _assert_offline_message(str(info.value), name, tmp_path)
    assert "Temporary failure in name resolution" in str(info.value)
    assert info.value.__cause__ is None
    assert list(tmp_path.iterdir()) == []  # the download never started


@pytest.mark.parametrize("name", ["fashionmnist", "cifar10"])
def test_a_name_lookup_that_never_answers_fails_at_the_deadline(
    tmp_path, monkeypatch, silent_dns, name
):
    # getaddrinfo has no timeout: without the probe, urllib waited for it (55 s measured)
    monkeypatch.setattr(data_module, "PROBE_SECONDS", 0.5)
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
        torchvision_dataset(name, str(tmp_path), train=True)
    assert time.perf_counter() - start < 2.5, "the probe's deadline did not hold"
    _assert_offline_message(str(info.value), name, tmp_path)
    assert "no answer within 0.5 s" in str(info.value)
    assert list(tmp_path.iterdir()) == []


class _Silent(http.server.BaseHTTPRequestHandler):
    """Accepts the request and never answers (a firewall that holds the connection open)."""

    def do_HEAD(self) -> None:
        time.sleep(3)

    def log_message(self, *args) -> None:
        pass


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def local_server(direct):
    """Starts an HTTP server on the loopback address with a given handler; returns its URL."""
    servers = []

    def serve(handler: type) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/file.tar.gz"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_server_that_never_answers_fails_at_the_deadline(local_server):
    url = local_server(_Silent)
    start = time.perf_counter()
    reason = _unreachable([url], timeout=0.5)
    assert time.perf_counter() - start < 2.0
    assert reason is not None and "127.0.0.1" in reason


def test_any_http_answer_means_online_so_the_download_goes_ahead(local_server):
    # a 404 still proves the network works: torchvision's own download then reports it
    assert _unreachable([local_server(_NotFound)], timeout=2.0) is None
    # one answering mirror is enough (port 9, discard, refuses the connection)
    assert _unreachable(["http://127.0.0.1:9/", local_server(_NotFound)], timeout=2.0) is None


def test_the_probe_names_each_server_that_failed(no_dns, direct):
    reason = _unreachable(["http://127.0.0.1:9/a", "https://example.invalid/b"], timeout=2.0)
    assert reason is not None and "127.0.0.1: " in reason and "example.invalid: " in reason
    with pytest.raises(ValueError, match="no URL"):
        _unreachable([])


@pytest.mark.parametrize("name", ["fashionmnist", "cifar10"])
def test_missing_files_without_download_name_the_offline_default(tmp_path, name):
    with pytest.raises(RuntimeError) as info:
        torchvision_dataset(name, str(tmp_path), train=False, download=False)
    message = str(info.value)
    assert "\n" not in message
    assert "digits" in message and name in message and str(tmp_path) in message
    assert list(tmp_path.iterdir()) == []  # nothing was downloaded or created


@pytest.mark.parametrize("name", ["digits", "mnist", "synthetic"])
def test_torchvision_dataset_rejects_other_names(tmp_path, name):
    with pytest.raises(ValueError, match="cifar10 or fashionmnist"):
        torchvision_dataset(name, str(tmp_path), train=True)


# --- the data folder: the course's data/ (or $MGPU_DATA), whatever the kernel's cwd ---------

ROOT = Path(__file__).resolve().parents[1]

KERNEL_PROBE = """\
import json, os
from mgpu_helpers.config import LessonConfig, resolve_data_dir
from mgpu_helpers.data import build_datasets

train, test, _ = build_datasets(LessonConfig(dataset="fashionmnist", quick=False))
with_env = str(resolve_data_dir())
del os.environ["MGPU_DATA"]
print(json.dumps({"cwd": os.getcwd(), "with_env": with_env, "default": str(resolve_data_dir()),
                  "sizes": [len(train), len(test)]}))
"""


@pytest.mark.notebook
def test_a_kernel_started_in_notebooks_uses_the_course_data_folder(tmp_path, monkeypatch):
    """What a learner's kernel sees: it runs in notebooks/, the data lives in data/ above it."""
    import json

    import nbformat
    from nbclient import NotebookClient

    fake = tmp_path / "fake data"
    _write_fashionmnist(fake)
    monkeypatch.setenv("MGPU_DATA", str(fake))  # as the parametrised notebook tests set it
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(KERNEL_PROBE)]
    where = {"metadata": {"path": str(ROOT / "notebooks")}}  # nothing is written there
    NotebookClient(nb, timeout=120, kernel_name="python3", resources=where).execute()
    seen = json.loads(nb.cells[0].outputs[0]["text"])
    assert seen["cwd"] == str(ROOT / "notebooks")
    assert seen["with_env"] == str(fake) and seen["sizes"] == [20, 10]
    assert seen["default"] == str(ROOT / "data")  # not notebooks/data


def test_build_datasets_reads_mgpu_data_when_used(no_quick, tmp_path, monkeypatch):
    _write_fashionmnist(tmp_path)
    cfg = LessonConfig(dataset="fashionmnist")  # made before the variable is set
    monkeypatch.setenv("MGPU_DATA", str(tmp_path))
    train, test, _ = build_datasets(cfg)
    assert (len(train), len(test)) == (20, 10)


def test_torchvision_dataset_without_root_uses_the_course_data_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_DATA", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="empty"):
        torchvision_dataset("fashionmnist", train=False, download=False)


# --- loaders --------------------------------------------------------------------------------


class _FileLike(Dataset):
    """Stands for data read from files (not an in-memory TensorDataset)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.full((2,), float(i)), i


def test_loader_settings_in_memory_and_cpu_use_no_workers():
    tensors = TensorDataset(torch.zeros(4, 2))
    for device, dataset in [
        ("cpu", tensors),
        ("cpu", _FileLike()),
        (torch.device("cpu"), Subset(tensors, [0, 1])),
        ("cuda:0", tensors),  # in memory even on a GPU
        ("cuda:0", Subset(Subset(tensors, [0, 1, 2]), [0])),  # nested subsets are seen through
    ]:
        settings = loader_settings(device, dataset)
        assert settings["num_workers"] == 0
        assert settings["persistent_workers"] is False


def test_loader_settings_pin_memory_only_for_cuda():
    tensors = TensorDataset(torch.zeros(4, 2))
    assert loader_settings("cpu", tensors)["pin_memory"] is False
    assert loader_settings("meta", tensors)["pin_memory"] is False
    assert loader_settings("cuda:0", tensors)["pin_memory"] is True  # a string: needs no GPU
    assert loader_settings(torch.device("cuda", 1), tensors)["pin_memory"] is True


def test_loader_settings_file_data_on_cuda_gets_workers():
    settings = loader_settings("cuda:0", _FileLike())  # the GPU branch, computed without a GPU
    assert 1 <= settings["num_workers"] <= 4
    assert settings["persistent_workers"] is True
    assert settings["pin_memory"] is True


def test_make_loader_for_cuda_builds_without_a_gpu():
    loader = make_loader(TensorDataset(torch.arange(6.0)), 4, "cuda:0")
    assert loader.pin_memory is True and loader.num_workers == 0


@pytest.mark.parametrize("batch_size", [0, -1, True, 1.5, "4", None])
def test_make_loader_rejects_bad_batch_sizes(batch_size):
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        make_loader(TensorDataset(torch.zeros(4)), batch_size, "cpu")


def test_make_loader_refuses_shuffle_with_a_sampler():
    ds = TensorDataset(torch.zeros(4))
    sampler = DistributedSampler(ds, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="either shuffle=True or a sampler"):
        make_loader(ds, 2, "cpu", shuffle=True, sampler=sampler)
    loader = make_loader(ds, 2, "cpu", sampler=sampler)
    assert sum(len(b[0]) for b in loader) == 2  # rank 0's half


def _order(loader: DataLoader) -> list[int]:
    return [int(v) for (batch,) in loader for v in batch]


def test_make_loader_shuffle_is_deterministic_under_a_seed():
    ds = TensorDataset(torch.arange(50))
    first = _order(make_loader(ds, 7, "cpu", shuffle=True, seed=1))
    torch.manual_seed(999)  # the global RNG must not matter
    again = _order(make_loader(ds, 7, "cpu", shuffle=True, seed=1))
    other = _order(make_loader(ds, 7, "cpu", shuffle=True, seed=2))
    assert first == again
    assert first != other
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert _order(make_loader(ds, 7, "cpu")) == list(range(50))  # no shuffle: in order


def test_make_loader_reshuffles_each_epoch():
    loader = make_loader(TensorDataset(torch.arange(30)), 30, "cpu", shuffle=True, seed=0)
    assert _order(loader) != _order(loader)


def test_make_loader_drop_last():
    ds = TensorDataset(torch.arange(10))
    assert [len(b[0]) for b in make_loader(ds, 4, "cpu")] == [4, 4, 2]
    assert [len(b[0]) for b in make_loader(ds, 4, "cpu", drop_last=True)] == [4, 4]
