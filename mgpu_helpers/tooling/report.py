"""The course report: what `make course` writes after running the lessons (report.html/json)."""

from __future__ import annotations

import html
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from mgpu_helpers.util import write_json

if TYPE_CHECKING:
    from mgpu_helpers.tooling.runner import LessonRun

__all__ = ["write_report"]


def write_report(runs: list[LessonRun], out_dir: str | Path, *, quick: bool) -> Path:
    """Write ``report.html`` and ``report.json``: per lesson status, time, results; hardware."""
    from mgpu_helpers.devices import describe_hardware, hardware_as_dict
    from mgpu_helpers.placement import place

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hw = describe_hardware()
    n_gpus = len(hw.gpus)
    placement = place(max(2, n_gpus), share_gpus=True, n_gpus=n_gpus)  # the lessons' default
    data = {
        "mode": "quick" if quick else "full",
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "hardware": hardware_as_dict(hw),
        "placement": placement.banner(),
        "lessons": [asdict(r) for r in runs],
    }
    write_json(out_dir / "report.json", data)
    path = out_dir / "report.html"
    path.write_text(_html(data, runs))
    return path


def _error_html(error: str) -> str:
    """A one-line error as code; a longer one (a hang's report) folded under its first line."""
    first, _, rest = error.partition("\n")
    if not rest:
        return f"<code>{html.escape(first)}</code>"
    summary = f"<summary><code>{html.escape(first)}</code></summary>"
    return f"<details>{summary}<pre>{html.escape(rest)}</pre></details>"


def _html(data: dict, runs: list[LessonRun]) -> str:
    e = html.escape
    hw = data["hardware"]
    gpus = (
        "".join(
            f"<li>cuda:{g['index']}: {e(g['name'])}, {g['total_memory_gib']} GiB, "
            f"compute capability {g['capability'][0]}.{g['capability'][1]}</li>"
            for g in hw["gpus"]
        )
        or "<li>none (CPU only)</li>"
    )
    rows = []
    for r in runs:
        results = "<br>".join(f"{e(str(k))} = {e(_fmt(v))}" for k, v in r.results.items())
        passed = sum(r.checks.values())
        checks = f"{passed}/{len(r.checks)}" if r.checks else "-"
        status = (
            '<td class="ok">passed</td>'
            if r.status == "passed"
            else f'<td class="bad">failed<br>{_error_html(r.error)}</td>'
        )
        link = e(Path(r.output_path).name)
        rows.append(
            f'<tr><td><a href="{link}">{e(r.name)}</a><br>'
            f'<small><a href="{e(r.name)}.kernel.log">kernel log</a></small></td>{status}'
            f"<td>{r.seconds:.1f} s</td><td>{results or '-'}</td><td>{checks}</td></tr>"
        )
    failed = sum(r.status != "passed" for r in runs)
    summary = f"{len(runs) - failed} of {len(runs)} lessons passed"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Multi-GPU course report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 70em; }}
table {{ border-collapse: collapse; width: 100%; }}
td, th {{ border: 1px solid #ccc; padding: .4em .6em; vertical-align: top; text-align: left; }}
.ok {{ color: #176a2c; font-weight: bold; }} .bad {{ color: #a11; font-weight: bold; }}
code {{ white-space: pre-wrap; }}
</style></head><body>
<h1>Multi-GPU course report</h1>
<p><b>{e(summary)}</b>, {e(data["mode"])} mode, finished {e(data["finished"])}.</p>
<h2>Hardware</h2>
<ul><li>Python {e(hw["python"])}, torch {e(hw["torch"])}, CUDA build {e(str(hw["cuda_build"]))},
NCCL {e(str(hw["nccl_version"]))}, {hw["cpu_count"]} CPU cores</li>
<li>GPUs:<ul>{gpus}</ul></li><li>Placement: {e(data["placement"])}</li></ul>
<h2>Lessons</h2>
<table><tr><th>lesson</th><th>status</th><th>time</th><th>key results</th><th>self-checks</th></tr>
{"".join(rows)}
</table></body></html>
"""


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
