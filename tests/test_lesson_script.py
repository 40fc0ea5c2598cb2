"""Lessons run as scripts, without Jupyter (scripts/lesson_as_script.py, for gpu_check.sh).

The GPU machine's Python has torch but perhaps no Jupyter stack, so these tests run the
exported lessons in processes where the real IPython, ipywidgets and the Jupyter packages
cannot be imported (a ``sitecustomize`` on ``PYTHONPATH`` blocks them, in every child process
too); only the kernel shim's stand-ins can be.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
RUNNER = SCRIPTS / "lesson_as_script.py"
JUPYTER = ["IPython", "ipywidgets", "ipykernel", "nbformat", "nbclient", "jupyter_client"]

_spec = importlib.util.spec_from_file_location("lesson_as_script", RUNNER)
las = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("lesson_as_script", las)
_spec.loader.exec_module(las)

BLOCKER = """
import importlib.abc, importlib.machinery, sys

BLOCKED = {blocked!r}
ALLOWED = {allowed!r}


class _Block(importlib.abc.MetaPathFinder):
    # The real packages are unimportable; the kernel shim's stand-ins (under ALLOWED) are not.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in BLOCKED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        where = str(getattr(spec, "origin", None) or "")
        if spec is None or not where.startswith(ALLOWED):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return spec


sys.meta_path.insert(0, _Block())
"""


def without(tmp_path: Path, blocked: list[str]) -> dict[str, str]:
    """An environment (for the runner and all it starts) in which ``blocked`` cannot import."""
    site = tmp_path / "blocker"
    site.mkdir(exist_ok=True)
    allowed = (str(SCRIPTS / "kernel_shim"), str(SCRIPTS / "kernel_shim_fallback"))
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(blocked), allowed=allowed))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    return env


def notebook(path: Path, *cells: str | tuple[str, list[str]]) -> Path:
    """Write a minimal nbformat-4 notebook of code cells (a cell: source, or (source, tags))."""
    nb_cells = []
    for cell in cells:
        source, tags = cell if isinstance(cell, tuple) else (cell, [])
        nb_cells.append(
            {
                "cell_type": "code",
                "execution_count": None,
                "metadata": {"tags": tags},
                "outputs": [],
                "source": source,
            }
        )
    nb = {"cells": nb_cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, str(RUNNER), *args],
        cwd=ROOT,
        env=env if env is not None else {**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_runner_reads_the_mime_type_record_publishes() -> None:
    from mgpu_helpers.record import RESULT_MIME

    assert las.RESULT_MIME == RESULT_MIME


def test_ipython_syntax_becomes_calls_and_plain_python_stays() -> None:
    plain = 'x = 1\ntext = """\n%not a magic\n"""\n'
    assert las.to_python(plain) == plain
    got = las.to_python("%matplotlib inline\nimport os\n!ls -l {x}\nfiles = !ls\n  %time f()\n")
    assert got.splitlines() == [
        "get_ipython().run_line_magic('matplotlib', 'inline')",
        "import os",
        "get_ipython().system('ls -l {x}')",
        "files = get_ipython().getoutput('ls')",
        "  get_ipython().run_line_magic('time', 'f()')",
    ]
    cell = las.to_python("%%writefile out.txt\nline 1\n")
    assert cell == "get_ipython().run_cell_magic('writefile', 'out.txt', 'line 1\\n')\n"
    assert las.to_python("y = x != 2\n%env A=1\n").splitlines()[0] == "y = x != 2"


def test_export_marks_each_cell_and_injects_parameters(tmp_path: Path) -> None:
    nb = notebook(tmp_path / "07_demo.ipynb", ("N = 1", ["parameters"]), "print(N)")
    cells = las.export(nb, tmp_path / "demo.py", {"N": 5})
    assert [(c.index, c.tags) for c in cells] == [
        (0, ["parameters"]),
        (-1, ["injected-parameters"]),
        (1, []),
    ]
    lines = (tmp_path / "demo.py").read_text().splitlines()
    assert lines[cells[2].first_line - 1] == "print(N)"  # line numbers point into the file
    with pytest.raises(ValueError, match="no cell tagged 'parameters'"):
        las.export(notebook(tmp_path / "x.ipynb", "1"), tmp_path / "x.py", {"N": 5})


@pytest.mark.slow  # make test-long
def test_a_notebook_runs_as_a_script_without_jupyter_or_tqdm(tmp_path: Path) -> None:
    env = without(tmp_path, [*JUPYTER, "tqdm"])
    blocked = subprocess.run(
        [sys.executable, "-c", "import IPython"], env=env, capture_output=True, text=True
    )
    assert "blocked by the test" in blocked.stderr  # the blocker works
    nb = notebook(
        tmp_path / "09_kernel_features.ipynb",
        ("N = 3", ["parameters"]),
        "%matplotlib inline\n"
        "import sys\n"
        "import matplotlib.pyplot as plt\n"
        "import IPython, ipywidgets, tqdm as tqdm_package\n"
        "from IPython.display import HTML, display\n"
        "from ipywidgets import IntSlider, interact\n"
        "from matplotlib.figure import Figure\n"
        "from tqdm.auto import tqdm\n"
        "from mgpu_helpers.exercises import check\n"
        "from mgpu_helpers.record import record\n"
        "versions = IPython.__version__, ipywidgets.__version__, tqdm_package.__version__\n"
        "print('versions:', *versions)\n"
        "main = sys.modules['__main__']\n"
        "print('main has a file:', hasattr(main, '__file__'), main.__dict__ is globals())",
        "!echo shell says {N * 2}\nlines = !printf 'a\\nb\\n'\nprint('captured', lines)",
        "fig = Figure(figsize=(2, 2))\n"
        "fig.subplots().plot([0, 1], [1, 0])\n"
        "display(fig)\n"
        "display(HTML('<b>bold</b> text'))",
        "plt.plot([1, 2, 3])\nplt.title('left open')\n'the last value'",
        "record('answer', 41.5, 'units')",
        "def show(size, shift=2):\n"
        "    print(f'interact called with size={size} shift={shift}')\n"
        "    f = Figure(figsize=(2, 2))\n"
        "    f.subplots().bar([0], [size])\n"
        "    display(f)\n"
        "_ = interact(show, size=IntSlider(value=7, min=1, max=9), shift=(0, 10))",
        "for _ in tqdm(range(300), desc='counting', mininterval=0):\n    pass",
        "check('exercise 1: fine', lambda: None, hint='none needed')\n"
        "display({'application/vnd.mgpu.check+json': {'name': 'via display', 'passed': True},\n"
        "         'text/plain': 'PASS  via display'}, raw=True)",
        # A worker written in a cell goes to the ranks by value, as from a notebook ...
        "from mgpu_helpers.launch import launch\n"
        "def times_rank(env, k):\n"
        "    return (env.rank + 1) * k * N\n"
        "print('launched:', launch(times_rank, 2, 10, device='cpu', timeout=60))",
        # ... while a naive mp.spawn of one fails, as in a notebook (lesson 04).
        "import torch.multiprocessing as mp\n"
        "def hello(rank):\n"
        "    print('hello from', rank)\n"
        "try:\n"
        "    mp.spawn(hello, nprocs=1)\n"
        "    print('naive spawn: it worked')\n"
        "except Exception as exc:\n"
        "    print('naive spawn failed:', type(exc).__name__)",
    )
    out = tmp_path / "out"
    proc = run(["run", str(nb), "--out", str(out), "--timeout", "100"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "script"  # chosen because the Jupyter stack is missing
    assert not summary["environment"]["IPython"]["ok"]
    assert "MISSING" in proc.stdout and "tqdm" in proc.stdout
    lesson = json.loads((out / nb.stem / "lesson.json").read_text())
    log = (out / nb.stem / "output.log").read_text()
    assert lesson["status"] == "passed", log
    assert "versions: 8.99.0+lesson-script-shim 8.99.0+lesson-script-shim 0+lesson-script" in log
    assert "main has a file: False True" in log  # a kernel's __main__, with no file behind it
    assert "shell says 6" in log and "captured ['a', 'b']" in log
    assert "bold text" in log and "'the last value'" in log
    assert "interact called with size=7 shift=2" in log
    assert lesson["results"] == {"answer": 41.5} and "answer = 41.5 units" in log
    assert lesson["checks"] == {"exercise 1: fine": True, "via display": True}
    assert "launched: [30, 60]" in log
    assert "naive spawn failed: ProcessExitedException" in log
    assert "Can't get attribute 'hello' on <module '__main__' (built-in)>" in log
    bars = [line for line in log.splitlines() if line.startswith("counting")]
    assert len(bars) == 1 and "300/300" in bars[0] and "\r" not in log
    assert lesson["figures"] == [
        "figures/cell003-1.png",
        "figures/cell004-1.png",
        "figures/cell006-1.png",
    ]  # display, open pyplot, interact
    for name in lesson["figures"]:
        assert (out / nb.stem / name).read_bytes().startswith(b"\x89PNG")
    displays = json.loads((out / nb.stem / "displays.json").read_text())
    assert {
        "cell": 5,
        "mime": "application/vnd.mgpu.result+json",
        "data": {"name": "answer", "value": 41.5, "unit": "units"},
    } in displays


def test_failures_and_timeouts_are_reported_and_the_next_lesson_runs(tmp_path: Path) -> None:
    failing = notebook(
        tmp_path / "01_fails.ipynb",
        "print('A starts')",
        "x = 1\nraise ValueError(f'boom {x}')",
        "print('NOT REACHED')",
    )
    hanging = notebook(
        tmp_path / "02_hangs.ipynb",
        "import time\nprint('B sleeps', flush=True)\ntime.sleep(120)",
    )
    passing = notebook(
        tmp_path / "03_passes.ipynb",
        ("raise KeyError('expected')", ["raises-exception"]),
        "%%writefile note.txt\nwritten by a cell magic\n",
        "print(open('note.txt').read().strip())\n"
        "from tqdm.auto import tqdm\n"
        "for _ in tqdm(range(300), desc='real tqdm', mininterval=0):\n    pass",
    )
    out = tmp_path / "out"
    start = time.perf_counter()
    proc = run(
        ["run", "--mode", "script", "--timeout", "4", "--out", str(out)]
        + [str(p) for p in (failing, hanging, passing)]
    )
    assert time.perf_counter() - start < 60
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lessons = json.loads((out / "summary.json").read_text())["lessons"]
    assert [r["status"] for r in lessons] == ["failed", "timeout", "passed"]

    failed = lessons[0]
    script_lines = (out / "01_fails" / "01_fails.py").read_text().splitlines()
    assert failed["failed_cell"] == 1 and failed["error"] == "ValueError: boom 1"
    assert script_lines[failed["failed_line"] - 1] == "raise ValueError(f'boom {x}')"
    assert f"cell 1 (script line {failed['failed_line']}): ValueError: boom 1" in proc.stdout
    log = (out / "01_fails" / "output.log").read_text()
    assert "raise ValueError(f'boom {x}')" in log and "NOT REACHED" not in log

    hung = lessons[1]
    assert hung["failed_cell"] == 0 and "ran past its limit of 4 s in cell 0" in hung["error"]
    log = (out / "02_hangs" / "output.log").read_text()
    assert "LessonTimeout" in log and "time.sleep(120)" in log  # where it was stopped

    log = (out / "03_passes" / "output.log").read_text()
    assert "KeyError: 'expected'" in log and "written by a cell magic" in log
    bars = [line for line in log.splitlines() if line.startswith("real tqdm")]
    assert len(bars) == 1 and "300/300" in bars[0]

    # The exported script also runs on its own, the same way (exit status 1: a cell failed).
    direct = subprocess.run(
        [sys.executable, str(out / "01_fails" / "01_fails.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert direct.returncode == 1 and "ValueError: boom 1" in direct.stderr
    assert "A starts" in direct.stdout and "NOT REACHED" not in direct.stdout


@pytest.mark.slow  # make test-long
def test_lesson_00_runs_as_a_script_in_quick_mode(tmp_path: Path) -> None:
    lesson = ROOT / "notebooks" / "00_setup.ipynb"
    out = tmp_path / "out"
    proc = run(["run", str(lesson), "--out", str(out)], env=without(tmp_path, JUPYTER))
    report = json.loads((out / "00_setup" / "lesson.json").read_text())
    assert proc.returncode == 0 and report["status"] == "passed", (
        proc.stdout + (out / "00_setup" / "output.log").read_text()
    )
    assert report["mode"] == "script"
    assert report["checks"] and all(report["checks"].values())
    assert {"gpus", "placement_device_type", "devices_healthy"} <= set(report["results"])
    assert report["figures"] and (out / "00_setup" / report["figures"][0]).is_file()
