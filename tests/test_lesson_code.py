"""mgpu_helpers.lesson_code: lesson code read from notebooks, shown as diffs and run by tests."""

from __future__ import annotations

import math
import os
import traceback
from pathlib import Path

import cloudpickle
import nbformat
import pytest

from mgpu_helpers.lesson_code import (
    lesson_definitions,
    lesson_function,
    lesson_imports,
    load_lesson_code,
    script_function,
    show_diff,
)

ROOT = Path(__file__).resolve().parents[1]


def _lesson(folder: Path, name: str, cells: list[str]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Lesson")]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in cells]
    path = folder / name
    nbformat.write(nb, path)
    return path


def test_lesson_function_finds_a_function_in_a_code_cell(tmp_path: Path) -> None:
    _lesson(
        tmp_path,
        "02_demo.ipynb",
        [
            "%matplotlib inline\nimport torch\n\n\ndef helper(x):\n    return x\n",
            "@torch.no_grad()\ndef train(cfg, device):\n    '''Doc.'''\n    return cfg\n"
            "\n\nx = 1\n",
        ],
    )
    source = lesson_function("02", "train", folder=tmp_path)
    assert source == "@torch.no_grad()\ndef train(cfg, device):\n    '''Doc.'''\n    return cfg\n"
    assert lesson_function("02", "helper", folder=tmp_path).startswith("def helper(x):")


def test_the_last_definition_wins_and_a_path_works(tmp_path: Path) -> None:
    path = _lesson(tmp_path, "03_x.ipynb", ["def f():\n    return 1\n", "def f():\n    return 2\n"])
    assert "return 2" in lesson_function(str(path), "f")


def test_a_missing_function_names_the_lesson_and_what_it_defines(tmp_path: Path) -> None:
    _lesson(tmp_path, "02_demo.ipynb", ["def fit_one(x):\n    pass\n", "def other():\n    pass\n"])
    with pytest.raises(
        ValueError, match=r"02_demo\.ipynb defines no function 'train'.*fit_one, other"
    ):
        lesson_function("02", "train", folder=tmp_path)


def test_a_missing_lesson_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no notebook for lesson '07'.*pass folder="):
        lesson_function("07", "train", folder=tmp_path)


def test_lesson_two_and_four_define_what_lesson_four_diffs() -> None:
    before = lesson_function("02", "train", folder=ROOT / "notebooks")
    after = lesson_function("04b", "train_ddp", folder=ROOT / "notebooks")
    diff = show_diff(before, after, ("lesson 02", "lesson 04b"))
    assert diff.added > 0 and diff.removed > 0
    assert "+" in diff.text and "DistributedSampler" in diff.text


LESSON_CELLS = [
    "%matplotlib inline\nimport math\n",
    "SCALE: float = 2.0\nOFFSET = 1\nprint('not a definition')\n",
    "class Scaler:\n    factor: float = SCALE\n\n    def __call__(self, x):\n"
    "        return math.sqrt(x) * self.factor + OFFSET\n",
    "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return Scaler()(x)\n",
]


def test_classes_and_assignments_are_found_in_notebook_order(tmp_path: Path) -> None:
    _lesson(tmp_path, "05_demo.ipynb", LESSON_CELLS)
    found = lesson_definitions("05", folder=tmp_path)
    assert list(found) == ["SCALE", "OFFSET", "Scaler", "root"]
    assert [d.kind for d in found.values()] == ["assignment", "assignment", "class", "function"]
    assert found["SCALE"].source == "SCALE: float = 2.0\n"
    assert found["Scaler"].source.startswith("class Scaler:") and "OFFSET" in found["Scaler"].source


def test_loaded_code_runs_in_the_namespace_given(tmp_path: Path) -> None:
    _lesson(tmp_path, "05_demo.ipynb", LESSON_CELLS)
    namespace = {"math": math}
    code = load_lesson_code("05", ["root", "Scaler", "SCALE", "OFFSET"], namespace, tmp_path)
    assert code.root(9.0) == 7.0 and code.SCALE == 2.0 and code.Scaler.factor == 2.0
    assert namespace["root"] is code.root  # defined in the namespace, which the code reads
    namespace["OFFSET"] = 0
    assert code.root(9.0) == 6.0


def test_lesson_imports_binds_what_the_lessons_imports_bind_and_skips_what_is_missing(
    tmp_path: Path,
) -> None:
    _lesson(
        tmp_path,
        "09_demo.ipynb",
        [
            "%matplotlib inline\nimport math\nfrom pathlib import Path as P\nx = 1\n",
            "import no_such_module_here\n\n\ndef f():\n    import json\n",  # not top level
            "from os import sep, path as osp\n",
        ],
    )
    found = lesson_imports("09", tmp_path)
    assert found == {"math": math, "P": Path, "sep": os.sep, "osp": os.path}
    # the namespace load_lesson_code needs, from the lesson itself
    _lesson(tmp_path, "05_demo.ipynb", ["import math\n", *LESSON_CELLS])
    names = ["root", "Scaler", "SCALE", "OFFSET"]
    assert load_lesson_code("05", names, lesson_imports("05", tmp_path), tmp_path).root(9.0) == 7.0


def test_a_traceback_through_loaded_code_names_the_notebook_and_line(tmp_path: Path) -> None:
    _lesson(tmp_path, "05_demo.ipynb", LESSON_CELLS)
    code = load_lesson_code("05", ["root"], {"math": math, "Scaler": object}, tmp_path)
    with pytest.raises(ValueError, match="negative") as raised:
        code.root(-1.0)
    frame = traceback.extract_tb(raised.tb)[-1]
    assert frame.filename == f"{tmp_path.resolve() / '05_demo.ipynb'} (cell 5)"
    assert (frame.lineno, frame.name, frame.line) == (3, "root", "raise ValueError('negative')")


def test_missing_names_name_the_notebook_and_what_it_defines(tmp_path: Path) -> None:
    _lesson(tmp_path, "05_demo.ipynb", LESSON_CELLS)
    with pytest.raises(
        ValueError,
        match=r"05_demo\.ipynb defines no 'gpipe_step', 'cut' in its code cells; it defines: "
        r"Scaler, root \(and 2 assigned names\)",
    ):
        load_lesson_code("05", ["gpipe_step", "root", "cut"], {"math": math}, tmp_path)


def test_names_the_code_reads_must_be_in_the_namespace(tmp_path: Path) -> None:
    _lesson(tmp_path, "05_demo.ipynb", LESSON_CELLS)
    with pytest.raises(ValueError, match=r"Scaler in 05_demo\.ipynb uses OFFSET, SCALE, math"):
        load_lesson_code("05", ["Scaler"], {}, tmp_path)
    namespace: dict = {}
    with pytest.raises(ValueError, match=r"uses math, which the namespace lacks"):
        load_lesson_code("05", ["Scaler", "SCALE", "OFFSET"], namespace, tmp_path)
    assert "Scaler" not in namespace  # nothing ran


def test_loaded_functions_pickle_by_value_for_the_ranks(tmp_path: Path) -> None:
    _lesson(tmp_path, "05_demo.ipynb", LESSON_CELLS)
    code = load_lesson_code("05", ["root", "Scaler", "SCALE", "OFFSET"], {"math": math}, tmp_path)
    assert code.root.__module__ == "05_demo"  # no importable module: cloudpickle sends the code
    copy = cloudpickle.loads(cloudpickle.dumps(code.root))
    assert copy is not code.root and copy(16.0) == 9.0


def test_the_lessons_code_loads_with_their_imports() -> None:
    import torch

    code = load_lesson_code("03", ["scatter"], {"torch": torch}, folder=ROOT / "notebooks")
    shards = code.scatter(torch.arange(5.0), torch.arange(5), ["cpu", "cpu"])
    assert [len(x) for x, _ in shards] == [3, 2]


def test_show_diff_marks_added_and_removed_lines() -> None:
    before = "def f(x):\n    y = x + 1\n    return y\n"
    after = "def f(x):\n    y = x + 2\n    z = y\n    return y\n"
    diff = show_diff(before, after, ("one", "two"))
    lines = diff.text.splitlines()
    assert lines[:2] == ["--- one", "+++ two"]
    assert "-    y = x + 1" in lines and "+    y = x + 2" in lines and "+    z = y" in lines
    assert " def f(x):" in lines and "     return y" in lines  # whole function as context
    assert (diff.added, diff.removed) == (2, 1)
    assert str(diff) == repr(diff) == diff.text


def test_show_diff_html_colours_changes_and_escapes_code() -> None:
    diff = show_diff("a = 1 < 2\n", "a = 1 < 3\n")
    page = diff._repr_html_()
    assert "&lt;" in page and "1 < 3" not in page  # escaped
    assert page.count("background:#e6ffec") == 1 and page.count("background:#ffebe9") == 1
    assert "1 line(s) added, 1 removed" in page


def test_identical_sources_give_an_empty_diff() -> None:
    diff = show_diff("x = 1\n", "x = 1\n")
    assert diff.text == "" and (diff.added, diff.removed) == (0, 0)


def test_limited_context_hides_far_unchanged_lines() -> None:
    before = "".join(f"line{i}\n" for i in range(20))
    after = before.replace("line10\n", "changed\n")
    lines = show_diff(before, after, context=1).text.splitlines()
    assert " line9" in lines and " line11" in lines and " line0" not in lines


def test_script_function_reads_a_function_from_a_file_without_running_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import no_such_module  # never imported: the file is parsed, not run\n\n\n"
        "def helper():\n    return 1\n\n\n"
        "@decorator\ndef train_ddp(env, cfg):\n    '''Doc.'''\n    return cfg\n\n\n"
        "if __name__ == '__main__':\n    raise SystemExit(1)\n"
    )
    source = script_function(script, "train_ddp")
    assert source == "@decorator\ndef train_ddp(env, cfg):\n    '''Doc.'''\n    return cfg\n"
    assert script_function(str(script), "helper") == "def helper():\n    return 1\n"


def test_script_function_names_what_the_file_defines(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("def main():\n    pass\n\n\ndef parse():\n    pass\n\n\nx = 1\n")
    missing = r"train\.py defines no top-level function 'train'.*main, parse"
    with pytest.raises(ValueError, match=missing):
        script_function(script, "train")
    with pytest.raises(ValueError, match=r"no Python file at .*missing\.py"):
        script_function(tmp_path / "missing.py", "train")


def test_script_function_diffs_against_a_lesson_function(tmp_path: Path) -> None:
    _lesson(tmp_path, "04_demo.ipynb", ["def train_ddp(env):\n    x = 1\n    return x\n"])
    script = tmp_path / "train.py"
    script.write_text("def train_ddp(env):\n    x = 1\n    save(x)\n    return x\n")
    lesson = lesson_function("04", "train_ddp", folder=tmp_path)
    diff = show_diff(lesson, script_function(script, "train_ddp"))
    assert (diff.added, diff.removed) == (1, 0) and "+    save(x)" in diff.text
