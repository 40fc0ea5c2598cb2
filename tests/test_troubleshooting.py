"""The pointers to lesson 10's entries (mgpu_helpers.troubleshooting)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgpu_helpers.troubleshooting import ENTRIES, PARTS, part_of, see

ROOT = Path(__file__).resolve().parents[1]


def test_the_entries_are_numbered_without_gaps_each_in_an_existing_part() -> None:
    assert list(ENTRIES) == list(range(1, len(ENTRIES) + 1))
    for part, title in ENTRIES.values():
        assert title and title == title.strip()
        assert part in PARTS
    assert all((ROOT / path).is_file() for path in PARTS.values()), PARTS


def test_see_names_the_part_the_entry_and_its_title() -> None:
    assert see(6) == (
        "see lesson 10b (notebooks/10b_processes_and_hangs.ipynb), entry 6: "
        "a collective called on some ranks only"
    )
    assert see(8).startswith("see lesson 10a (notebooks/10a_triage_and_reference.ipynb), entry 8")
    assert part_of(11) == "10c"
    with pytest.raises(ValueError, match=f"entries 1 to {len(ENTRIES)}, not 99"):
        see(99)
