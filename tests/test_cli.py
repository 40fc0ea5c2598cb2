"""The `mgpu` command: the doctor's report, and course / student / clean (runner faked)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu_helpers.doctor import Finding
from mgpu_helpers.tooling.cli import doctor, main, print_findings
from mgpu_helpers.tooling.runner import LessonRun
from mgpu_helpers.tooling.student import STUDENT_FILES

ROOT = Path(__file__).resolve().parents[1]

# --- mgpu doctor: the printer ----------------------------------------------------------------


def test_print_findings_puts_facts_first_then_warnings_then_problems():
    findings = [
        Finding("problem", "backends", "no gloo", "reinstall torch"),
        Finding("info", "torch", "2.11.0"),
        Finding("warning", "disk", "3.0 GiB free", "free some space"),
        Finding("ok", "plan", "[CPU only] banner\na note"),
    ]
    out = io.StringIO()
    print_findings(findings, out)
    assert out.getvalue().splitlines() == [
        "torch        2.11.0",
        "plan         [CPU only] banner",
        "             a note",
        "warning: 3.0 GiB free; fix: free some space",
        "PROBLEM: no gloo; fix: reinstall torch",
    ]


@pytest.mark.parametrize(
    ("findings", "code", "status"),
    [
        ([Finding("info", "torch", "2.11")], 0, "status: ok"),
        ([Finding("warning", "disk", "full", "free")], 0, "status: ok"),
        (
            [Finding("info", "torch", "2.11"), Finding("problem", "cuda", "dead", "fix it")],
            1,
            "status: broken, see PROBLEM lines above",
        ),
    ],
)
def test_doctor_prints_the_findings_and_returns_their_status(monkeypatch, findings, code, status):
    monkeypatch.setattr("mgpu_helpers.doctor.diagnose", lambda: tuple(findings))
    out = io.StringIO()
    assert doctor(out=out) == code
    lines = out.getvalue().splitlines()
    assert lines[0] == "== mgpu doctor ==" and lines[-1] == status
    assert len(lines) == len(findings) + 2


@pytest.mark.slow  # make test-long (CI): the doctor in a child; lesson 00 runs it
def test_mgpu_doctor_command_runs():
    exe = Path(sys.executable).with_name("mgpu")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "mgpu_helpers.tooling.cli"]
    out = subprocess.run([*command, "doctor"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("== mgpu doctor ==")
    assert "status: ok" in out.stdout
    assert "\ndriver " in out.stdout and "\nplacement " in out.stdout


# --- mgpu course / student / clean (no kernels: the runner is replaced) ---------------------


@pytest.fixture
def lessons(tmp_path, notebook_writer):
    folder = tmp_path / "notebooks"
    for name in ("00_setup", "02_baseline", "04_ddp"):
        notebook_writer(
            folder / f"{name}.ipynb",
            [
                ("params", "N = 1"),
                ("code", "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"),
            ],
        )
    return folder


@pytest.fixture
def fake_course(monkeypatch):
    """Replace run_course: records what the CLI asked for; lesson 04 'fails'."""
    calls = []

    def run_course(notebooks, out_dir, *, quick, params=None, echo=True):
        calls.append({"names": [p.stem for p in notebooks], "quick": quick, "params": params})
        status = lambda p: "failed" if p.stem == "04_ddp" else "passed"  # noqa: E731
        return [LessonRun(p.stem, status(p), 0.1) for p in notebooks]

    monkeypatch.setattr("mgpu_helpers.tooling.runner.run_course", run_course)
    return calls


def test_mgpu_course_only_unknown_lesson_errors_clearly(lessons, fake_course, capsys):
    with pytest.raises(SystemExit) as info:
        main(["course", "--notebooks", str(lessons), "--only", "99"])
    assert info.value.code == 2
    assert f"--only 99 matches no lesson in {lessons}" in capsys.readouterr().err
    assert fake_course == []


def test_mgpu_course_selects_lessons_and_parses_params(lessons, fake_course, tmp_path, capsys):
    code = main(
        [
            "course", "--quick", "--notebooks", str(lessons), "--out", str(tmp_path / "out"),
            "--only", "00", "02_baseline",
            "--param", "DATASET='cifar10'", "--param", "EPOCHS=3", "--param", "MODEL=resnet",
        ]
    )  # fmt: skip
    assert code == 0
    assert fake_course == [
        {
            "names": ["00_setup", "02_baseline"],
            "quick": True,
            "params": {"DATASET": "cifar10", "EPOCHS": 3, "MODEL": "resnet"},
        }
    ]
    assert "report.html" in capsys.readouterr().out


def test_mgpu_course_only_picks_a_part_or_every_part_of_a_lesson(
    lessons, fake_course, tmp_path, notebook_writer
):
    for part in ("06a_speed", "06b_cost"):
        notebook_writer(lessons / f"{part}.ipynb", [("params", "N = 1")])
    out = str(tmp_path / "out")
    assert main(["course", "--notebooks", str(lessons), "--out", out, "--only", "06b"]) == 0
    assert main(["course", "--notebooks", str(lessons), "--out", out, "--only", "06"]) == 0
    assert [c["names"] for c in fake_course] == [["06b_cost"], ["06a_speed", "06b_cost"]]


def test_mgpu_course_exits_1_when_a_lesson_fails(lessons, fake_course, tmp_path, capsys):
    assert main(["course", "--notebooks", str(lessons), "--out", str(tmp_path)]) == 1
    assert fake_course[0]["quick"] is False and len(fake_course[0]["names"]) == 3
    assert "failed: 04_ddp" in capsys.readouterr().err


def test_mgpu_course_rejects_a_param_without_value(lessons, fake_course, capsys):
    with pytest.raises(SystemExit):
        main(["course", "--notebooks", str(lessons), "--param", "EPOCHS"])
    assert "--param wants NAME=VALUE, got 'EPOCHS'" in capsys.readouterr().err


def test_mgpu_student_and_clean(lessons, tmp_path, capsys):
    for name in STUDENT_FILES:  # around the lessons: the rest of a course, as `make student` sees
        source, target = ROOT / name, tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, target) if source.is_dir() else shutil.copy(source, target)
    out = tmp_path / "student"
    assert main(["student", "--notebooks", str(lessons), "--out", str(out)]) == 0
    written = sorted(p.name for p in (out / "notebooks").iterdir())
    assert written == ["00_setup.ipynb", "02_baseline.ipynb", "04_ddp.ipynb"]
    assert "### BEGIN SOLUTION" not in (out / "notebooks" / "04_ddp.ipynb").read_text()
    assert (out / "mgpu_helpers" / "tooling" / "cli.py").exists()  # the whole course
    assert main(["clean", "--notebooks", str(lessons)]) == 0
    assert capsys.readouterr().out.count("cleaned ") == 3
    assert main(["clean", "--notebooks", str(lessons)]) == 0
    assert capsys.readouterr().out.count("clean   ") == 3
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(lessons / "00_setup.ipynb", as_version=4)
    assert nb.cells[1].metadata["jupyter"]["source_hidden"] is True
