"""Self-checks for the exercises at the end of every lesson.

A self-check never crashes the notebook: it prints a clear PASS, or a FAIL with what went
wrong and a hint, and returns True or False. Each printed verdict also carries a machine-readable
marker line, ``[self-check] PASS <name>``, that the course runner and the tests read.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

__all__ = ["MARKER", "check"]

MARKER = "[self-check]"


def check(name: str, test: Callable[[], object], hint: str) -> bool:
    """Run ``test()``; it passes when it returns without raising (and does not return False).

    ``test`` uses plain ``assert`` statements with messages saying what was expected. An
    unfinished exercise (``raise NotImplementedError``) reports that it is still to do.
    """
    try:
        result = test()
    except NotImplementedError:
        _verdict(
            name,
            False,
            "not implemented yet: replace the `raise NotImplementedError()` with your solution.",
            hint,
        )
        return False
    except AssertionError as exc:
        _verdict(name, False, str(exc) or "an assertion failed", hint)
        return False
    except Exception as exc:  # the learner's code raised: show where, not a crash
        where = traceback.extract_tb(exc.__traceback__)[-1]
        detail = f"{type(exc).__name__}: {exc} (line {where.lineno} of {where.name})"
        _verdict(name, False, detail, hint)
        return False
    if result is False:
        _verdict(name, False, "the check returned False", hint)
        return False
    _verdict(name, True, "", hint)
    return True


def _verdict(name: str, passed: bool, detail: str, hint: str) -> None:
    if passed:
        print(f"PASS  {name}")
    else:
        print(f"FAIL  {name}: {detail}\n      hint: {hint}")
    print(f"{MARKER} {'PASS' if passed else 'FAIL'} {name}")
