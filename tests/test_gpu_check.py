"""scripts/gpu_check.sh runs every GPU-marked test; a file missing from its list never runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_MARK = re.compile(r"pytest\.mark\.(gpu|multigpu)\b")


def test_every_file_with_gpu_tests_is_in_the_gpu_check() -> None:
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    listed = set(re.findall(r"tests/test_\w+\.py", script))
    marked = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if GPU_MARK.search(path.read_text())
    }
    assert marked, "no GPU-marked test found: has the marker's name changed?"
    missing = sorted(marked - listed)
    assert not missing, f"add {missing} to the gpu_tests step of scripts/gpu_check.sh"
