"""The pointers to lesson 10's entries (mgpu_helpers.troubleshooting)."""

from __future__ import annotations

import pytest

from mgpu_helpers.troubleshooting import ENTRIES, see


def test_the_entries_are_numbered_one_to_fifteen_without_gaps() -> None:
    assert list(ENTRIES) == list(range(1, 16))
    assert all(title and title == title.strip() for title in ENTRIES.values())


def test_see_names_the_lesson_the_entry_and_its_title() -> None:
    assert see(6) == (
        "see lesson 10 (notebooks/10_troubleshooting.ipynb), entry 6: "
        "a collective called on some ranks only"
    )
    with pytest.raises(ValueError, match="entries 1 to 15, not 16"):
        see(16)
