"""Lesson 10's entries, so that the launcher's and helpers' errors can point to the one to read.

Lesson 10 comes in three parts: 10a (``notebooks/10a_triage_and_reference.ipynb``) leads from
the message you see to its entry and explains NCCL's behaviour, 10b
(``notebooks/10b_processes_and_hangs.ipynb``) produces the failures of starting processes and
of hangs live, 10c (``notebooks/10c_ddp_mistakes.ipynb``) those of DDP. Each common failure has a
numbered entry (``### 6. A collective called on some ranks only``) in one part: the message you
see, its cause, its fix. ``see(6)`` is the short pointer an error message ends with. The numbers
are fixed: 10a's table and the parts' headings use the same ones (a test checks that every
title here is an entry heading of the part named here).
"""

from __future__ import annotations

__all__ = ["ENTRIES", "PARTS", "part_of", "see"]

PARTS: dict[str, str] = {
    "10a": "notebooks/10a_triage_and_reference.ipynb",
    "10b": "notebooks/10b_processes_and_hangs.ipynb",
    "10c": "notebooks/10c_ddp_mistakes.ipynb",
}

# entry: (the part that holds it, its title)
ENTRIES: dict[int, tuple[str, str]] = {
    # starting processes (10b)
    1: ("10b", "a notebook function under `mp.spawn`"),
    2: ("10b", "CUDA initialised before a fork"),
    3: ("10b", "a port taken by another run"),
    4: ("10b", "two ranks on one GPU with NCCL"),
    5: ("10b", "a rank killed (out of host memory)"),
    # hangs (10b), NCCL (10a)
    6: ("10b", "a collective called on some ranks only"),
    7: ("10b", "uneven inputs per rank"),
    8: ("10a", "NCCL and the network"),
    # DDP (10c)
    9: ("10c", "tensors on different devices"),
    10: ("10c", "`device_ids` for a CPU module or a split model"),
    11: ("10c", "unused parameters"),
    12: ("10c", "the `module.` prefix"),
    13: ("10c", "a plain sampler, a forgotten `set_epoch`"),
    14: ("10c", "BatchNorm statistics per rank"),
    15: ("10a", "out of memory on one GPU"),
    # the failures people hit most
    16: ("10b", "one rank skips a step"),
    17: ("10b", "a slow rank, not a missing one"),
    18: ("10c", "a variable marked ready twice"),
    19: ("10c", "everything lands on GPU 0"),
    20: ("10a", "`/dev/shm` too small in a container"),
    21: ("10a", "a device-side assert at the wrong line"),
    22: ("10a", "several machines: the address and the firewall"),
}


def part_of(entry: int) -> str:
    """The part of lesson 10 ("10a", "10b" or "10c") that holds entry ``entry`` (lesson 10a)."""
    if entry not in ENTRIES:
        raise ValueError(f"lesson 10 has entries 1 to {len(ENTRIES)}, not {entry!r}")
    return ENTRIES[entry][0]


def see(entry: int) -> str:
    """The pointer to lesson 10's entry ``entry``, for the end of an error message (lesson 10a).

    ``see(6)`` is "see lesson 10b (notebooks/10b_processes_and_hangs.ipynb), entry 6: a
    collective called on some ranks only". An unknown number is a bug in the caller: ValueError.
    """
    part = part_of(entry)
    return f"see lesson {part} ({PARTS[part]}), entry {entry}: {ENTRIES[entry][1]}"
