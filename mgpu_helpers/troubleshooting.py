"""Lesson 10's entries, so that the launcher's and helpers' errors can point to the one to read.

Lesson 10 (``notebooks/10_troubleshooting.ipynb``) gives each common failure of a multi-GPU run
a numbered entry (``### 6. A collective called on some ranks only``): the message you see, the
error produced live, its cause and its fix. ``see(6)`` is the short pointer an error message
ends with. The numbers are fixed: the lesson's table and its headings use the same ones (a test
checks that every title here is an entry heading of the lesson).
"""

from __future__ import annotations

__all__ = ["ENTRIES", "LESSON", "see"]

LESSON = "notebooks/10_troubleshooting.ipynb"

ENTRIES: dict[int, str] = {
    # starting processes
    1: "a notebook function under `mp.spawn`",
    2: "CUDA initialised before a fork",
    3: "a port taken by another run",
    4: "two ranks on one GPU with NCCL",
    5: "a rank killed (out of host memory)",
    # hangs
    6: "a collective called on some ranks only",
    7: "uneven inputs per rank",
    8: "NCCL and the network",
    # DDP
    9: "tensors on different devices",
    10: "`device_ids` for a CPU module or a split model",
    11: "unused parameters",
    12: "the `module.` prefix",
    13: "a plain sampler, a forgotten `set_epoch`",
    14: "BatchNorm statistics per rank",
    15: "out of memory on one GPU",
}


def see(entry: int) -> str:
    """The pointer to lesson 10's entry ``entry``, for the end of an error message (lesson 10).

    ``see(6)`` is "see lesson 10 (notebooks/10_troubleshooting.ipynb), entry 6: a collective
    called on some ranks only". An unknown number is a bug in the caller: ValueError.
    """
    if entry not in ENTRIES:
        raise ValueError(f"lesson 10 has entries 1 to {len(ENTRIES)}, not {entry!r}")
    return f"see lesson 10 ({LESSON}), entry {entry}: {ENTRIES[entry]}"
