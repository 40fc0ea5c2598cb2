"""Lesson 05's split model and GPipe step, for the tests: the lesson's own code, from its cells.

The lesson writes ``SplitModel``, ``cut``, ``copy_streams``, ``send``, ``receive`` and
``gpipe_step`` in its cells; :data:`lesson` holds them as the notebook defines them (read with
``load_lesson_code``, as ``benchmarks/pipeline.py`` reads them), so the tests run the lesson's
code and no copy exists to drift from it.
"""

from __future__ import annotations

import queue
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mgpu_helpers.lesson_code import load_lesson_code
from mgpu_helpers.model_parallel import Event, Timeline, run_stages

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("SplitModel", "cut", "Streams", "copy_streams", "send", "receive", "gpipe_step")
# the names the lesson's code uses: its imports
NAMESPACE = {
    "Event": Event,
    "F": F,
    "Tensor": Tensor,
    "Timeline": Timeline,
    "nn": nn,
    "queue": queue,
    "run_stages": run_stages,
    "torch": torch,
}

lesson = load_lesson_code("05", NAMES, dict(NAMESPACE), folder=ROOT / "notebooks")


def split_sequential(model: nn.Sequential, cuts: list[int], devices: list[str]) -> nn.Module:
    """The lesson's ``SplitModel(cut(model, cuts), devices)``."""
    return lesson.SplitModel(lesson.cut(model, cuts), [torch.device(d) for d in devices])
