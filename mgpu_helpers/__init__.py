"""Helpers for the hands-on multi-GPU PyTorch course.

Each module is one idea a lesson teaches: ``devices`` (00, 01), ``config`` (every lesson),
``data``, ``models`` and ``train`` (02), ``timing`` (01), ``plots``, ``exercises`` and
``record`` (every lesson), ``course`` and ``student`` (running and handing out the course).
"""

from .config import DATASETS, LessonConfig, quick_from_env
from .data import DataInfo, build_datasets, loader_settings, make_loader
from .devices import Plan, course_plan, describe_hardware, gpu_count
from .exercises import check
from .models import build_model, count_parameters, mlp, resnet_cifar, small_cnn
from .plots import plot_history, plot_throughput
from .record import record
from .timing import Timing, measure, synchronize
from .train import History, evaluate, fit, pick_device, seed_everything, train_epoch

__all__ = [
    "DATASETS",
    "DataInfo",
    "History",
    "LessonConfig",
    "Plan",
    "Timing",
    "build_datasets",
    "build_model",
    "check",
    "count_parameters",
    "course_plan",
    "describe_hardware",
    "evaluate",
    "fit",
    "gpu_count",
    "loader_settings",
    "make_loader",
    "measure",
    "mlp",
    "pick_device",
    "plot_history",
    "plot_throughput",
    "quick_from_env",
    "record",
    "resnet_cifar",
    "seed_everything",
    "small_cnn",
    "synchronize",
    "train_epoch",
]

__version__ = "0.1.0"
