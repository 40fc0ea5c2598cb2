"""The package's layout: two halves, imports one way, and cheap to import."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mgpu_helpers"
TOOLING = PACKAGE / "tooling"


def _imported_modules(path: Path, package: str | None = None) -> list[str]:
    """Every module ``path`` imports, as absolute dotted names (relative imports resolved)."""
    package = package or ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append(module)
            found += [f"{module}.{alias.name}" for alias in node.names]  # `from . import x`
    return found


def _helper_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if TOOLING not in p.parents)


def test_the_two_halves_exist():
    assert (TOOLING / "__init__.py").is_file()
    assert {"cli.py", "runner.py", "report.py", "notebooks.py", "student.py"} <= {
        p.name for p in TOOLING.glob("*.py")
    }
    helpers = {p.name for p in _helper_modules()}
    assert not helpers & {"cli.py", "course.py", "notebooks.py", "student.py"}, (
        "course tooling belongs in mgpu_helpers/tooling/"
    )


def test_helpers_never_import_the_tooling():
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _helper_modules()
        for module in _imported_modules(path)
        if module == "mgpu_helpers.tooling" or module.startswith("mgpu_helpers.tooling.")
    ]
    assert not offenders, "helpers must not import tooling (tooling may import helpers):\n" + (
        "\n".join(offenders)
    )


def test_the_import_check_sees_relative_and_absolute_imports(tmp_path):
    # The check above must catch each spelling; try them as a module of the package would.
    spellings = [
        "from .tooling import cli",
        "from . import tooling",
        "from .tooling.runner import run_course",
        "import mgpu_helpers.tooling.cli",
        "from mgpu_helpers.tooling import report",
    ]
    probe = tmp_path / "probe.py"
    for line in spellings:
        probe.write_text(line + "\n")
        modules = _imported_modules(probe, package="mgpu_helpers")
        assert any(m.startswith("mgpu_helpers.tooling") for m in modules), (line, modules)
    probe.write_text("from .devices import gpu_count\nimport torch\n")
    assert not any("tooling" in m for m in _imported_modules(probe, package="mgpu_helpers"))


def test_pyproject_installs_the_subpackage_and_the_command():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]
    assert {"mgpu_helpers", "mgpu_helpers.tooling"} <= set(packages)
    module, _, function = project["project"]["scripts"]["mgpu"].partition(":")
    assert module == "mgpu_helpers.tooling.cli"
    assert callable(getattr(importlib.import_module(module), function))


def _fresh(code: str) -> str:
    # A fresh interpreter: in this one, other tests have already imported the modules.
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_package_loads_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, mgpu_helpers\n"
        "print(sorted(m for m in ('torch', 'matplotlib', 'sklearn') if m in sys.modules))\n"
    )
    assert _fresh(code) == "[]", "importing mgpu_helpers loaded heavy modules"


def test_the_mgpu_command_starts_without_torch() -> None:
    # `mgpu --help`, `mgpu clean` and `mgpu student` stay fast: torch is imported by what needs it.
    code = (
        "import sys\n"
        "from mgpu_helpers.tooling.cli import main\n"
        "print(sorted(m for m in ('torch', 'matplotlib', 'sklearn') if m in sys.modules))\n"
    )
    assert _fresh(code) == "[]"


def test_the_package_has_no_facade() -> None:
    # Every name is imported from the module that defines it; the package exports only its
    # version (no lazy __getattr__ that hides where a name lives).
    import mgpu_helpers

    assert not hasattr(mgpu_helpers, "__getattr__")
    public = {name for name in vars(mgpu_helpers) if not name.startswith("_")}
    assert public <= {"annotations", *_submodules_loaded()}, public


def _submodules_loaded() -> set[str]:
    # Importing mgpu_helpers.x binds x on the package: those attributes are modules, not a facade.
    return {name.split(".")[1] for name in sys.modules if name.startswith("mgpu_helpers.")}
