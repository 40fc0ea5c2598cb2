"""LessonConfig: validation with messages that name the field, quick mode, MGPU_QUICK."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from mgpu_helpers.config import (
    DATASETS,
    MODELS,
    QUICK_LIMITS,
    LessonConfig,
    apply_quick,
    course_root,
    quick_from_env,
    resolve_data_dir,
)


def test_defaults_are_full_size_without_quick_mode(no_quick):
    cfg = LessonConfig()
    assert cfg.quick is False
    assert cfg.dataset == "digits"  # the offline default
    assert cfg.epochs == 10
    assert cfg.train_samples is None and cfg.test_samples is None


@pytest.mark.parametrize("field", ["batch_size", "epochs", "world_size"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "8", None])
def test_positive_int_fields_reject_bad_values(no_quick, field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be a whole number >= 1, got {value!r}"):
        LessonConfig(**{field: value})


@pytest.mark.parametrize("field", ["train_samples", "test_samples"])
@pytest.mark.parametrize("value", [0, -5, False, 2.0])
def test_sample_caps_reject_bad_values(no_quick, field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be a whole number >= 1"):
        LessonConfig(**{field: value})


def test_world_size_one_is_allowed(no_quick):
    assert LessonConfig(world_size=1).world_size == 1
    with pytest.raises(ValueError, match="world_size"):
        LessonConfig(world_size=0)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [("dataset", "mnist", DATASETS), ("model", "vgg", MODELS), ("dataset", "Digits", DATASETS)],
)
def test_unknown_names_are_rejected_with_the_choices(no_quick, field, value, allowed):
    with pytest.raises(ValueError) as info:
        LessonConfig(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}={value!r} is unknown")
    for name in allowed:
        assert name in message


@pytest.mark.parametrize("lr", [0, -0.1, float("nan"), "0.1", None, True])
def test_lr_must_be_a_positive_number(no_quick, lr):
    with pytest.raises(ValueError, match="^lr must be a number > 0"):
        LessonConfig(lr=lr)


@pytest.mark.parametrize("momentum", [-0.1, 1, 1.5, "0.9", None, False])
def test_momentum_must_be_in_unit_interval(no_quick, momentum):
    with pytest.raises(ValueError, match=r"^momentum must be in \[0, 1\)"):
        LessonConfig(momentum=momentum)


def test_valid_numbers_are_kept(no_quick):
    cfg = LessonConfig(lr=1, momentum=0, batch_size=1, seed=-3)
    assert (cfg.lr, cfg.momentum, cfg.batch_size, cfg.seed) == (1, 0, 1, -3)


@pytest.mark.parametrize("seed", [1.0, "0", None, True])
def test_seed_must_be_an_integer(no_quick, seed):
    with pytest.raises(ValueError, match="^seed must be an integer"):
        LessonConfig(seed=seed)


def test_config_is_frozen(no_quick):
    cfg = LessonConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 3  # type: ignore[misc]


def test_quick_true_without_the_caps_is_refused_with_the_fix(no_quick):
    with pytest.raises(ValueError, match=r"epochs=50.*apply_quick\(LessonConfig\(\.\.\.\), True\)"):
        LessonConfig(quick=True, epochs=50, train_samples=10, test_samples=10)
    with pytest.raises(ValueError, match="train_samples=None"):  # None means all: not capped
        LessonConfig(quick=True, epochs=1)


def test_quick_true_with_the_caps_is_a_valid_value(no_quick):
    cfg = LessonConfig(quick=True, epochs=1, train_samples=10, test_samples=10)
    assert (cfg.quick, cfg.epochs, cfg.train_samples, cfg.test_samples) == (True, 1, 10, 10)


@pytest.mark.parametrize("quick", [1, "yes", None])
def test_quick_must_be_a_bool(no_quick, quick):
    with pytest.raises(ValueError, match="^quick must be True or False"):
        LessonConfig(quick=quick)


def test_validation_never_changes_a_field(no_quick):
    values = {"epochs": 50, "train_samples": 100_000, "test_samples": None, "quick": False}
    cfg = LessonConfig(**values)
    assert {k: getattr(cfg, k) for k in values} == values
    assert set(vars(cfg)) == {f.name for f in dataclasses.fields(LessonConfig)}  # no hidden state


def test_the_config_is_a_plain_dataclass(no_quick):
    assert not hasattr(LessonConfig, "replace"), "use dataclasses.replace(cfg, ...)"
    cfg = LessonConfig(epochs=20)
    assert dataclasses.replace(cfg, quick=False) == cfg


@pytest.mark.parametrize("value", ["1", "0", "yes please"])
def test_building_a_config_ignores_mgpu_quick(monkeypatch, value):
    monkeypatch.setenv("MGPU_QUICK", value)  # only apply_quick reads it, even when it is bad
    cfg = LessonConfig()
    assert cfg.quick is False and cfg.epochs == 10 and cfg.train_samples is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("true", True),
        (" YES ", True),
        ("on", True),
        ("0", False),
        ("", False),
        ("False", False),
        ("no", False),
        ("off", False),
    ],
)
def test_quick_from_env_parses_the_usual_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("MGPU_QUICK", value)
    assert quick_from_env() is expected
    assert apply_quick(LessonConfig()).quick is expected  # read when applied, not at import


def test_quick_from_env_unset_means_full(no_quick):
    assert quick_from_env() is False


@pytest.mark.parametrize("value", ["2", "maybe", "quick", "-1"])
def test_quick_from_env_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("MGPU_QUICK", value)
    with pytest.raises(ValueError, match=f"MGPU_QUICK must be 1 or 0.*{value.strip().lower()!r}"):
        quick_from_env()
    with pytest.raises(ValueError, match="MGPU_QUICK"):
        apply_quick(LessonConfig())


def test_dataclasses_replace_changes_fields_and_keeps_the_rest(no_quick):
    cfg = LessonConfig(batch_size=32, seed=7)
    new = dataclasses.replace(cfg, dataset="synthetic", epochs=3)
    assert (new.dataset, new.epochs, new.batch_size, new.seed) == ("synthetic", 3, 32, 7)
    assert cfg.dataset == "digits"  # the original is untouched


@pytest.mark.parametrize(
    "change", [{"batch_size": 0}, {"dataset": "imagenet"}, {"lr": -1.0}, {"momentum": 1.0}]
)
def test_dataclasses_replace_revalidates(no_quick, change):
    with pytest.raises(ValueError, match=next(iter(change))):
        dataclasses.replace(LessonConfig(), **change)


def test_describe_lists_every_field_and_the_quick_note(no_quick):
    text = apply_quick(LessonConfig(), True).describe()
    for f in dataclasses.fields(LessonConfig):
        assert f.name in text
    assert "MGPU_QUICK=0" in text
    assert "quick mode" not in LessonConfig(quick=False).describe()


# --- apply_quick: quick mode as one explicit function that returns a new config -------------


def test_apply_quick_caps_every_limited_field_and_marks_the_config(no_quick):
    cfg = LessonConfig(epochs=50, train_samples=100_000, batch_size=32)
    quick = apply_quick(cfg, True)
    assert quick.quick is True
    assert (quick.epochs, quick.train_samples, quick.test_samples) == (
        QUICK_LIMITS["epochs"],
        QUICK_LIMITS["train_samples"],
        QUICK_LIMITS["test_samples"],
    )
    assert quick.batch_size == 32  # fields quick mode does not limit are kept
    assert (cfg.epochs, cfg.train_samples) == (50, 100_000)  # the original never changes


def test_apply_quick_keeps_values_already_under_the_limits(no_quick):
    cfg = LessonConfig(epochs=1, train_samples=10, test_samples=QUICK_LIMITS["test_samples"] + 1)
    quick = apply_quick(cfg, True)
    assert (quick.epochs, quick.train_samples) == (1, 10)
    assert quick.test_samples == QUICK_LIMITS["test_samples"]


def test_apply_quick_off_returns_the_same_config(no_quick):
    cfg = LessonConfig(epochs=50)
    assert apply_quick(cfg, False) is cfg
    assert apply_quick(cfg) is cfg  # MGPU_QUICK unset: full size


@pytest.mark.parametrize(("value", "expected_epochs"), [("1", 3), ("yes", 3), ("0", 20)])
def test_apply_quick_reads_mgpu_quick_when_not_told(monkeypatch, value, expected_epochs):
    monkeypatch.setenv("MGPU_QUICK", "0")
    cfg = LessonConfig(epochs=20)
    monkeypatch.setenv("MGPU_QUICK", value)
    assert QUICK_LIMITS["epochs"] == 3
    assert apply_quick(cfg).epochs == expected_epochs


def test_apply_quick_explicit_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("MGPU_QUICK", "0")
    cfg = LessonConfig(epochs=20)
    monkeypatch.setenv("MGPU_QUICK", "1")
    assert apply_quick(cfg, False).epochs == 20
    monkeypatch.setenv("MGPU_QUICK", "0")
    assert apply_quick(cfg, True).epochs == QUICK_LIMITS["epochs"]


def test_apply_quick_is_idempotent(no_quick):
    once = apply_quick(LessonConfig(epochs=50), True)
    assert apply_quick(once, True) == once


@pytest.mark.parametrize("quick", ["1", 1, "yes"])
def test_apply_quick_rejects_a_non_bool_quick(no_quick, quick):
    with pytest.raises(ValueError, match="quick must be True, False or None"):
        apply_quick(LessonConfig(), quick)


def test_dataclasses_replace_keeps_the_applied_caps(no_quick):
    quick = apply_quick(LessonConfig(epochs=50), True)
    changed = dataclasses.replace(quick, batch_size=16)
    assert changed.quick is True and changed.epochs == QUICK_LIMITS["epochs"]
    assert changed.batch_size == 16


# --- the data folder (resolved when used, from the course's top folder) --------------------

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_data_env(monkeypatch):
    monkeypatch.delenv("MGPU_DATA", raising=False)


def test_course_root_is_the_checkout_whatever_the_working_directory(tmp_path, monkeypatch):
    assert course_root() == ROOT
    monkeypatch.chdir(ROOT / "notebooks")  # where kernels run
    assert course_root() == ROOT
    monkeypatch.chdir(tmp_path)
    assert course_root() == ROOT


def test_data_dir_default_is_data_in_the_course_root(no_quick, no_data_env, monkeypatch):
    assert LessonConfig().data_dir is None  # nothing computed when the config is made
    monkeypatch.chdir(ROOT / "notebooks")
    assert resolve_data_dir() == ROOT / "data"
    assert resolve_data_dir(LessonConfig().data_dir) == ROOT / "data"
    assert resolve_data_dir("data") == ROOT / "data"  # relative: from the root, not the cwd
    assert resolve_data_dir("elsewhere/sets") == ROOT / "elsewhere" / "sets"


def test_mgpu_data_wins_over_the_default_when_set(no_quick, tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_DATA", str(tmp_path))
    assert resolve_data_dir() == tmp_path
    assert resolve_data_dir(LessonConfig().data_dir) == tmp_path  # read when used
    monkeypatch.setenv("MGPU_DATA", "")  # set but empty: as if unset
    assert resolve_data_dir() == ROOT / "data"
    monkeypatch.setenv("MGPU_DATA", "shared/data")
    assert resolve_data_dir() == ROOT / "shared" / "data"


def test_an_explicit_data_dir_wins_over_mgpu_data(no_quick, tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_DATA", str(tmp_path / "env"))
    assert resolve_data_dir(tmp_path / "mine") == tmp_path / "mine"
    assert resolve_data_dir(LessonConfig(data_dir=str(tmp_path)).data_dir) == tmp_path


@pytest.mark.parametrize("value", ["", 3, ["data"], False])
def test_data_dir_must_be_a_path_or_none(no_quick, value):
    with pytest.raises(ValueError, match="^data_dir must be a folder"):
        LessonConfig(data_dir=value)


def test_describe_shows_the_data_folder_actually_used(no_quick, tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_DATA", str(tmp_path))
    assert f"data_dir: {tmp_path}" in LessonConfig().describe()


# --- the docs quote quick mode's caps from the code ----------------------------------------

NUMBER = r"(\d[\d,]*)"
CLAIMS = {  # what a sentence about quick mode may say, and the cap it must agree with
    rf"{NUMBER}\s+epochs?\b": "epochs",
    rf"epochs? (?:at|to) {NUMBER}\b": "epochs",
    rf"{NUMBER}\s+training samples": "train_samples",
    rf"{NUMBER}\s+test samples": "test_samples",
}


def _quick_paragraphs() -> list[tuple[str, str]]:
    """(file, paragraph) for every paragraph of README.md and docs/ that speaks of quick mode."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for paragraph in path.read_text().split("\n\n"):
            if re.search(r"quick mode|MGPU_QUICK|QUICK=1|QUICK_LIMITS", paragraph, re.I):
                found.append((path.name, " ".join(paragraph.split())))
    return found


def test_docs_quote_the_quick_limits_of_the_code():
    source = (ROOT / "mgpu_helpers" / "config.py").read_text()
    (line,) = [x for x in source.splitlines() if x.startswith("QUICK_LIMITS = ")]
    assert line in (ROOT / "docs" / "instructors.md").read_text(), (
        "docs/instructors.md must quote QUICK_LIMITS as config.py has it"
    )
    assert ast.literal_eval(line.partition("=")[2].strip()) == QUICK_LIMITS


def test_every_number_the_docs_give_for_quick_mode_matches_the_code():
    checked = 0
    for name, paragraph in _quick_paragraphs():
        for pattern, key in CLAIMS.items():
            for match in re.finditer(pattern, paragraph):
                value = int(match.group(1).replace(",", ""))
                assert value == QUICK_LIMITS[key], (
                    f"{name} says '{match.group(0)}' about quick mode; the code caps "
                    f"{key} at {QUICK_LIMITS[key]} (QUICK_LIMITS in mgpu_helpers/config.py): "
                    f"{paragraph[:200]}"
                )
                checked += 1
    assert checked >= 3, "the docs should state each of quick mode's caps"
