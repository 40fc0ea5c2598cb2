"""record(): what the notebook shows is rounded; what the report gets is the exact value."""

from __future__ import annotations

import math

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from mgpu_helpers.record import RESULT_MIME, format_value, record


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (1585.8586899179115, "1586"),
        (123456.789, "123457"),
        (0.96875, "0.9688"),
        (12.3456789, "12.35"),
        (3.14159e-7, "3.14e-07"),
        (-2.5e-5, "-2.50e-05"),
        (0.0, "0"),
        (2.0, "2"),
        (float("nan"), "nan"),
        (7, "7"),
        (True, "True"),
        ("cuda:0", "cuda:0"),
        ([1585.8586899179115, 0.123456], "[1586, 0.1235]"),
        ({"16": 1585.8586899179115, "64": [2.5e-6]}, "{16: 1586, 64: [2.50e-06]}"),
    ],
)
def test_format_value_rounds_floats_sensibly(value, shown):
    assert format_value(value) == shown


def test_record_prints_rounded_outside_ipython(capsys, monkeypatch):
    monkeypatch.setattr("IPython.get_ipython", lambda: None)
    record("throughput", 1585.8586899179115, "samples/s")
    assert capsys.readouterr().out == "throughput = 1586 samples/s\n"


def test_record_shows_rounded_and_reports_the_exact_value():
    InteractiveShell.instance()  # display() publishes only when a shell is running
    try:
        with capture_output() as captured:
            record("sweep", {"16": 1585.8586899179115}, "samples/s")
            record("accuracy", 0.96875)
    finally:
        InteractiveShell.clear_instance()
    first, second = (out.data for out in captured.outputs)
    assert first["text/plain"] == "sweep = {16: 1586} samples/s"
    assert first[RESULT_MIME] == {
        "name": "sweep",
        "value": {"16": 1585.8586899179115},
        "unit": "samples/s",
    }
    assert second["text/plain"] == "accuracy = 0.9688" and second[RESULT_MIME]["value"] == 0.96875


def test_record_rejects_values_the_report_cannot_hold():
    with pytest.raises(TypeError):
        record("model", object())


def test_record_turns_non_finite_floats_into_text(capsys, monkeypatch):
    monkeypatch.setattr("IPython.get_ipython", lambda: None)
    record("gap", math.inf)
    assert capsys.readouterr().out == "gap = inf\n"
