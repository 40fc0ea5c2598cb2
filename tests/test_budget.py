"""The lesson budget (mgpu_helpers/tooling/budget.py): its figures, the baseline, the estimate."""

from __future__ import annotations

import io
import json
import runpy
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from mgpu_helpers.tooling import budget
from mgpu_helpers.tooling.budget import (
    BASELINE,
    BUDGET,
    Figures,
    judge,
    measure,
    print_budget,
    run_minutes,
    stated_minutes,
)
from mgpu_helpers.tooling.cli import main
from mgpu_helpers.tooling.notebooks import find_lessons

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "budget_fixtures"
LESSONS = find_lessons(ROOT / "notebooks")
PROSE_STATS = ROOT.parent / "shared" / "tools" / "prose_stats.py"

# --- the figures -------------------------------------------------------------------------------

# Computed once with ../shared/tools/prose_stats.py (its `stats`, full precision). lean.ipynb has
# inline code, math, HTML, a table, lists, comments, a string source and a Notes cell with
# versions; wordy.ipynb has versions outside its Notes cell, long sentences and a raw cell.
EXPECTED = {
    "lean.ipynb": Figures(
        words=116,
        code=6,
        sents=16,
        mean=111 / 16,
        long=0.0,
        parens=100 * 1 / 116,
        versions=0,
        minutes=116 / 180 + 6 / 8,
    ),
    "wordy.ipynb": Figures(
        words=146,
        code=5,
        sents=9,
        mean=145 / 9,
        long=2 / 9,
        parens=100 * 1 / 146,
        versions=5,
        minutes=146 / 180 + 5 / 8,
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_figures_of_the_fixtures_are_prose_stats_figures(name):
    got = asdict(measure(FIXTURES / name))
    want = asdict(EXPECTED[name])
    assert got == pytest.approx(want, rel=1e-12), name


def test_measure_refuses_what_is_not_a_notebook(tmp_path):
    text = tmp_path / "lesson.md"
    text.write_text("# A lesson in markdown\n")
    with pytest.raises(ValueError, match="measures .ipynb"):
        measure(text)


@pytest.fixture(scope="module")
def prose_stats():
    """The ``stats`` function and ``BUDGET`` of ../shared/tools/prose_stats.py, when present."""
    if not PROSE_STATS.is_file():
        pytest.skip(f"{PROSE_STATS} is absent (as on CI): the fixtures' figures stand in for it")
    argv = sys.argv
    sys.argv = [str(PROSE_STATS)]  # no files: the script prints an empty table and returns
    try:
        script = runpy.run_path(str(PROSE_STATS), run_name="prose_stats")
    finally:
        sys.argv = argv
    return script


@pytest.mark.parametrize(
    "path",
    [*LESSONS, *sorted(FIXTURES.glob("*.ipynb"))],
    ids=lambda p: p.name,
)
def test_the_figures_equal_prose_stats_on_every_notebook(prose_stats, path):
    theirs = prose_stats["stats"](str(path))
    ours = asdict(measure(path))
    assert ours == {k: theirs[k] for k in ours}, path.name


def test_the_budget_is_prose_stats_budget(prose_stats):
    assert BUDGET == prose_stats["BUDGET"]


# --- every lesson against the budget and the baseline ------------------------------------------


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_every_lesson_keeps_the_budget_or_improves_on_its_baseline(path):
    verdict = judge(path.name, measure(path))
    assert not verdict.problems(), "\n".join(verdict.problems())


@pytest.mark.parametrize("name", sorted(BASELINE))
def test_every_baseline_entry_is_a_lesson(name):
    # A lesson split into parts (06 into 06a_, 06b_) leaves its entry behind: it must go, and
    # the parts are new notebooks, which keep the budget.
    assert name in {p.name for p in LESSONS}, (
        f"BASELINE in mgpu_helpers/tooling/budget.py lists {name}, which is not in notebooks/ "
        "any more: remove its entry"
    )


def test_the_baseline_lists_only_figures_over_budget():
    for name, entry in BASELINE.items():
        assert set(entry) <= set(BUDGET), (name, set(entry) - set(BUDGET))
        assert all(entry[k] > BUDGET[k] for k in entry), f"{name}: a listed figure fits: drop it"


# --- the verdict -------------------------------------------------------------------------------

WITHIN = Figures(
    words=3000, code=400, sents=150, mean=18.0, long=0.1, parens=2, versions=0, minutes=66.7
)
OVER = Figures(
    words=5000, code=400, sents=200, mean=22.0, long=0.1, parens=2, versions=1, minutes=77.8
)


def test_a_lesson_not_listed_must_keep_the_budget():
    assert not judge("11_new.ipynb", WITHIN, baseline={}).failed
    verdict = judge("11_new.ipynb", OVER, baseline={})
    assert verdict.failed and verdict.status == "OVER"
    assert set(verdict.over) == {"words", "mean", "versions"}
    assert "words 5,000 > 4,000" in verdict.problems()[0]
    assert "split it into parts" in verdict.problems()[0]


def test_a_listed_lesson_may_stay_or_improve_but_not_get_worse():
    listed = {"04_x.ipynb": {"words": 5000, "mean": 22.5, "versions": 1}}
    same = judge("04_x.ipynb", OVER, baseline=listed)
    assert not same.failed and not same.stale and same.status == "over (listed)"
    worse = judge("04_x.ipynb", Figures(**{**asdict(OVER), "words": 5001}), baseline=listed)
    assert worse.failed and set(worse.worse) == {"words"}
    assert "worse than its entry" in worse.problems()[0]
    # A figure not listed may not go over its budget either.
    longer = judge("04_x.ipynb", Figures(**{**asdict(OVER), "long": 0.13}), baseline=listed)
    assert longer.failed and set(longer.worse) == {"long"}


def test_a_listed_lesson_that_fits_must_leave_the_baseline():
    verdict = judge("04_x.ipynb", WITHIN, baseline={"04_x.ipynb": {"words": 5000}})
    assert verdict.stale and not verdict.failed
    assert verdict.problems() == [
        "04_x.ipynb fits the lesson budget now: remove its entry from BASELINE in "
        "mgpu_helpers/tooling/budget.py"
    ]
    # ...and the lesson test above reports it as a failure: it asserts no problems.


def test_judge_reads_the_module_baseline_by_default(monkeypatch):
    monkeypatch.setattr(budget, "BASELINE", {"04_x.ipynb": {"words": 5000}})
    assert judge("04_x.ipynb", WITHIN).stale


# --- the estimated time ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, minutes",
    [
        ("**Estimated time:** 15–20 minutes (quick mode runs in well under a minute).", (15, 20)),
        ("**Estimated time:** 30 minutes (the quick mode runs in under a minute).", (30, 30)),
        ("**Estimated time:** 90–120 minutes.", (90, 120)),
        ("**Estimated time:** 90 minutes for the whole lesson with its three exercises", (90, 90)),
        ("Estimated time: 45-60 min", (45, 60)),
        ("*Estimated time*: 1.5 hours", (90, 90)),
        ("**Estimated time:** 1–2 hours", (60, 120)),
        ("**Estimated time:** 1 h 30 min, reading included", (90, 90)),
        ("**Estimated time:** about an hour (2 minutes of it running)", (60, 60)),
        (
            "**Estimated time:** 60 minutes (the notebook runs in about two minutes in quick\n"
            "mode on a two-core laptop)",
            (60, 60),
        ),
    ],
)
def test_stated_minutes_reads_the_usual_phrasings(text, minutes):
    assert stated_minutes("# Lesson 01: x\n\n" + text + "\n\n| 0 GPUs | 5 minutes |") == minutes


@pytest.mark.parametrize(
    "text",
    ["# Lesson 01: no estimate here, 20 minutes of prose", "**Estimated time:** a while\n\n5 min"],
)
def test_stated_minutes_is_none_without_an_estimate(text):
    assert stated_minutes(text) is None


def _report(path: Path, mode: str = "full") -> Path:
    data = {
        "mode": mode,
        "finished": "2025-01-01 10:00:00",
        "hardware": {"cpu_count": 2, "gpus": []},
        "lessons": [
            {"name": "lean", "status": "passed", "seconds": 90.0},
            {"name": "wordy", "status": "failed", "seconds": 3.0},
        ],
    }
    path.write_text(json.dumps(data))
    return path


def test_run_minutes_reads_passed_lessons_of_a_full_run(tmp_path):
    minutes, where = run_minutes(_report(tmp_path / "report.json"))
    assert minutes == {"lean": 1.5}  # a failed lesson's time says nothing of a full run
    assert "full-mode `make course`" in where and "2 CPU cores and no GPUs" in where


def test_run_minutes_refuses_a_quick_run_and_a_missing_report(tmp_path):
    with pytest.raises(ValueError, match="without QUICK=1"):
        run_minutes(_report(tmp_path / "report.json", mode="quick"))
    with pytest.raises(ValueError, match="run `make course`"):
        run_minutes(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not the JSON"):
        run_minutes(tmp_path / "bad.json")


def test_reading_plus_run_goes_beside_the_stated_estimate(tmp_path):
    out = io.StringIO()
    print_budget(
        [FIXTURES / "lean.ipynb", FIXTURES / "wordy.ipynb"],
        run_times=_report(tmp_path / "report.json"),
        out=out,
    )
    rows = {line.split()[0]: line.split()[1:] for line in out.getvalue().splitlines() if line}
    # lean: 116 words and 6 code lines read in 1.39 minutes, plus 1.5 minutes run: 3 minutes.
    assert rows["lean.ipynb"][-4:] == ["1", "1.5", "3", "20–25"]
    # wordy ran in a failed lesson: no run time, and 1 h 30 min is well above its reading time.
    assert rows["wordy.ipynb"][-4:] == ["1", "-", "-", "90"]
    assert "no passed run in the report for: wordy.ipynb" in out.getvalue()


def test_an_estimate_below_the_reading_time_is_flagged(tmp_path, monkeypatch):
    monkeypatch.setattr(budget, "WORDS_PER_MINUTE", 1)  # 116 words now read in 116 minutes
    out = io.StringIO()
    print_budget([FIXTURES / "lean.ipynb"], out=out)
    assert "20–25  states less than reading" in out.getvalue()


# --- mgpu budget -------------------------------------------------------------------------------


def test_mgpu_budget_passes_a_lesson_within_budget(capsys):
    assert main(["budget", str(FIXTURES / "lean.ipynb")]) == 0
    out = capsys.readouterr().out
    assert "every notebook within the lesson budget" in out


def test_mgpu_budget_fails_a_new_lesson_over_budget_and_names_the_figure(capsys):
    assert main(["budget", str(FIXTURES / "lean.ipynb"), str(FIXTURES / "wordy.ipynb")]) == 1
    out = capsys.readouterr().out
    assert "wordy.ipynb: over budget: long 22.2% > 12.0%, versions 5 > 0" in out
    assert "lean.ipynb: over" not in out


def test_mgpu_budget_accepts_a_listed_lesson_until_it_gets_worse(monkeypatch, capsys):
    monkeypatch.setattr(budget, "BASELINE", {"wordy.ipynb": {"long": 0.223, "versions": 5}})
    assert main(["budget", str(FIXTURES / "wordy.ipynb")]) == 0
    monkeypatch.setattr(budget, "BASELINE", {"wordy.ipynb": {"long": 0.223, "versions": 4}})
    assert main(["budget", str(FIXTURES / "wordy.ipynb")]) == 1
    assert "versions 5 > 4" in capsys.readouterr().out


def test_mgpu_budget_names_baseline_entries_that_are_gone(tmp_path, monkeypatch, capsys):
    lessons = tmp_path / "notebooks"
    lessons.mkdir()
    (lessons / "06a_first_part.ipynb").write_bytes((FIXTURES / "lean.ipynb").read_bytes())
    monkeypatch.setattr(budget, "BASELINE", {"06_performance.ipynb": {"words": 8375}})
    assert main(["budget", "--notebooks", str(lessons)]) == 1  # as the budget test fails
    assert "lists 06_performance.ipynb, which is not a lesson any more" in capsys.readouterr().out
    # Named notebooks are a selection, not every lesson: the entry is not checked then.
    assert main(["budget", str(lessons / "06a_first_part.ipynb")]) == 0


def test_mgpu_budget_fails_a_listed_lesson_that_fits_now(monkeypatch, capsys):
    monkeypatch.setattr(budget, "BASELINE", {"lean.ipynb": {"words": 5000}})
    assert main(["budget", str(FIXTURES / "lean.ipynb")]) == 1
    assert "lean.ipynb fits the lesson budget now: remove its entry" in capsys.readouterr().out


def test_mgpu_budget_refuses_a_missing_notebook_and_a_quick_report(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["budget", str(tmp_path / "nope.ipynb")])
    assert "no such notebook" in capsys.readouterr().err
    report = _report(tmp_path / "report.json", mode="quick")
    with pytest.raises(SystemExit):
        main(["budget", "--run-times", str(report), str(FIXTURES / "lean.ipynb")])
    assert "without QUICK=1" in capsys.readouterr().err
