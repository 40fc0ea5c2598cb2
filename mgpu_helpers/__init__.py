"""Helpers for the hands-on multi-GPU PyTorch course, in two halves.

**Lesson helpers** (this folder): what a notebook imports to learn multi-GPU training, each
module one idea a lesson teaches: ``devices``, ``placement`` and ``doctor`` (00, 01),
``config`` (every lesson), ``timing`` (01), ``data``, ``models`` and ``train`` (02),
``data_parallel`` (03), ``launch`` and ``dist_env`` (04a), ``gaps`` (04b), ``model_parallel`` (05),
``memory`` (05, 06, 08), ``comm`` (06), ``jobs`` (07), ``sharding`` (08),
``tensor_parallel`` (09), ``lm``, ``lm_train``, ``lm_bench`` and ``mfu`` (11: the capstone's
model, its training run, its side-by-side measurement and MFU), ``troubleshooting`` (10: the entries
error messages point to), ``failures`` (10b, 10c: the harness around live failures),
``lesson_code`` (a lesson's code shown as a diff later on, or run by
tests and benchmarks), ``plots``, ``exercises`` and ``record`` (every lesson). Import each
name from the module that defines it
(``from mgpu_helpers.config import LessonConfig, apply_quick``).

**Course tooling** (``tooling/``): the ``mgpu`` command, the headless course runner and its
report, the student edition and the notebook file rules. Tooling imports helpers; no helper
imports tooling.
"""

__version__ = "0.1.0"
