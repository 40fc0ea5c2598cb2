"""Key results a lesson reports to `make course` (every lesson's visible checks).

``record("test_accuracy", 0.97)`` shows the value in the notebook and tags it with a MIME type
that the course runner collects into its report, so the numbers in the report are the ones the
learner saw, measured in that run.
"""

from __future__ import annotations

import json
import math

__all__ = ["RESULT_MIME", "record"]

RESULT_MIME = "application/vnd.mgpu.result+json"


def record(name: str, value: object, unit: str = "") -> None:
    """Show ``name = value`` and hand it to the course report. ``value`` must be JSON-ready."""
    if isinstance(value, float) and not math.isfinite(value):
        value = str(value)
    json.dumps(value)  # fail here, with the value at hand, rather than in the report
    text = f"{name} = {value:.4g}" if isinstance(value, float) else f"{name} = {value}"
    text += f" {unit}" if unit else ""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # plain Python without IPython: just print
        print(text)
        return
    if get_ipython() is None:
        print(text)
        return
    display(
        {RESULT_MIME: {"name": name, "value": value, "unit": unit}, "text/plain": text}, raw=True
    )
