"""Self-checks for the exercises at the end of every lesson.

For a learner a self-check never crashes the notebook: it shows a clear PASS, or a FAIL with
what went wrong and a hint, and returns True or False, so "Run All" goes on to the end. In a
kernel the verdict is one display with two forms: the line the learner reads (``text/plain``)
and a small JSON record (:data:`VERDICT_MIME`) that the course runner and the tests read.

Under an autograder (``MGPU_GRADING=1``, set by ``nbgrader_config.py``) a failed check also
raises :class:`CheckFailed` after showing its verdict, because nbgrader scores a test cell by
whether it raised.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Callable

from .config import grading_from_env
from .record import show_tagged

__all__ = ["VERDICT_MIME", "CheckFailed", "check"]

VERDICT_MIME = "application/vnd.mgpu.check+json"


class CheckFailed(AssertionError):
    """A self-check failed while an autograder runs the notebook (``MGPU_GRADING=1``)."""


def check(name: str, test: Callable[[], object], hint: str) -> bool:
    """Run ``test()``; it passes when it returns without raising (and does not return False).

    ``test`` uses plain ``assert`` statements with messages saying what was expected. An
    unfinished exercise (``raise NotImplementedError``) reports that it is still to do.
    """
    grading = grading_from_env()
    passed, detail = _run(test, grading)
    _show(name, passed, detail, hint)
    if grading and not passed:
        raise CheckFailed(f"{name}: {detail}")
    return passed


def _run(test: Callable[[], object], grading: bool) -> tuple[bool, str]:
    # nbgrader gives a test cell no points when it wrote anything to stderr (a warning, a
    # launcher's rank output): while grading, what the test writes there goes to stdout.
    redirect = contextlib.redirect_stderr(sys.stdout) if grading else contextlib.nullcontext()
    try:
        with redirect:
            result = test()
    except NotImplementedError:
        todo = "replace the `raise NotImplementedError()` with your solution."
        return False, f"not implemented yet: {todo}"
    except AssertionError as exc:
        return False, str(exc) or "an assertion failed"
    except Exception as exc:  # the learner's code raised: show where, not a crash
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return False, f"{type(exc).__name__}: {exc} (line {where.lineno} of {where.name})"
    if result is False:
        return False, "the check returned False"
    return True, ""


def _show(name: str, passed: bool, detail: str, hint: str) -> None:
    """Show the verdict once: the line in the notebook, the record beside it for the runner."""
    text = f"PASS  {name}" if passed else f"FAIL  {name}: {detail}\n      hint: {hint}"
    payload = {"name": name, "passed": passed, "detail": detail, "hint": hint}
    show_tagged(text, VERDICT_MIME, payload)
