"""Lesson 05's split model and GPipe step, for the tests.

The lesson writes ``SplitModel``, ``cut``, ``copy_streams``, ``send``, ``receive`` and
``gpipe_step`` in its cells; ``benchmarks/pipeline.py`` carries the same code, and
:func:`lesson_definitions` lets tests/test_pipeline_benchmark.py check that the two agree, so the
tests can run the benchmark's copy (:data:`lesson`) as the lesson's.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "05_model_parallel.ipynb"
BENCHMARK = ROOT / "benchmarks" / "pipeline.py"
NAMES = ("SplitModel", "cut", "Streams", "copy_streams", "send", "receive", "gpipe_step")


def _load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lesson05_pipeline", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


lesson = _load_benchmark()


def split_sequential(model: nn.Sequential, cuts: list[int], devices: list[str]) -> nn.Module:
    """The lesson's ``SplitModel(cut(model, cuts), devices)``."""
    return lesson.SplitModel(lesson.cut(model, cuts), [torch.device(d) for d in devices])


def _top_level(tree: ast.Module) -> dict[str, str]:
    """Each top-level function, class and assignment of NAMES, as a normalised AST dump."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        if name in NAMES:
            found[name] = ast.dump(node, include_attributes=False)
    return found


def lesson_definitions() -> dict[str, str]:
    """NAMES as lesson 05's code cells define them (IPython magics left out)."""
    import nbformat  # here: the GPU machine runs the other tests without Jupyter

    found: dict[str, str] = {}
    for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        lines = [ln for ln in cell.source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
        found.update(_top_level(ast.parse("\n".join(lines))))
    return found


def benchmark_definitions() -> dict[str, str]:
    """NAMES as benchmarks/pipeline.py defines them."""
    return _top_level(ast.parse(BENCHMARK.read_text()))
