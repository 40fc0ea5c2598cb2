"""Lesson 05's split model and pipeline steps, for the tests: the lesson's own code, from its cells.

Part 05a writes ``SplitModel``, ``cut``, ``copy_streams``, ``send``, ``receive`` and
``gpipe_step`` in its cells; ``benchmarks/pipeline.py`` reads them from the notebook with
``load_lesson_code`` (with the names they use), and :data:`lesson` is that same object, so the
tests and the benchmark run the lesson's code and no copy exists to drift from it. Part 05b
writes ``one_f_one_b_order`` and ``one_f_one_b_step`` with 05a's ``send`` and ``receive``:
:data:`schedules` holds them, run in a namespace with 05a's definitions.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

from mgpu_helpers.lesson_code import load_lesson_code

ROOT = Path(__file__).resolve().parents[1]


_spec = importlib.util.spec_from_file_location(
    "lesson05_pipeline", ROOT / "benchmarks" / "pipeline.py"
)
assert _spec is not None and _spec.loader is not None
_pipeline = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _pipeline  # pytest imports this module once: one load of the lesson
_spec.loader.exec_module(_pipeline)
NAMES, lesson = _pipeline.NAMES, _pipeline.lesson
schedules = load_lesson_code(
    "05b",
    ["one_f_one_b_order", "one_f_one_b_step"],
    {**vars(_pipeline), **vars(lesson), "__name__": "lesson05b"},
    folder=ROOT / "notebooks",
)


def split_sequential(model: nn.Sequential, cuts: list[int], devices: list[str]) -> nn.Module:
    """The lesson's ``SplitModel(cut(model, cuts), devices)``."""
    return lesson.SplitModel(lesson.cut(model, cuts), [torch.device(d) for d in devices])
