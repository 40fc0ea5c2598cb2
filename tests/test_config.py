"""LessonConfig: validation with messages that name the field, quick mode, MGPU_QUICK."""

from __future__ import annotations

import dataclasses

import pytest

from mgpu_helpers.config import DATASETS, MODELS, QUICK_LIMITS, LessonConfig, quick_from_env


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


def test_quick_mode_caps_epochs_and_samples(no_quick):
    cfg = LessonConfig(quick=True, epochs=50)
    assert cfg.epochs == QUICK_LIMITS["epochs"]
    assert cfg.train_samples == QUICK_LIMITS["train_samples"]
    assert cfg.test_samples == QUICK_LIMITS["test_samples"]


def test_quick_mode_keeps_smaller_values(no_quick):
    cfg = LessonConfig(
        quick=True, epochs=1, train_samples=10, test_samples=QUICK_LIMITS["test_samples"] + 1
    )
    assert (cfg.epochs, cfg.train_samples) == (1, 10)
    assert cfg.test_samples == QUICK_LIMITS["test_samples"]


def test_quick_mode_still_validates_first(no_quick):
    with pytest.raises(ValueError, match="epochs"):
        LessonConfig(quick=True, epochs=0)


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
    assert LessonConfig().quick is expected  # read when the config is built, not at import


def test_quick_from_env_unset_means_full(no_quick):
    assert quick_from_env() is False


@pytest.mark.parametrize("value", ["2", "maybe", "quick", "-1"])
def test_quick_from_env_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("MGPU_QUICK", value)
    with pytest.raises(ValueError, match=f"MGPU_QUICK must be 1 or 0.*{value.strip().lower()!r}"):
        quick_from_env()
    with pytest.raises(ValueError, match="MGPU_QUICK"):
        LessonConfig()


def test_explicit_quick_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("MGPU_QUICK", "1")
    assert LessonConfig(quick=False).epochs == 10
    monkeypatch.setenv("MGPU_QUICK", "0")
    assert LessonConfig(quick=True).epochs == QUICK_LIMITS["epochs"]


def test_replace_changes_fields_and_keeps_the_rest(no_quick):
    cfg = LessonConfig(batch_size=32, seed=7)
    new = cfg.replace(dataset="synthetic", epochs=3)
    assert (new.dataset, new.epochs, new.batch_size, new.seed) == ("synthetic", 3, 32, 7)
    assert cfg.dataset == "digits"  # the original is untouched


@pytest.mark.parametrize(
    "change", [{"batch_size": 0}, {"dataset": "imagenet"}, {"lr": -1.0}, {"momentum": 1.0}]
)
def test_replace_revalidates(no_quick, change):
    with pytest.raises(ValueError, match=next(iter(change))):
        LessonConfig().replace(**change)


def test_replace_applies_quick_caps(no_quick):
    assert LessonConfig(epochs=20).replace(quick=True).epochs == QUICK_LIMITS["epochs"]
    quick = LessonConfig(quick=True)
    assert quick.replace(epochs=100).epochs == QUICK_LIMITS["epochs"]


def test_describe_lists_every_field_and_the_quick_note(no_quick):
    text = LessonConfig(quick=True).describe()
    for f in dataclasses.fields(LessonConfig):
        assert f.name in text
    assert "MGPU_QUICK=0" in text
    assert "quick mode" not in LessonConfig(quick=False).describe()


def test_leaving_quick_mode_restores_the_requested_sizes(no_quick):
    quick = LessonConfig(epochs=20, train_samples=5000, quick=True)
    assert (quick.epochs, quick.train_samples) == (
        QUICK_LIMITS["epochs"],
        QUICK_LIMITS["train_samples"],
    )
    full = quick.replace(quick=False)
    assert (full.epochs, full.train_samples, full.test_samples) == (20, 5000, None)
    assert quick.replace(quick=False, epochs=7).epochs == 7
