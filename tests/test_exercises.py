"""check(): clear PASS/FAIL verdicts with a hint, shown once; never a crash, except for a
failure while an autograder grades (MGPU_GRADING=1), which must raise for nbgrader to see it.

Outside a kernel the verdict is printed; in a kernel it is one display that also carries the
record the runner reads (tests/test_course.py checks that one, in a real kernel).
"""

from __future__ import annotations

import sys

import pytest

from mgpu_helpers.exercises import CheckFailed, check

HINT = "compare with the single-device result"


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def _notebook_function(source: str):
    """Compile ``def test(): ...`` as a notebook cell would be: pytest rewrites the asserts
    in this file (adding its own messages), but not in code compiled here."""
    namespace: dict = {}
    exec(compile(source, "<cell>", "exec"), namespace)
    return namespace["test"]


@pytest.fixture(autouse=True)
def _learner(monkeypatch):
    """A learner's run unless a test says otherwise (the runner may set MGPU_GRADING outside)."""
    monkeypatch.delenv("MGPU_GRADING", raising=False)


def test_pass_is_shown_once(capsys):
    assert check("ddp matches", lambda: None, HINT) is True
    assert _lines(capsys) == ["PASS  ddp matches"]


def test_truthy_and_none_results_pass(capsys):
    assert check("a", lambda: 0, HINT) is True  # only False itself fails
    assert check("b", lambda: [], HINT) is True
    assert check("c", lambda: True, HINT) is True


def test_assertion_failure_shows_message_and_hint(capsys):
    test = _notebook_function(
        'def test():\n    assert 1 + 1 == 3, "expected 3 parameters per rank"\n'
    )

    assert check("sizes", test, HINT) is False
    lines = _lines(capsys)
    assert lines == ["FAIL  sizes: expected 3 parameters per rank", f"      hint: {HINT}"]


def test_bare_assert_says_an_assertion_failed(capsys):
    test = _notebook_function("def test():\n    assert 1 + 1 == 3\n")

    assert check("bare", test, HINT) is False
    assert "FAIL  bare: an assertion failed" in _lines(capsys)


def test_not_implemented_says_so(capsys):
    def test():
        raise NotImplementedError()

    assert check("todo", test, HINT) is False
    out = capsys.readouterr().out
    assert "FAIL  todo: not implemented yet" in out
    assert "raise NotImplementedError()" in out  # says what to replace
    assert f"hint: {HINT}" in out
    assert len(out.splitlines()) == 2  # the verdict and its hint, once


def test_other_exceptions_are_caught_and_located(capsys):
    def learner_code():
        return {}["missing"]

    assert check("lookup", lambda: learner_code(), HINT) is False
    out = capsys.readouterr().out
    assert "FAIL  lookup: KeyError: 'missing'" in out
    assert "of learner_code)" in out  # where it went wrong
    assert f"hint: {HINT}" in out


def test_return_false_fails(capsys):
    assert check("flag", lambda: False, HINT) is False
    out = capsys.readouterr().out
    assert "FAIL  flag: the check returned False" in out


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupts_are_not_swallowed(exc):
    def test():
        raise exc()

    with pytest.raises(exc):
        check("stop", test, HINT)


@pytest.mark.parametrize("value", ["1", "yes", "true"])
def test_grading_mode_raises_after_showing_the_verdict(capsys, monkeypatch, value):
    monkeypatch.setenv("MGPU_GRADING", value)

    def test():
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match=r"^todo: not implemented yet"):
        check("todo", test, HINT)
    out = capsys.readouterr().out
    assert "FAIL  todo: not implemented yet" in out and f"hint: {HINT}" in out
    assert issubclass(CheckFailed, AssertionError)  # what nbgrader's tests usually raise


def test_grading_mode_passes_quietly(capsys, monkeypatch):
    monkeypatch.setenv("MGPU_GRADING", "1")
    assert check("ok", lambda: None, HINT) is True
    assert _lines(capsys) == ["PASS  ok"]


def test_learner_mode_never_raises(monkeypatch):
    monkeypatch.setenv("MGPU_GRADING", "0")
    assert check("wrong", lambda: False, HINT) is False


def test_grading_mode_sends_what_the_test_writes_to_stderr_to_stdout(capsys, monkeypatch):
    """nbgrader scores a test cell that wrote to stderr as failed, whatever else happened."""

    def noisy():
        print("a warning from the learner's code", file=sys.stderr)

    monkeypatch.setenv("MGPU_GRADING", "1")
    assert check("noisy", noisy, HINT) is True
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "a warning from the learner's code" in captured.out
    monkeypatch.setenv("MGPU_GRADING", "0")  # a learner sees it where it was written
    check("noisy", noisy, HINT)
    assert "a warning from the learner's code" in capsys.readouterr().err


def test_a_bad_grading_flag_says_what_it_wants(monkeypatch):
    monkeypatch.setenv("MGPU_GRADING", "perhaps")
    with pytest.raises(ValueError, match="MGPU_GRADING must be 1 or 0"):
        check("x", lambda: None, HINT)
