"""A benchmark script run as a learner runs it: from the source tree, found through PYTHONPATH."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ROOT", "load_benchmark", "run_benchmark"]

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(
    name: str,
    *args: str,
    cwd: Path = ROOT,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess:
    """``python benchmarks/<name>.py *args`` with its output captured; ``env`` adds variables.

    Pass another ``cwd`` than the repository to check that PYTHONPATH alone finds the package.
    """
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def load_benchmark(name: str) -> types.ModuleType:
    """benchmarks/<name>.py as a module (its imports and top level run; ``main()`` does not).

    Registered in ``sys.modules`` as ``<name>_benchmark``, so dataclasses defined in it work.
    """
    spec = importlib.util.spec_from_file_location(
        f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
