"""The ``mgpu`` command: ``doctor`` (lesson 00), ``course``, ``student`` and ``clean``."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import sys
from pathlib import Path

__all__ = ["doctor", "main"]

PINNED = {"torch": "2.14.1", "torchvision": "0.29.1"}


def doctor(out=sys.stdout) -> int:
    """Print an environment report and return 0, or 1 with the fix when the install is broken."""
    problems: list[str] = []
    warnings: list[str] = []

    def say(line: str = "") -> None:
        print(line, file=out)

    try:
        import torch
    except Exception as exc:  # the one thing nothing else works without
        say(f"torch does not import: {exc}")
        say("fix: pip install -r requirements.txt (or: make lab, which installs it)")
        return 1
    from .devices import course_plan, describe_hardware, nvidia_smi

    hw = describe_hardware()
    say("== mgpu doctor ==")
    say(f"python       {hw.python} ({sys.executable})")
    say(f"torch        {hw.torch}  (CUDA build: {hw.cuda_build or 'none, CPU-only build'})")
    for name, want in PINNED.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = "missing"
        if not have.startswith(want):
            warnings.append(f"{name} {have} installed; the course pins {want} (requirements.txt)")
    try:
        import torchvision
        from torchvision.ops import nms

        nms(torch.zeros(1, 4), torch.zeros(1), 0.5)  # fails when torchvision does not match torch
        say(f"torchvision  {torchvision.__version__}")
    except Exception as exc:
        problems.append(
            f"torchvision is broken ({str(exc).splitlines()[0]}); reinstall the matching pair: "
            f"pip install torch=={PINNED['torch']} torchvision=={PINNED['torchvision']}"
        )
    say(f"backends     {', '.join(hw.backends) or 'none'}  (NCCL {hw.nccl_version or '-'})")
    say(f"CPU cores    {hw.cpu_count}")
    say(f"CUDA_VISIBLE_DEVICES={hw.visible_devices!r}")
    say(f"MPS (Apple)  {'available' if hw.mps_available else 'no'}")
    if hw.gpus:
        for g in hw.gpus:
            say(
                f"cuda:{g.index}       {g.name}, {g.total_memory_gib} GiB, compute capability "
                f"{g.capability[0]}.{g.capability[1]}, {g.multi_processor_count} SMs"
            )
        if len(hw.gpus) > 1:
            say(
                "peer access  "
                + "  ".join(
                    f"{i}->{j}:{'yes' if ok else 'no'}"
                    for i, row in enumerate(hw.peer_access)
                    for j, ok in enumerate(row)
                    if i != j
                )
            )
    else:
        say("GPUs         none visible to torch")
    smi = nvidia_smi("--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader")
    if smi:
        say("nvidia-smi   " + smi.strip().replace("\n", "\n             "))
        topo = nvidia_smi("topo", "-m")
        if topo and len(hw.gpus) > 1:
            say("topology (nvidia-smi topo -m):\n" + topo.rstrip())
        if not hw.gpus:
            fix = (
                "this torch is a CPU-only build: install the CUDA build, "
                f"pip install torch=={PINNED['torch']} torchvision=={PINNED['torchvision']}"
                if hw.cuda_build is None
                else "torch cannot use them: update the NVIDIA driver to one that supports "
                f"CUDA {hw.cuda_build}, or install a torch built for an older CUDA"
            )
            problems.append(f"nvidia-smi lists GPUs but torch sees none; {fix}")
    if hw.cuda_error:
        problems.append(
            f"CUDA is present but unusable ({hw.cuda_error}); check the driver "
            "(nvidia-smi) and that no other process holds the GPUs in exclusive mode"
        )
    if "gloo" not in hw.backends:
        problems.append(
            "torch.distributed has no gloo backend; reinstall torch from the "
            "official wheels (pip install -r requirements.txt)"
        )
    try:
        import ipykernel  # noqa: F401
    except ImportError:
        warnings.append(
            "ipykernel is missing: notebooks cannot run; pip install -r requirements.txt"
        )
    plan = course_plan(len(hw.gpus))
    say(f"plan         {plan.banner()}")
    for note in plan.notes:
        say(f"             {note}")
    for w in warnings:
        say(f"warning: {w}")
    for p in problems:
        say(f"PROBLEM: {p}")
    say("status: " + ("broken, see PROBLEM lines above" if problems else "ok"))
    return 1 if problems else 0


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
    args = parser.parse_args(argv)

    if args.command == "doctor":
        return doctor()
    from .notebooks import clean_notebook, find_lessons

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
        from .student import make_student_copy

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
        lessons = [p for p in lessons if p.stem in wanted or p.stem[:2] in wanted]
        if not lessons:
            parser.error(f"--only {' '.join(args.only)} matches no lesson in {args.notebooks}")
    from .course import run_course

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


if __name__ == "__main__":
    sys.exit(main())
