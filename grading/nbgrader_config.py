"""nbgrader settings for grading the course's exercises (docs/instructors.md, "Autograding").

Load it from the ``nbgrader_config.py`` of your nbgrader course folder::

    c = get_config()
    load_subconfig("/path/to/this/course/grading/nbgrader_config.py")

What it sets up, and why:
- the notebooks run in a kernel of the course's own environment (``.venv``, or the Python
  in ``MGPU_PYTHON``), where torch and ``mgpu_helpers`` import; nbgrader itself may live in
  another environment (the tests use ``.venv-grading``);
- in that kernel ``MGPU_QUICK=1`` (tiny data, few epochs: a lesson takes seconds to a minute)
  and ``MGPU_GRADING=1`` (a failed self-check raises, so nbgrader gives it no points);
- a per-cell timeout that fits quick mode, with room for a slow machine.
"""

import json
import os
from pathlib import Path

c = get_config()  # noqa: F821 (nbgrader's config loader provides it)

# The course's top folder: this file's parent folder, unless MGPU_COURSE says otherwise.
COURSE = Path(os.environ.get("MGPU_COURSE") or Path(__file__).resolve().parents[1])
PYTHON = Path(os.environ.get("MGPU_PYTHON") or COURSE / ".venv" / "bin" / "python")
if not (COURSE / "mgpu_helpers").is_dir():
    raise ValueError(f"{COURSE} is not the course's folder: set MGPU_COURSE to it")
if not PYTHON.exists():
    raise ValueError(f"no Python at {PYTHON}: run `make lab` in {COURSE}, or set MGPU_PYTHON")

# nbgrader starts kernels by kernelspec name: write one for the course's Python in build/ and
# put that folder first on Jupyter's search path (this process and the kernels it starts).
KERNEL = "mgpu-course"
kernels = COURSE / "build" / "grading" / "kernels" / KERNEL
kernels.mkdir(parents=True, exist_ok=True)
spec = {
    "argv": [str(PYTHON), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
    "display_name": "mgpu course (grading)",
    "language": "python",
    "env": {"MGPU_QUICK": "1", "MGPU_GRADING": "1", "PYTHONPATH": str(COURSE)},
}
(kernels / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")
os.environ["JUPYTER_PATH"] = os.pathsep.join(
    filter(None, [str(COURSE / "build" / "grading"), os.environ.get("JUPYTER_PATH")])
)

c.Execute.kernel_name = KERNEL
# Quick-mode cells take seconds; lesson 04a's mp.spawn up to a minute on a busy 2-core machine.
# A hung answer (a collective one rank never joins) still ends, with no points for that cell.
c.Execute.timeout = 300
