"""check(): clear PASS/FAIL verdicts with a hint and a marker line; never a crash."""

from __future__ import annotations

import pytest

from mgpu_helpers.exercises import MARKER, check

HINT = "compare with the single-device result"


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def _notebook_function(source: str):
    """Compile ``def test(): ...`` as a notebook cell would be: pytest rewrites the asserts
    in this file (adding its own messages), but not in code compiled here."""
    namespace: dict = {}
    exec(compile(source, "<cell>", "exec"), namespace)
    return namespace["test"]


def test_pass(capsys):
    assert check("ddp matches", lambda: None, HINT) is True
    assert _lines(capsys) == ["PASS  ddp matches", f"{MARKER} PASS ddp matches"]


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
    assert lines[0] == "FAIL  sizes: expected 3 parameters per rank"
    assert lines[1].strip() == f"hint: {HINT}"
    assert lines[-1] == f"{MARKER} FAIL sizes"


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
    assert out.splitlines()[-1] == f"{MARKER} FAIL todo"


def test_other_exceptions_are_caught_and_located(capsys):
    def learner_code():
        return {}["missing"]

    assert check("lookup", lambda: learner_code(), HINT) is False
    out = capsys.readouterr().out
    assert "FAIL  lookup: KeyError: 'missing'" in out
    assert "of learner_code)" in out  # where it went wrong
    assert f"hint: {HINT}" in out
    assert out.splitlines()[-1] == f"{MARKER} FAIL lookup"


def test_return_false_fails(capsys):
    assert check("flag", lambda: False, HINT) is False
    out = capsys.readouterr().out
    assert "FAIL  flag: the check returned False" in out
    assert out.splitlines()[-1] == f"{MARKER} FAIL flag"


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupts_are_not_swallowed(exc):
    def test():
        raise exc()

    with pytest.raises(exc):
        check("stop", test, HINT)


def test_marker_line_is_parsed_back_by_the_runner(capsys):
    """The course runner splits the marker line into verdict and name (names may have spaces)."""
    check("grad all reduce", lambda: None, HINT)
    marker = _lines(capsys)[-1]
    verdict, _, name = marker[len(MARKER) :].strip().partition(" ")
    assert (verdict, name) == ("PASS", "grad all reduce")
