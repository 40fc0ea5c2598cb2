"""Lesson 02, section 9: the data set with per-sample CPU work, and the lesson's loader code.

``EncodedImages`` (the package) must survive DataLoader workers started with spawn, as on
macOS and Windows; the lesson's ``data_loader`` and ``data_epoch`` are read from its notebook.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import pickle
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from mgpu_helpers.config import LessonConfig
from mgpu_helpers.data import EncodedImages
from mgpu_helpers.lesson_code import load_lesson_code, python_only

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks/02_single_device_baseline.ipynb"


def lesson_code(device: torch.device) -> SimpleNamespace:
    """Lesson 02's data_loader and data_epoch, with batches of 8 going to ``device``."""
    namespace = {
        "DataLoader": DataLoader,
        "cfg": LessonConfig(batch_size=8, seed=0),
        "device": device,
        "time": time,
        "torch": torch,
    }
    return load_lesson_code("02", ["data_loader", "data_epoch"], namespace)


LESSON = lesson_code(torch.device("cpu"))


def test_encoded_images_decode_to_normalised_images_with_fixed_labels() -> None:
    ds = EncodedImages(20, side=16, channels=3, num_classes=7, blur_passes=2, seed=3)
    assert len(ds) == 20
    image, label = ds[5]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    assert (
        0 <= int(label) < 7
        and label == EncodedImages(20, side=16, channels=3, num_classes=7, seed=3).labels[5]
    )
    assert image.abs().max() < 2.5  # (pixel - 0.5) / 0.25, blurred: within [-2, 2]
    again = ds[5][0]
    assert image.shape == again.shape  # crops and flips are random, the size is not


def test_return_index_adds_each_samples_index() -> None:
    ds = EncodedImages(6, return_index=True, blur_passes=0)
    assert [int(ds[i][2]) for i in range(6)] == list(range(6))


@pytest.mark.parametrize(
    "kwargs", [{"n": 0}, {"side": 2}, {"channels": 0}, {"blur_passes": -1}, {"n": 2.5}]
)
def test_bad_sizes_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="whole number"):
        EncodedImages(**kwargs)


def test_workers_started_by_spawn_can_load_it() -> None:
    """A class from the package pickles by reference: spawn workers (macOS, Windows) find it."""
    ds = EncodedImages(10, return_index=True, blur_passes=1)
    assert pickle.loads(pickle.dumps(ds)).labels.tolist() == ds.labels.tolist()
    loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    indices = torch.cat([i for _, _, i in loader]).tolist()
    assert indices == list(range(10))


def test_the_lessons_loader_delivers_every_sample_once_per_epoch_with_workers() -> None:
    ds = EncodedImages(21, return_index=True, blur_passes=0)
    loader = LESSON.data_loader(ds, 2)
    assert loader.persistent_workers and loader.num_workers == 2
    orders = [torch.cat([i for _, _, i in loader]).tolist() for _ in range(2)]
    assert all(sorted(o) == list(range(21)) for o in orders)
    assert orders[0] != orders[1]


def test_data_epoch_trains_on_every_batch_and_clocks_the_wait() -> None:
    ds = EncodedImages(20, blur_passes=1)
    seen = []
    start = time.perf_counter()
    waited = LESSON.data_epoch(LESSON.data_loader(ds, 0), lambda x, y: seen.append(len(x)))
    assert seen == [8, 8, 4]
    assert 0 < waited <= time.perf_counter() - start


def test_workers_stop_at_the_end_of_each_epoch_unless_they_persist() -> None:
    before = set(multiprocessing.active_children())
    ds = EncodedImages(20, blur_passes=1)
    assert LESSON.data_epoch(LESSON.data_loader(ds, 1, persistent=False)) > 0  # no step: reads
    assert set(multiprocessing.active_children()) - before == set()
    loader = LESSON.data_loader(ds, 1)
    LESSON.data_epoch(loader)
    assert len(set(multiprocessing.active_children()) - before) == 1, "the worker persists"
    del loader
    gc.collect()
    assert set(multiprocessing.active_children()) - before == set(), "dropped with its loader"


def test_the_blur_averages_neighbours_and_keeps_a_flat_image() -> None:
    from mgpu_helpers.data import _box_blur

    flat = torch.full((1, 5, 5), 2.0)
    torch.testing.assert_close(_box_blur(flat), flat)
    impulse = torch.zeros(1, 5, 5)
    impulse[0, 2, 2] = 9.0
    blurred = _box_blur(impulse)
    torch.testing.assert_close(blurred[0, 1:4, 1:4], torch.ones(3, 3))
    assert blurred.sum() == 9.0


def lesson_cell(cell_id: str) -> str:
    """The Python source of lesson 02's code cell ``cell_id``."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return python_only("".join(next(c for c in cells if c.get("id") == cell_id)["source"]))


PINNING_CELL, CLEANUP_CELL = "4d2a5c6b", "5fdf3965"  # section 9's pin_memory and clean-up cells


def test_the_pinning_cell_on_a_device_that_is_neither_cpu_nor_cuda_says_why_it_skips(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On MPS the batches are not "already where the step runs": the lesson pins for CUDA only."""
    exec(lesson_cell(PINNING_CELL), {"device": torch.device("mps")})  # touches no MPS tensor
    printed = capsys.readouterr().out
    assert "CUDA only" in printed and "already where the step runs" not in printed


def test_the_cleanup_cell_drops_the_loaders_and_can_run_twice() -> None:
    namespace = {
        "gc": gc,
        "multiprocessing": multiprocessing,
        "torch": torch,
        "children_before": set(multiprocessing.active_children()),
        "main_threads": torch.get_num_threads(),
        "loaders": {"1 worker": LESSON.data_loader(EncodedImages(8, blur_passes=0), 1)},
        "index_loader": LESSON.data_loader(EncodedImages(8, blur_passes=0), 1),
        "host": torch.zeros(4),
        "pinned": torch.zeros(4),
    }
    for loader in (*namespace["loaders"].values(), namespace["index_loader"]):
        next(iter(loader))  # starts the persistent workers
    del loader  # the namespace holds the only references, as the kernel's globals do
    for _ in range(2):  # a learner may run it again
        exec(lesson_cell(CLEANUP_CELL), namespace)
    assert not {"loaders", "index_loader", "host", "pinned"} & namespace.keys()


@pytest.mark.gpu
def test_on_a_gpu_the_lessons_loader_pins_and_the_step_gets_device_batches() -> None:
    dev = torch.device("cuda:0")
    gpu = lesson_code(dev)
    loader = gpu.data_loader(EncodedImages(20, blur_passes=1), 1)
    assert loader.pin_memory
    x, _ = next(iter(loader))
    assert x.is_pinned(), "pin_memory=True hands out pinned batches"
    devices = []
    gpu.data_epoch(loader, lambda x, y: devices.append((x.device, y.device)))
    assert devices and all(d == (dev, dev) for d in devices)
