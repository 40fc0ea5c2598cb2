"""Every lesson, executed in a real Jupyter kernel in quick mode, in both editions.

The instructor edition must run top to bottom with every self-check passing; in the student
edition (solutions replaced by stubs) the exercises must still run, with every self-check
failing and saying the exercise is not implemented yet. Committed notebooks must be clean.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.exercises import VERDICT_MIME
from mgpu_helpers.tooling.notebooks import find_lessons, notebook_problems, parameters_cell_index
from mgpu_helpers.tooling.runner import run_lesson
from mgpu_helpers.tooling.student import BEGIN, make_student_edition, strip_solutions

ROOT = Path(__file__).resolve().parents[1]
LESSONS = find_lessons(ROOT / "notebooks")
IDS = [p.stem for p in LESSONS]


@pytest.fixture
def deadline(request: pytest.FixtureRequest) -> float:
    """Seconds a lesson may run: its runner gives up (and reports where it stood) 30 s before
    pytest's own timeout would stop the test with only the test process's stack."""
    return float(request.config.getini("timeout")) - 30


@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_committed_notebook_is_clean_and_well_formed(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    assert notebook_problems(nb) == []
    intro = nb.cells[0].source.lower()
    number = path.stem.split("_")[0]  # "06", or "06a" for a part
    assert nb.cells[0].cell_type == "markdown" and intro.startswith(f"# lesson {number}:")
    for needed in ("learning objectives", "estimated time", "gpu"):
        assert needed in intro, f"the first cell of {path.name} lacks '{needed}'"
    text = "\n".join(c.source for c in nb.cells)
    assert "recap" in text.lower(), f"{path.name} has no recap"
    solutions = [c for c in nb.cells if c.cell_type == "code" and BEGIN in c.source]
    assert len(solutions) >= 2, f"{path.name} needs at least two exercises with solutions"
    for cell in solutions:
        assert cell.metadata.get("jupyter", {}).get("source_hidden"), "solutions start collapsed"


def with_student_exercises_appended(nb: nbformat.NotebookNode) -> tuple[nbformat.NotebookNode, int]:
    """The lesson, then its exercise section again as the student edition has it.

    One kernel run then checks both editions: the solutions' self-checks run first and must
    pass, the stubs' run after them and must fail. Everything before the first solution cell is
    the same in both editions, so it runs once.
    """
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and BEGIN in c.source)
    combined = copy.deepcopy(nb)
    tail = copy.deepcopy(nb.cells[first:])
    for i, cell in enumerate(tail):
        cell["id"] = f"student-{i}"  # cell ids must stay unique
        if cell.cell_type == "code" and BEGIN in cell.source:
            cell.source = strip_solutions(cell.source)
    combined.cells.extend(tail)
    return combined, len(nb.cells)


def verdicts(cells: list) -> dict[str, tuple[bool, str]]:
    """Self-check name -> (passed, what it showed), from the record beside each verdict."""
    found = {}
    for cell in cells:
        for out in cell.get("outputs", []):
            record = out.get("data", {}).get(VERDICT_MIME)
            if record is not None:
                assert record["name"] not in found, f"'{record['name']}' was shown twice"
                found[record["name"]] = (record["passed"], out["data"]["text/plain"])
    return found


# Lessons whose printed lines fit JupyterLab's output area (about 110 characters: a longer line
# wraps inside words). The others join as their lines are shortened (issue 22).
WITHIN_WIDTH = {"05", "06", "07", "08", "09", "10"}  # "05", "06", "08", "09": their parts
# Shown on purpose and not the lesson's to shorten: torchrun's warning (lesson 07, section 1).
LONG_LINES_ALLOWED = ("Setting OMP_NUM_THREADS environment variable for each process",)


def long_lines(cells: list, width: int = 100) -> list[str]:
    """Printed lines (stream outputs) longer than ``width``, less the allowed ones."""
    printed = "".join(o["text"] for c in cells for o in c.get("outputs", []) if "text" in o)
    return [
        line
        for line in printed.replace("\r", "\n").splitlines()
        if len(line) > width and not line.startswith(LONG_LINES_ALLOWED)
    ]


@pytest.mark.notebook
@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_lesson_runs_in_quick_mode_solutions_pass_and_stubs_fail(
    path: Path, tmp_path: Path, deadline: float
) -> None:
    combined, split = with_student_exercises_appended(nbformat.read(path, as_version=4))
    source = tmp_path / path.name
    nbformat.write(combined, source)
    run = run_lesson(source, tmp_path / "out", quick=True, deadline=deadline)
    assert run.status == "passed", f"{path.name} failed: {run.error}"
    executed = nbformat.read(run.output_path, as_version=4).cells
    if path.stem[:2] in WITHIN_WIDTH:
        assert not long_lines(executed), f"lines over 100 characters: {long_lines(executed)}"
    solutions, stubs = verdicts(executed[:split]), verdicts(executed[split:])
    assert len(solutions) >= 2, f"{path.name} ran {len(solutions)} self-checks, wants >= 2"
    failed = [name for name, (ok, _) in solutions.items() if not ok]
    assert not failed, f"solutions fail their self-checks: {failed}"
    assert stubs.keys() == solutions.keys(), "every exercise needs its check in both editions"
    for name, (ok, printed) in stubs.items():
        assert not ok, f"the stub passes '{name}': that check cannot fail"
        assert f"FAIL  {name}: not implemented yet" in printed, f"'{name}' fails unclearly"


def test_student_edition_has_no_solutions_left(tmp_path: Path) -> None:
    for student in make_student_edition(LESSONS, tmp_path):
        assert BEGIN not in student.read_text()
        assert "raise NotImplementedError()" in student.read_text()


# --- every setting a lesson's parameters cell offers ------------------------------------------

# Each DATASET and each MODEL a lesson offers, at least once (the default run above covers the
# defaults). Pairs are chosen so each run changes a code path: a data set read from files, the
# ResNet with batch normalisation, the MLP. CIFAR-10 and FashionMNIST are small files in the real
# format written by the tests (fake_data.py), found through MGPU_DATA, as a learner's downloads
# would be in data/.
SETTINGS = {
    "02": [
        {"DATASET": "fashionmnist", "MODEL": "mlp"},
        {"DATASET": "cifar10", "MODEL": "resnet"},  # what "auto" picks for colour images
        {"DATASET": "synthetic", "MODEL": "cnn"},
    ],
    "03": [
        {"DATASET": "fashionmnist", "MODEL": "mlp"},
        {"DATASET": "cifar10", "MODEL": "cnn"},
        {"DATASET": "synthetic", "MODEL": "mlp"},
    ],
    "04b": [  # part 04a has no DATASET or MODEL
        {"DATASET": "fashionmnist", "MODEL": "mlp"},
        {"DATASET": "cifar10", "MODEL": "resnet"},  # batch normalisation: "auto"'s pick here
        {"DATASET": "synthetic", "MODEL": "cnn"},
    ],
    "05": [{"DATASET": "fashionmnist"}, {"DATASET": "cifar10"}, {"DATASET": "synthetic"}],
    # Lesson 11's main run and its torchrun resume with the other wraps (4 ranks for the 2-D mesh)
    "11": [{"PARALLEL": "fsdp"}, {"PARALLEL": "fsdp_tp", "WORLD_SIZE": 4}],
}


def settings_of(path: Path) -> list[dict]:
    """The settings runs of a lesson, or of a part (``04b``) when the part has its own entry."""
    part = path.stem.split("_")[0]
    return SETTINGS.get(part, SETTINGS.get(path.stem[:2], []))


SETTING_CASES = [
    pytest.param(
        path, params, id=f"{path.stem.split('_')[0]}-" + "-".join(map(str, params.values()))
    )
    for path in LESSONS
    for params in settings_of(path)
]


@pytest.fixture(scope="module")
def offline_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A data folder with CIFAR-10 and FashionMNIST files, and the environment that finds it."""
    from fake_data import write_cifar10, write_fashionmnist, write_md5_bypass

    root = tmp_path_factory.mktemp("data")
    # Sizes that do not divide by 2 or 3 ranks: evaluation must count every sample once.
    write_fashionmnist(root, n_train=301, n_test=101, learnable=True)
    write_cifar10(root, per_batch=61, n_test=101, learnable=True)
    site = write_md5_bypass(tmp_path_factory.mktemp("site")).parent
    pythonpath = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    return {"MGPU_DATA": str(root), "PYTHONPATH": pythonpath}


def test_every_setting_is_covered() -> None:
    """Each DATASET and MODEL value named in a lesson's parameters cell has a settings run."""
    for path in LESSONS:
        nb = nbformat.read(path, as_version=4)
        offered = parameter_choices(nb.cells[parameters_cell_index(nb)].source)
        covered: dict[str, set[str]] = {}
        for params in [{}, *settings_of(path)]:
            for name, value in params.items():
                covered.setdefault(name, set()).add(value)
        for name, values in offered.items():
            default = values[0]
            missing = set(values) - covered.get(name, set()) - {default}
            assert not missing, f"{path.name}: no settings run with {name} in {sorted(missing)}"


def parameter_choices(source: str) -> dict[str, list[str]]:
    """``NAME = "x"  # "x" ..., "y" or "z"`` -> {NAME: ["x", "y", "z"]} for DATASET and MODEL."""
    choices = {}
    for line in source.splitlines():
        name, _, rest = line.partition("=")
        name = name.strip()
        if name not in ("DATASET", "MODEL"):
            continue
        value, _, comment = rest.partition("#")
        default = value.strip().strip("\"'")
        quoted = re.findall(r'"([a-z0-9]+)"', comment)
        choices[name] = [default, *[q for q in quoted if q != default]]
    return choices


@pytest.mark.notebook
@pytest.mark.settings  # `make test-long` and `make test-settings` (CI runs the first)
@pytest.mark.parametrize(("path", "params"), SETTING_CASES)
def test_lesson_passes_on_each_setting(
    path: Path,
    params: dict,
    offline_data: dict[str, str],
    tmp_path: Path,
    monkeypatch,
    deadline: float,
) -> None:
    for name, value in offline_data.items():
        monkeypatch.setenv(name, value)
    run = run_lesson(path, tmp_path / "out", quick=True, params=params, deadline=deadline)
    assert run.status == "passed", f"{path.name} with {params} failed: {run.error}"
    failed = [name for name, ok in run.checks.items() if not ok]
    assert not failed, f"{path.name} with {params}: self-checks fail: {failed}"
