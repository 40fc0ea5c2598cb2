"""Helpers for the hands-on multi-GPU PyTorch course, in two halves.

**Lesson helpers** (this folder): what a notebook imports to learn multi-GPU training, each
module one idea a lesson teaches: ``devices`` and ``doctor`` (00, 01), ``config`` (every
lesson), ``data``, ``models`` and ``train`` (02), ``timing`` (01), ``data_parallel`` (03),
``launch`` and ``ddp`` (04), ``model_parallel`` (05), ``plots``, ``exercises`` and ``record``
(every lesson). Import each name from the module that defines it.

**Course tooling** (``tooling/``): the ``mgpu`` command, the headless course runner and its
report, the student edition and the notebook file rules. Tooling imports helpers; no helper
imports tooling.

The names below are imported on first use, not when the package is imported: every process the
launcher starts imports this package, and should not pay for matplotlib or scikit-learn
unless its worker uses them.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_WHERE = {
    "DATASETS": "config",
    "LessonConfig": "config",
    "quick_from_env": "config",
    "DataInfo": "data",
    "build_datasets": "data",
    "loader_settings": "data",
    "make_loader": "data",
    "Plan": "devices",
    "course_plan": "devices",
    "describe_hardware": "devices",
    "gpu_count": "devices",
    "check": "exercises",
    "DistEnv": "launch",
    "WorkerError": "launch",
    "build_model": "models",
    "count_parameters": "models",
    "mlp": "models",
    "resnet_cifar": "models",
    "small_cnn": "models",
    "plot_history": "plots",
    "plot_throughput": "plots",
    "progress_bar": "progress",
    "Comparison": "timing",
    "Timing": "timing",
    "compare": "timing",
    "measure_alternating": "timing",
    "measure": "timing",
    "synchronize": "timing",
    "History": "train",
    "evaluate": "train",
    "fit": "train",
    "pick_device": "train",
    "seed_everything": "train",
    "train_epoch": "train",
}

# ``record`` shares its name with its module: once anything imports ``mgpu_helpers.record``, the
# import system sets the package's attribute ``record`` to that module, and the look-up below is
# never asked. Binding the function here, after that import, keeps ``from mgpu_helpers import
# record`` the function everywhere (record.py needs only json and math, so this costs nothing).
# ``launch`` is the module; its function is imported from it (``from mgpu_helpers.launch import
# launch``).
from .record import record as record  # noqa: E402

__all__ = sorted([*_WHERE, "record"])

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mgpu_helpers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
