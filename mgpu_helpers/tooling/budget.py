"""The lesson budget (COURSE.md, "The shape of a lesson"): how much one sitting asks of a learner.

``measure`` counts a notebook's prose and code with the definitions of the course's
``prose_stats.py`` (``tests/test_budget.py`` checks that both give the same figures); ``BUDGET``
is what a lesson may ask; ``BASELINE`` lists the lessons over it today, whose figures may only
improve; ``judge`` compares. ``stated_minutes`` reads the estimate a lesson's first cell states
and ``run_minutes`` the run times of a full-mode ``make course``, so that ``mgpu budget`` can put
reading plus run time beside it. Used by ``mgpu budget`` (``make budget``) and the tests.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

__all__ = [
    "BASELINE",
    "BUDGET",
    "Figures",
    "Verdict",
    "judge",
    "measure",
    "print_budget",
    "run_minutes",
    "stated_minutes",
]

# What one lesson may ask (COURSE.md): prose words, code lines (not blank, not a comment), mean
# words per sentence, share of sentences over 35 words, torch versions and issue numbers outside
# a `## Notes` cell, reading minutes. A figure is over when it is greater than its budget.
BUDGET: dict[str, float] = {
    "words": 4000,
    "code": 520,
    "mean": 20.0,
    "long": 0.12,
    "versions": 0,
    "minutes": 85,
}

# The lessons over budget when the budget became a test, with each figure that was over, rounded
# up (mean to 0.01, long to 0.001, minutes to 0.1). Such a figure may not grow past its value
# here, a figure not listed must stay within BUDGET. Remove a lesson's entry once it fits; the
# test fails until then, so the list cannot go stale.
BASELINE: dict[str, dict[str, float]] = {
}  # fmt: skip

_WHERE = "BASELINE in mgpu_helpers/tooling/budget.py"

# The definitions of prose_stats.py, one by one.
_NOTES_HEADING = "## Notes"  # a markdown cell starting with it holds versions and references
_VERSION = re.compile(r"torch 2\.\d+|pytorch#\d+|PyTorch 2\.\d+|#\d{5,6}")
_INLINE_CODE = re.compile(r"`[^`]*`")  # counts as one word
_MATH = re.compile(r"\$[^$]*\$")  # one word too
_HTML_TAG = re.compile(r"<[^>]+>")
_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$", flags=re.M)  # table rows are not sentences
_WORD = re.compile(r"[A-Za-z0-9][\w'’.-]*")
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n\s*\n|\n[-*] |\n\d+\. ")
_MIN_SENTENCE_WORDS = 3
_LONG_SENTENCE_WORDS = 35
WORDS_PER_MINUTE = 180
CODE_LINES_PER_MINUTE = 8


@dataclass(frozen=True)
class Figures:
    """One notebook's load: the budget's figures, plus sentences and parentheses per 100 words."""

    words: int  # words of prose (inline code and math count as one word each)
    code: int  # code lines, not blank and not a comment
    sents: int  # sentences of three words or more
    mean: float  # mean words per sentence
    long: float  # share of sentences over 35 words
    parens: float  # opening parentheses per 100 words
    versions: int  # torch versions and issue numbers outside the `## Notes` cell
    minutes: float  # reading minutes: 180 words and 8 code lines a minute


def _split(cells: Sequence[Mapping]) -> tuple[str, str, str]:
    """(prose, code, notes): markdown cells are prose or notes, every other cell is code."""
    prose, code, notes = [], [], []
    for cell in cells:
        source = cell["source"]
        text = source if isinstance(source, str) else "".join(source)
        if cell["cell_type"] == "markdown":
            (notes if text.lstrip().startswith(_NOTES_HEADING) else prose).append(text)
        else:
            code.append(text)
    return "\n\n".join(prose), "\n".join(code), "\n\n".join(notes)


def measure(path: str | Path) -> Figures:
    """The budget's figures for the notebook at ``path``."""
    path = Path(path)
    if path.suffix != ".ipynb":
        raise ValueError(f"{path} is not a notebook: the lesson budget measures .ipynb files")
    prose, code, notes = _split(json.loads(path.read_text(encoding="utf-8"))["cells"])
    versions = len(_VERSION.findall(prose))  # the Notes cell is where they belong
    prose = prose + "\n\n" + notes
    prose = _INLINE_CODE.sub("X", prose)
    prose = _MATH.sub("X", prose)
    prose = _HTML_TAG.sub(" ", prose)
    prose = _TABLE_ROW.sub(" ", prose)
    words = len(_WORD.findall(prose))
    sentences = [s for s in _SENTENCE_BREAK.split(prose) if len(s.split()) >= _MIN_SENTENCE_WORDS]
    lengths = [len(s.split()) for s in sentences] or [0]
    code_lines = [
        line for line in code.splitlines() if line.strip() and not line.strip().startswith("#")
    ]
    return Figures(
        words=words,
        code=len(code_lines),
        sents=len(sentences),
        mean=sum(lengths) / len(lengths),
        long=sum(n > _LONG_SENTENCE_WORDS for n in lengths) / len(lengths),
        parens=100 * prose.count("(") / max(words, 1),
        versions=versions,
        minutes=words / WORDS_PER_MINUTE + len(code_lines) / CODE_LINES_PER_MINUTE,
    )


def _show(figure: str, value: float) -> str:
    if figure == "long":
        return f"{value:.1%}"
    if figure in ("mean", "minutes"):
        return f"{value:.2f}"
    return f"{value:,.0f}"


@dataclass(frozen=True)
class Verdict:
    """A notebook against the budget and, when listed, against its baseline."""

    name: str  # the notebook's file name
    listed: bool  # whether BASELINE has an entry for it
    over: dict[str, tuple[float, float]]  # figure -> (value, budget): the figures over budget
    worse: dict[str, tuple[float, float]]  # figure -> (value, allowed): past its baseline

    @property
    def failed(self) -> bool:
        """A notebook not listed is over budget, or a listed one got worse."""
        return bool(self.worse) or (not self.listed and bool(self.over))

    @property
    def stale(self) -> bool:
        """A listed notebook that fits the budget now: its entry must go."""
        return self.listed and not self.over

    @property
    def status(self) -> str:
        """One word for the table."""
        if self.failed:
            return "WORSE" if self.listed else "OVER"
        if self.stale:
            return "fits: unlist"
        return "over (listed)" if self.listed else "ok"

    def problems(self) -> list[str]:
        """What is wrong, and what to do, one line each (empty when within its limits)."""
        lines = []
        if self.worse:
            past = ", ".join(
                f"{k} {_show(k, v)} > {_show(k, allowed)}" for k, (v, allowed) in self.worse.items()
            )
            lines.append(
                f"{self.name}: worse than its entry in {_WHERE}: {past}; a listed lesson may "
                "only improve"
            )
        elif self.over and not self.listed:
            past = ", ".join(
                f"{k} {_show(k, v)} > {_show(k, b)}" for k, (v, b) in self.over.items()
            )
            lines.append(
                f"{self.name}: over the lesson budget: {past}; shorten it or split it into parts "
                "(NNa_, NNb_), see docs/authoring.md"
            )
        if self.stale:
            lines.append(f"{self.name} fits the lesson budget now: remove its entry from {_WHERE}")
        return lines


def judge(
    name: str,
    figures: Figures,
    baseline: Mapping[str, Mapping[str, float]] | None = None,
) -> Verdict:
    """Compare ``figures`` of notebook ``name`` with BUDGET and its ``baseline`` entry, if any.

    ``baseline`` defaults to BASELINE. A listed figure may reach its listed value; any other
    figure its budget.
    """
    baseline = BASELINE if baseline is None else baseline
    values = asdict(figures)
    entry = baseline.get(name)
    over = {k: (values[k], b) for k, b in BUDGET.items() if values[k] > b}
    worse = {}
    if entry is not None:
        for k, b in BUDGET.items():
            allowed = max(b, entry.get(k, b))
            if values[k] > allowed:
                worse[k] = (values[k], allowed)
    return Verdict(name=name, listed=entry is not None, over=over, worse=worse)


# --- the estimated time ------------------------------------------------------------------------

_ESTIMATE = re.compile(r"estimated\s+time", re.I)
_NUMBER = r"(\d+(?:\.\d+)?)"
_HOURS = r"(?:hours?|hrs?|h)"
_MINUTES = r"(?:minutes?|mins?|m)"
_DURATION = re.compile(
    rf"{_NUMBER}\s*(?:(?:–|—|-|to)\s*{_NUMBER}\s*)?({_HOURS}|{_MINUTES})\b"
    rf"(?:\s*(?:and\s+)?(\d+)\s*{_MINUTES}\b)?",
    re.I,
)
_AN_HOUR = re.compile(r"\b(?:an|one)\s+hour\b", re.I)


def stated_minutes(text: str) -> tuple[float, float] | None:
    """The estimate that ``text`` states after "Estimated time", as (low, high) minutes.

    Reads "30 minutes", "15–20 minutes", "90-120 min", "1.5 hours", "1–2 hours",
    "1 h 30 min", "an hour"; the first duration in the paragraph after the words counts. None
    when ``text`` states no estimate, or one in other words.
    """
    found = _ESTIMATE.search(text)
    if found is None:
        return None
    paragraph = re.split(r"\n\s*\n", text[found.end() :], maxsplit=1)[0]
    duration = _DURATION.search(paragraph)
    an_hour = _AN_HOUR.search(paragraph)
    if duration is None or (an_hour is not None and an_hour.start() < duration.start()):
        return (60.0, 60.0) if an_hour is not None else None
    low, high, unit, extra = duration.groups()
    scale = 60.0 if re.fullmatch(_HOURS, unit, re.I) else 1.0
    plus = float(extra) if extra and scale == 60.0 else 0.0
    high = high or low
    return float(low) * scale + plus, float(high) * scale + plus


def _first_cell_text(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    if not cells:
        return ""
    source = cells[0]["source"]
    return source if isinstance(source, str) else "".join(source)


def run_minutes(report: str | Path) -> tuple[dict[str, float], str]:
    """Minutes each lesson ran in a full-mode ``make course``, from its ``report.json``.

    Returns (lesson name -> minutes, for the lessons that passed; a line saying where and on what
    the run was measured). ValueError when the report is missing, unreadable or of a quick run.
    """
    report = Path(report)
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{report} does not exist: run `make course` (full mode, without QUICK=1) first"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{report} is not the JSON `make course` writes ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("lessons"), list):
        raise ValueError(f"{report} has no list of lessons: pass the report.json of `make course`")
    if data.get("mode") != "full":
        raise ValueError(
            f"{report} is from a {data.get('mode', 'unknown')}-mode run; the estimate needs "
            "full-mode run times: run `make course` without QUICK=1"
        )
    minutes = {
        str(lesson["name"]): float(lesson["seconds"]) / 60
        for lesson in data["lessons"]
        if lesson.get("status") == "passed"
    }
    hw = data.get("hardware", {})
    gpus = len(hw.get("gpus", [])) if isinstance(hw, dict) else 0
    cores = hw.get("cpu_count", "?") if isinstance(hw, dict) else "?"
    where = (
        f"run: full-mode `make course` finished {data.get('finished', '?')} on {cores} CPU cores "
        f"and {gpus or 'no'} GPU{'' if gpus == 1 else 's'} ({report})"
    )
    return minutes, where


# --- the report ----------------------------------------------------------------------------------


def _range(stated: tuple[float, float] | None) -> str:
    if stated is None:
        return "-"
    low, high = stated
    return f"{low:.0f}" if low == high else f"{low:.0f}–{high:.0f}"


def print_budget(
    paths: Sequence[str | Path],
    *,
    run_times: str | Path | None = None,
    all_lessons: bool = False,
    out: TextIO | None = None,
) -> int:
    """Print the budget table of ``paths`` and what is over; 1 when the budget test would fail.

    That is: a notebook not in BASELINE is over budget, a listed one got worse, or a listed one
    fits now (its entry must go). ``run_times``: a full-mode ``report.json`` whose run minutes go
    beside the estimate each lesson states. ``all_lessons``: ``paths`` are every lesson, so a
    BASELINE entry none of them matches is a problem too (remove it).
    """
    out = sys.stdout if out is None else out  # read now: pytest and Jupyter replace it
    runs, where = run_minutes(run_times) if run_times is not None else ({}, "")
    rows = [(Path(p), measure(p)) for p in paths]
    width = max([len(p.name) for p, _ in rows] + [8])
    head = ("words", "code", "sent", "w/sent", ">35w", "(/100w", "vers", "read min")
    print(f"{'notebook':{width}} " + " ".join(f"{h:>6}" for h in head) + "  status", file=out)
    verdicts = []
    for path, f in rows:
        verdict = judge(path.name, f)
        verdicts.append(verdict)
        cells = (
            f"{f.words:6d} {f.code:6d} {f.sents:6d} {f.mean:6.1f} {f.long:6.0%} {f.parens:6.1f} "
            f"{f.versions:6d} {f.minutes:8.0f}"
        )
        print(f"{path.name:{width}} {cells}  {verdict.status}", file=out)
    print(file=out)
    for verdict in verdicts:
        if verdict.over:
            over = ", ".join(
                f"{k} {_show(k, v)} > {_show(k, b)}" for k, (v, b) in verdict.over.items()
            )
            print(f"{verdict.name}: over budget: {over}", file=out)
    problems = [line for v in verdicts for line in v.problems()]
    if all_lessons:
        names = {p.name for p, _ in rows}
        problems += [
            f"{_WHERE} lists {name}, which is not a lesson any more: remove its entry"
            for name in BASELINE
            if name not in names
        ]
    for line in problems:
        print(line, file=out)
    if not any(v.over for v in verdicts) and not problems:
        print("every notebook within the lesson budget", file=out)

    print(f"\n{'lesson':{width}} {'reading':>8} {'run':>8} {'read+run':>8}  stated", file=out)
    for path, f in rows:
        stated = stated_minutes(_first_cell_text(path))
        run = runs.get(path.stem)
        total = f.minutes + (run or 0.0)
        note = ""
        if stated is not None and stated[1] < total:
            note = "  states less than reading" + (" + run" if run is not None else "")
        print(
            f"{path.name:{width}} {f.minutes:8.0f} "
            f"{'-' if run is None else f'{run:.1f}':>8} "
            f"{'-' if run is None else f'{total:.0f}':>8}  {_range(stated)}{note}",
            file=out,
        )
    print("(minutes)", file=out)
    print(
        f"reading: {WORDS_PER_MINUTE} words and {CODE_LINES_PER_MINUTE} code lines a minute; "
        + (where or "run: pass --run-times build/course/report.json of a full-mode `make course`"),
        file=out,
    )
    if run_times is not None:
        missing = [p.name for p, _ in rows if p.stem not in runs]
        if missing:
            print(f"no passed run in the report for: {', '.join(missing)}", file=out)
    return 1 if problems else 0
