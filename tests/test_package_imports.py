"""The package's top-level names are what the lessons expect, whatever was imported before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_record_is_the_function_after_its_module_was_imported() -> None:
    # A fresh interpreter: in this one, other tests have already imported the modules.
    code = (
        "import mgpu_helpers.course\n"  # imports the submodule mgpu_helpers.record first
        "from mgpu_helpers import record, check\n"
        "assert callable(record), record\n"
        "assert callable(check), check\n"
        "import mgpu_helpers.launch\n"
        "from mgpu_helpers import launch, DistEnv\n"
        "assert launch is mgpu_helpers.launch and callable(launch.launch)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_importing_the_package_loads_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, mgpu_helpers\n"
        "print(sorted(m for m in ('torch', 'matplotlib', 'sklearn') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing mgpu_helpers loaded {done.stdout.strip()}"
