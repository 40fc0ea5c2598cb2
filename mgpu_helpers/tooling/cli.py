"""The ``mgpu`` command: ``doctor`` (lesson 00), ``course``, ``student``, ``clean``, ``budget``."""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from mgpu_helpers.doctor import Finding

__all__ = ["doctor", "main", "print_findings"]

_MARK = {"warning": "warning: ", "problem": "PROBLEM: "}


def print_findings(findings: Sequence[Finding], out: TextIO = sys.stdout) -> None:
    """Print findings as the doctor's report: facts and checks first, then warnings, problems."""
    facts = [f for f in findings if f.level in ("ok", "info")]
    for f in facts:
        print(f"{f.topic:<12} " + "\n             ".join(f.message.splitlines()), file=out)
    for level in ("warning", "problem"):
        for f in findings:
            if f.level == level:
                print(f"{_MARK[level]}{f.message}; fix: {f.fix}", file=out)


def doctor(out: TextIO = sys.stdout) -> int:
    """Print the environment report; 0, or 1 when a problem line says the install is broken."""
    print("== mgpu doctor ==", file=out)
    try:
        from mgpu_helpers.doctor import diagnose, exit_code
    except Exception as exc:  # torch itself does not import: nothing else can be checked
        print(f"PROBLEM: torch does not import ({exc})", file=out)
        print("fix: pip install -r requirements.txt (or: make lab, which installs it)", file=out)
        print("status: broken, see PROBLEM lines above", file=out)
        return 1
    findings = diagnose()
    print_findings(findings, out)
    code = exit_code(findings)
    print("status: " + ("broken, see PROBLEM lines above" if code else "ok"), file=out)
    return code


def _parse_param(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--param wants NAME=VALUE, got {text!r}")
    try:
        return name.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name.strip(), value  # a bare word is a string


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mgpu", description="Multi-GPU course tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="environment report; non-zero exit when the install is broken")
    course = sub.add_parser("course", help="run every lesson headless and write an HTML report")
    course.add_argument("--quick", action="store_true", help="tiny data and few steps")
    course.add_argument("--notebooks", default="notebooks", help="folder with the lessons")
    course.add_argument("--out", default="build/course", help="where results go")
    course.add_argument(
        "--only", nargs="*", default=None, help="lesson numbers or names to run, e.g. --only 00 02"
    )
    course.add_argument(
        "--param",
        action="append",
        type=_parse_param,
        default=[],
        help="override a parameter of the lessons that have it, e.g. --param DATASET=cifar10 "
        "(a name no selected lesson has is an error)",
    )
    clean = sub.add_parser("clean", help="strip outputs and editor metadata from the lessons")
    clean.add_argument("--notebooks", default="notebooks")
    clean.add_argument("paths", nargs="*", help="notebooks to clean (default: every lesson)")
    student = sub.add_parser(
        "student",
        help="write the student copy of the course: the package, requirements, docs and the "
        "notebooks with solutions stubbed",
    )
    student.add_argument(
        "--notebooks",
        default="notebooks",
        help="the lessons; their parent folder is the course that is copied",
    )
    student.add_argument("--out", default="build/student", help="where the copy goes")
    budget = sub.add_parser(
        "budget",
        help="each lesson's load against the lesson budget (docs/authoring.md); non-zero exit "
        "when a lesson not in the baseline is over it, a listed one got worse or fits now",
    )
    budget.add_argument("--notebooks", default="notebooks", help="folder with the lessons")
    budget.add_argument(
        "--run-times",
        default=None,
        metavar="REPORT",
        help="build/course/report.json of a full-mode `make course`: adds each lesson's run "
        "minutes to its reading minutes, beside the estimate the lesson states",
    )
    budget.add_argument("paths", nargs="*", help="notebooks to measure (default: every lesson)")
    args = parser.parse_args(argv)

    if args.command == "doctor":
        return doctor()
    if args.command == "budget":
        return _budget(parser, args)
    from mgpu_helpers.tooling.notebooks import clean_notebook, find_lessons

    if args.command == "clean" and args.paths:  # the named notebooks, wherever they are
        lessons = [Path(p) for p in args.paths]
    else:
        try:
            lessons = find_lessons(args.notebooks)
        except FileNotFoundError as exc:
            parser.error(str(exc))
    if args.command == "clean":
        for path in lessons:
            print(f"{'cleaned' if clean_notebook(path) else 'clean  '} {path}")
        return 0
    if args.command == "student":
        from mgpu_helpers.tooling.student import make_student_copy

        root = Path(args.notebooks).resolve().parent
        try:
            out = make_student_copy(root, args.out, lessons)
        except ValueError as exc:
            parser.error(str(exc))
        print(f"wrote the student copy of {root} to {out}")
        print(f"  {len(lessons)} lessons with solutions stubbed in {out / 'notebooks'}")
        return 0
    if args.only:
        wanted = set(args.only)
        # a name, a lesson number ("06": every part) or a part ("06a")
        lessons = [p for p in lessons if {p.stem, p.stem[:2], p.stem.split("_")[0]} & wanted]
        if not lessons:
            parser.error(f"--only {' '.join(args.only)} matches no lesson in {args.notebooks}")
    from mgpu_helpers.tooling.runner import run_course

    try:
        runs = run_course(lessons, args.out, quick=args.quick, params=dict(args.param))
    except ValueError as exc:  # a --param no selected lesson has: nothing ran
        parser.error(str(exc))
    failed = [r.name for r in runs if r.status != "passed"]
    print(f"report: {Path(args.out) / 'report.html'}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _budget(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from mgpu_helpers.tooling.budget import print_budget
    from mgpu_helpers.tooling.notebooks import find_lessons

    try:
        paths = [Path(p) for p in args.paths] or find_lessons(args.notebooks)
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            parser.error(f"no such notebook: {', '.join(missing)}")
        return print_budget(paths, run_times=args.run_times, all_lessons=not args.paths)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
