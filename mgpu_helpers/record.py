"""Key results a lesson reports to `make course` (every lesson's visible checks).

``record("test_accuracy", 0.97)`` shows the value in the notebook and tags it with a MIME type
that the course runner collects into its report, so the numbers in the report are the ones the
learner saw, measured in that run. The notebook shows floats rounded to what a reader can use
(``1586`` samples/s, ``0.9688``, ``3.14e-07``); the report keeps the value unrounded.
"""

from __future__ import annotations

import json
import math

__all__ = ["RESULT_MIME", "format_value", "record", "show_tagged"]

RESULT_MIME = "application/vnd.mgpu.result+json"


def format_value(value: object) -> str:
    """``value`` as :func:`record` shows it: floats rounded, inside lists and dicts too.

    At least 1000: a whole number; below that, four significant
    digits; below 0.001, scientific notation with three. Other values print as they are.
    """
    if isinstance(value, bool) or not isinstance(value, (float, list, tuple, dict)):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if not math.isfinite(value):
        return str(value)
    size = abs(value)
    if size >= 1e15:  # beyond a readable whole number
        return f"{value:.3e}"
    if size >= 1000:
        return f"{value:.0f}"
    if size >= 1e-3 or value == 0:
        return f"{value:.4g}"
    return f"{value:.2e}"


def record(name: str, value: object, unit: str = "") -> None:
    """Show ``name = value`` (rounded) and hand the exact value to the course report.

    ``value`` must be JSON-ready: a number, string, bool, None, or lists and dicts of those.
    """
    if isinstance(value, float) and not math.isfinite(value):
        value = str(value)
    json.dumps(value)  # fail here, with the value at hand, rather than in the report
    text = f"{name} = {format_value(value)}"
    text += f" {unit}" if unit else ""
    show_tagged(text, RESULT_MIME, {"name": name, "value": value, "unit": unit})


def show_tagged(text: str, mime: str, payload: dict) -> None:
    """Show ``text``, with ``payload`` under the MIME type ``mime`` beside it for the runner.

    The notebook shows only the text; the course runner reads the payload from the saved
    output. Outside IPython (a script, a launched rank) the text is printed.
    """
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # plain Python without IPython: just print
        print(text)
        return
    if get_ipython() is None:
        print(text)
        return
    display({mime: payload, "text/plain": text}, raw=True)
