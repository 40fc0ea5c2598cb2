"""Lesson parameters in one validated dataclass (every lesson's first cells).

The ``parameters`` cell holds plain values; the next builds the config from them:
``cfg = apply_quick(LessonConfig(...))``. Change it with ``dataclasses.replace``. Quick mode
(``MGPU_QUICK=1``) caps data and epochs so the course runs in minutes on a laptop (the tests use
it). Data is found from the course's top folder, not from where a kernel runs.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

__all__ = [
    "DATASETS",
    "MODELS",
    "QUICK_LIMITS",
    "LessonConfig",
    "apply_quick",
    "course_root",
    "grading_from_env",
    "quick_from_env",
    "resolve_data_dir",
]

DATASETS = ("digits", "fashionmnist", "cifar10", "synthetic")
MODELS = ("auto", "cnn", "resnet", "mlp")

# What quick mode caps: at most this many epochs and samples per split.
# Enough for the digits to reach roughly 90% test accuracy, so quick runs still show learning.
QUICK_LIMITS = {"epochs": 3, "train_samples": 1024, "test_samples": 256}


def _flag_from_env(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 1 or 0 (or true/false), got {value!r}")


def quick_from_env() -> bool:
    """True when ``MGPU_QUICK`` is set to 1/true/yes (how `make course QUICK=1` and tests ask)."""
    return _flag_from_env("MGPU_QUICK")


def grading_from_env() -> bool:
    """True when ``MGPU_GRADING`` is 1/true/yes: an autograder runs the notebook (``check``)."""
    return _flag_from_env("MGPU_GRADING")


def course_root() -> Path:
    """The course's top folder, the one that holds ``notebooks/`` and ``mgpu_helpers/``.

    Taken from where this package lives when it is used from the course's folder (``make`` and
    ``environment.yml`` install it in editable mode), else the first folder holding both, from
    the working directory upwards; the working directory when neither finds one.
    """
    cwd = Path.cwd().resolve()
    for folder in (Path(__file__).resolve().parents[1], cwd, *cwd.parents):
        if (folder / "notebooks").is_dir() and (folder / "mgpu_helpers").is_dir():
            return folder
    return cwd


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder torchvision data sets are read from and downloaded to (lesson 02 on).

    ``data_dir`` when given; else the ``MGPU_DATA`` environment variable when set; else
    ``data/`` in the course's top folder. A relative path is taken from the course's top folder,
    never from the working directory (kernels run in ``notebooks/``).
    """
    if data_dir is None:
        data_dir = os.environ.get("MGPU_DATA", "").strip() or "data"
    path = Path(data_dir).expanduser()
    return path if path.is_absolute() else course_root() / path


@dataclass(frozen=True)
class LessonConfig:
    """Parameters shared by the lessons. Invalid values raise ``ValueError`` naming the field."""

    dataset: str = "digits"  # one of DATASETS; "digits" ships with scikit-learn (no download)
    model: str = "auto"  # one of MODELS; "auto" picks the model that suits the dataset
    batch_size: int = 64  # global batch: split across devices in the multi-device lessons
    epochs: int = 10  # passes over the training set
    lr: float = 0.05  # SGD learning rate
    momentum: float = 0.9  # SGD momentum
    world_size: int = 2  # processes/devices for the multi-device lessons
    seed: int = 0  # seeds torch, numpy and Python's random, and the data order
    # True once apply_quick capped epochs and samples (tests, laptops); set it through apply_quick
    quick: bool = False
    train_samples: int | None = None  # cap on training samples (None: all; quick mode caps)
    test_samples: int | None = None  # cap on test samples (None: all; quick mode caps)
    # where torchvision data sets are read and downloaded; None: $MGPU_DATA, else data/ in the
    # course's top folder (relative paths too are taken from there: resolve_data_dir)
    data_dir: str | os.PathLike[str] | None = None
    progress: bool = True  # show tqdm progress bars
    # Random crops and flips of CIFAR-10's training images. False for a run that must match
    # another run sample for sample (lesson 04b's DDP-vs-one-device comparison): each process draws
    # the augmentation from its own random generator, so two runs would see different images.
    augment: bool = True

    def __post_init__(self) -> None:
        for name, choices in (("dataset", DATASETS), ("model", MODELS)):
            if getattr(self, name) not in choices:
                value = getattr(self, name)
                raise ValueError(f"{name}={value!r} is unknown; choose one of {', '.join(choices)}")
        for name in ("batch_size", "epochs", "world_size", "train_samples", "test_samples"):
            value = getattr(self, name)
            if value is None and name.endswith("_samples"):
                continue  # no cap: all samples
            if not (_is_number(value) and isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if not (_is_number(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a number > 0, got {self.lr!r}")
        if not (_is_number(self.momentum) and 0 <= self.momentum < 1):
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if not (_is_number(self.seed) and isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("augment", "quick"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.data_dir is not None and not (
            isinstance(self.data_dir, (str, os.PathLike)) and str(self.data_dir)
        ):
            raise ValueError(f"data_dir must be a folder (a path) or None, got {self.data_dir!r}")
        # quick=True promises the caps: say how to get them rather than cap silently.
        over = [
            f"{name}={getattr(self, name)}"
            for name, cap in QUICK_LIMITS.items()
            if self.quick and (getattr(self, name) is None or getattr(self, name) > cap)
        ]
        if over:
            raise ValueError(
                f"quick=True marks a config that quick mode capped, but {', '.join(over)} "
                f"exceed QUICK_LIMITS {QUICK_LIMITS}; build it with "
                "apply_quick(LessonConfig(...), True) instead of passing quick=True"
            )

    def describe(self) -> str:
        """One readable line per field, with a note when quick mode shrank the run."""
        values = asdict(self)
        values["data_dir"] = resolve_data_dir(self.data_dir)  # the folder actually used
        lines = [f"{k:>14}: {v}" for k, v in values.items()]
        if self.quick:
            lines.append("    quick mode: epochs and samples capped (set MGPU_QUICK=0 for full)")
        return "\n".join(lines)


def apply_quick(cfg: LessonConfig, quick: bool | None = None) -> LessonConfig:
    """``cfg`` with epochs and sample counts capped by ``QUICK_LIMITS`` (every lesson's 2nd cell).

    ``quick=None`` reads ``MGPU_QUICK``. Off: ``cfg`` itself; on: a copy with ``quick=True``.
    """
    quick = quick_from_env() if quick is None else quick
    if not isinstance(quick, bool):
        raise ValueError(f"quick must be True, False or None (read MGPU_QUICK), got {quick!r}")
    if not quick:
        return cfg
    caps = {
        name: limit if getattr(cfg, name) is None else min(getattr(cfg, name), limit)
        for name, limit in QUICK_LIMITS.items()
    }
    return replace(cfg, quick=True, **caps)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # True is not a rate
