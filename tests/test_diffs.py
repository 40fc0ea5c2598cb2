"""mgpu_helpers.diffs: functions read from other lessons' notebooks, and diffs between them."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.diffs import lesson_function, show_diff

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
    after = lesson_function("04", "train_ddp", folder=ROOT / "notebooks")
    diff = show_diff(before, after, ("lesson 02", "lesson 04"))
    assert diff.added > 0 and diff.removed > 0
    assert "+" in diff.text and "DistributedSampler" in diff.text


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
