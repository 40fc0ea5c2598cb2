"""Is this environment ready for the course? Findings, not printouts (lesson 00, `mgpu doctor`).

:func:`diagnose` looks at the install, the driver and the GPUs and returns one
:class:`Finding` per fact or verdict. Nothing here prints: ``mgpu doctor`` prints the findings
as a report (``mgpu_helpers/tooling/cli.py``) and lesson 00 reads the same findings, so the
verdicts are decided once. Like :func:`mgpu_helpers.devices.describe_hardware`, looking creates
no CUDA context in the calling process.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from mgpu_helpers.config import course_root
from mgpu_helpers.devices import Hardware, describe_hardware, nvidia_smi
from mgpu_helpers.placement import place

__all__ = ["LEVELS", "PINNED", "Finding", "diagnose", "exit_code", "first"]

LEVELS = ("ok", "info", "warning", "problem")  # a check passed, a fact, worth fixing, broken
PINNED = {"torch": "2.14.1", "torchvision": "0.29.1"}  # as requirements.txt pins them
BUSY_SHARE = 0.05  # a GPU with more of its memory in use than this is held by another process


@dataclass(frozen=True)
class Finding:
    """One fact or verdict about this environment (lesson 00; a line of `mgpu doctor`)."""

    level: str  # one of LEVELS; "problem" means the course cannot run as installed
    topic: str  # what it is about ("torch", "driver", "gpu memory", ...): the report's left column
    message: str  # what was found, in one sentence (several lines for tables)
    fix: str = ""  # what to do about it: required for warnings and problems

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.level in ("warning", "problem") and not self.fix:
            raise ValueError(f"a {self.level} needs a fix that says what to do")


def exit_code(findings: Sequence[Finding]) -> int:
    """1 when any finding is a problem (the install is broken), else 0: `mgpu doctor`'s status."""
    return 1 if any(f.level == "problem" for f in findings) else 0


def first(findings: Sequence[Finding], topic: str) -> Finding:
    """The first finding about ``topic`` (lesson 00 reads the driver verdict this way)."""
    for f in findings:
        if f.topic == topic:
            return f
    topics = ", ".join(dict.fromkeys(f.topic for f in findings))
    raise ValueError(f"no finding about {topic!r}; the topics found: {topics}")


def _reinstall() -> str:
    return f"pip install torch=={PINNED['torch']} torchvision=={PINNED['torchvision']}"


def _versions() -> list[Finding]:
    found = []
    for name, want in PINNED.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = "missing"
        if not have.startswith(want):
            found.append(
                Finding(
                    "warning",
                    "versions",
                    f"{name} {have} installed; the course pins {want}",
                    "pip install -r requirements.txt",
                )
            )
    return found


def _torchvision() -> Finding:
    try:
        import torch
        import torchvision
        from torchvision.ops import nms

        nms(torch.zeros(1, 4), torch.zeros(1), 0.5)  # fails when torchvision does not match torch
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return Finding(
            "problem",
            "torchvision",
            f"torchvision is broken ({first_line})",
            f"reinstall the matching pair: {_reinstall()}",
        )
    return Finding("info", "torchvision", torchvision.__version__)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def _driver(hw: Hardware, smi_installed: bool, listing: str | None, header: str) -> Finding:
    """Does the torch build suit the driver and the GPUs? (lesson 00, section 5.2).

    The CUDA probe decides: when it found GPUs without an error, CUDA works, whatever
    nvidia-smi says (a forward-compatibility package lets an older-major driver run a newer
    CUDA, as in NGC containers; WSL2 keeps nvidia-smi off the PATH). The driver's CUDA version
    from nvidia-smi only explains why CUDA does not work.
    """
    build = hw.cuda_build
    found = re.search(r"CUDA Version:\s*([\d.]+)", header)
    driver_cuda = found.group(1) if found else None
    if hw.gpus and not hw.cuda_error:
        works = f"torch for CUDA {build or '?'} sees {len(hw.gpus)} GPU(s)"
        if driver_cuda and build and _version(driver_cuda)[:1] < _version(build)[:1]:
            return Finding(
                "ok",
                "driver",
                f"{works}, although nvidia-smi reports a driver for CUDA {driver_cuda}, an older "
                "major version: a CUDA forward-compatibility package (datacenter GPUs, e.g. NGC "
                "containers) bridges the gap",
            )
        if driver_cuda and build and _version(driver_cuda) < _version(build):
            return Finding(
                "ok",
                "driver",
                f"{works}; the driver (CUDA {driver_cuda}) is older than torch's CUDA {build} but "
                "of the same major version, which works (minor-version compatibility); only "
                "PTX-only GPU code and the newest CUDA features need a newer driver",
            )
        if not smi_installed:
            return Finding(
                "ok", "driver", f"{works} (nvidia-smi is not on the PATH, as under WSL2)"
            )
        return Finding("ok", "driver", works)
    if not smi_installed and hw.gpus:  # the probe found GPUs but failed on them
        return Finding(
            "problem",
            "driver",
            f"torch finds {len(hw.gpus)} GPU(s) but cannot use them, and nvidia-smi is not on "
            "the PATH to say why",
            "install or repair the NVIDIA driver (its nvidia-smi shows the CUDA version it "
            "supports)",
        )
    if not smi_installed:
        if build is None:
            return Finding(
                "ok",
                "driver",
                "CPU-only torch on a machine without NVIDIA GPUs; every lesson runs on the CPU",
            )
        return Finding(
            "ok",
            "driver",
            f"a CUDA {build} build of torch, but no NVIDIA driver: torch uses the CPU",
        )
    if listing is None:
        return Finding(
            "problem",
            "driver",
            "nvidia-smi is installed but fails",
            "run nvidia-smi in a terminal to see why (often a driver that is not loaded)",
        )
    if not listing.strip():
        return Finding("info", "driver", "the NVIDIA driver is installed but lists no GPU")
    if build is None:
        return Finding(
            "problem",
            "driver",
            "nvidia-smi lists GPUs but torch sees none: this torch is a CPU-only build",
            f"install the CUDA build: {_reinstall()}",
        )
    if driver_cuda and _version(driver_cuda)[:1] < _version(build)[:1]:
        major = _version(driver_cuda)[0]
        return Finding(
            "problem",
            "driver",
            f"the driver supports CUDA {driver_cuda}, an older major version than torch's "
            f"CUDA {build}: torch cannot use the GPUs",
            f"update the NVIDIA driver, or install a torch built for CUDA {major} (datacenter "
            "GPUs: or the CUDA forward-compatibility package)",
        )
    return Finding(
        "problem",
        "driver",
        "nvidia-smi lists GPUs but torch " + ("cannot use them" if hw.gpus else "sees none"),
        f"update the NVIDIA driver to one that supports CUDA {build}, or install a torch "
        "built for an older CUDA",
    )


def _gpu_memory(usage: str | None) -> list[Finding]:
    """GPU memory already in use before the course starts (lesson 00, section 5.3)."""
    found = []
    checked = 0
    for line in (usage or "").strip().splitlines():
        try:
            index, used, total = (int(float(part)) for part in line.split(","))
        except ValueError:  # "[N/A]" on some GPUs, e.g. MIG partitions
            continue
        checked += 1
        if total > 0 and used / total >= BUSY_SHARE:
            found.append(
                Finding(
                    "warning",
                    "gpu memory",
                    f"GPU {index}: {used:,} of {total:,} MiB already in use ({used / total:.0%})",
                    "another process holds it; `nvidia-smi --query-compute-apps=pid,used_memory "
                    "--format=csv` names it: stop it, or use another GPU",
                )
            )
    if checked and not found:
        found.append(
            Finding(
                "ok", "gpu memory", f"under {BUSY_SHARE:.0%} in use on each of {checked} GPU(s)"
            )
        )
    return found


def _hidden_gpus(hw: Hardware, names: str | None) -> list[Finding]:
    """GPUs the driver lists that CUDA_VISIBLE_DEVICES hides from torch (section 5.5)."""
    listed = sum(line.startswith("GPU ") for line in (names or "").splitlines())
    if hw.visible_devices is None or listed <= len(hw.gpus):
        return []
    return [
        Finding(
            "warning",
            "visible GPUs",
            f"torch sees {len(hw.gpus)} of the {listed} GPUs the driver lists "
            f"(CUDA_VISIBLE_DEVICES={hw.visible_devices!r})",
            "unset CUDA_VISIBLE_DEVICES unless you (or your scheduler) set it on purpose",
        )
    ]


def _cpu_cores(hw: Hardware) -> Finding:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else hw.cpu_count
    return Finding("info", "CPU cores", f"{hw.cpu_count} ({usable} usable by this process)")


def _disk(min_free_gib: float) -> Finding:
    root = course_root()
    free = shutil.disk_usage(root).free / 2**30
    message = f"{free:.1f} GiB free where the course is ({root})"
    if free < min_free_gib:
        return Finding(
            "warning",
            "disk",
            message,
            f"free some space: data sets and checkpoints want at least {min_free_gib:g} GiB",
        )
    return Finding("ok", "disk", message)


def _gpu_lines(hw: Hardware) -> list[Finding]:
    if not hw.gpus:
        return [Finding("info", "GPUs", "none visible to torch")]
    found = [
        Finding(
            "info",
            f"cuda:{g.index}",
            f"{g.name}, {g.total_memory_gib} GiB, compute capability "
            f"{g.capability[0]}.{g.capability[1]}, {g.multi_processor_count} SMs",
        )
        for g in hw.gpus
    ]
    if len(hw.gpus) > 1:
        pairs = [
            f"{i}->{j}:{'yes' if ok else 'no'}"
            for i, row in enumerate(hw.peer_access)
            for j, ok in enumerate(row)
            if i != j
        ]
        found.append(Finding("info", "peer access", "  ".join(pairs)))
    return found


def diagnose(
    hardware: Hardware | None = None, *, min_free_disk_gib: float = 10.0
) -> tuple[Finding, ...]:
    """Everything `mgpu doctor` reports, as findings in report order (lesson 00).

    Facts come as ``info``, passed checks as ``ok``; ``warning`` and ``problem`` findings carry
    the fix. :func:`exit_code` turns them into the doctor's status. ``hardware``: what
    :func:`~mgpu_helpers.devices.describe_hardware` returned, when the caller has it already.
    """
    hw = describe_hardware() if hardware is None else hardware
    findings = [
        Finding("info", "python", f"{hw.python} ({sys.executable})"),
        Finding(
            "info", "torch", f"{hw.torch}  (CUDA build: {hw.cuda_build or 'none, CPU-only build'})"
        ),
        *_versions(),
        _torchvision(),
        Finding(
            "info",
            "backends",
            f"{', '.join(hw.backends) or 'none'}  (NCCL {hw.nccl_version or '-'})",
        ),
    ]
    if "gloo" not in hw.backends:
        findings.append(
            Finding(
                "problem",
                "backends",
                "torch.distributed has no gloo backend",
                "reinstall torch from the official wheels (pip install -r requirements.txt)",
            )
        )
    findings += [
        _cpu_cores(hw),
        Finding("info", "CUDA_VISIBLE_DEVICES", repr(hw.visible_devices)),
        Finding("info", "MPS (Apple)", "available" if hw.mps_available else "no"),
        *_gpu_lines(hw),
    ]
    listing = nvidia_smi(
        "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"
    )
    if listing:
        findings.append(Finding("info", "nvidia-smi", listing.strip()))
        topology = nvidia_smi("topo", "-m")
        if topology and len(hw.gpus) > 1:
            findings.append(Finding("info", "topology", topology.rstrip()))
    smi_installed = listing is not None or shutil.which("nvidia-smi") is not None
    findings.append(_driver(hw, smi_installed, listing, nvidia_smi() or ""))
    if hw.cuda_error:
        findings.append(
            Finding(
                "problem",
                "cuda",
                f"CUDA is present but unusable ({hw.cuda_error})",
                "check the driver (nvidia-smi) and that no other process holds the GPUs in "
                "exclusive mode",
            )
        )
    if listing:
        findings += _hidden_gpus(hw, nvidia_smi("-L"))
        findings += _gpu_memory(
            nvidia_smi(
                "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"
            )
        )
    findings.append(_disk(min_free_disk_gib))
    try:
        import ipykernel  # noqa: F401
    except ImportError:
        findings.append(
            Finding(
                "warning",
                "ipykernel",
                "ipykernel is missing: notebooks cannot run",
                "pip install -r requirements.txt",
            )
        )
    # Where the multi-device lessons' ranks would run: one per GPU, at least two (lesson 00).
    placement = place(max(2, len(hw.gpus)), share_gpus=True, n_gpus=len(hw.gpus))
    findings.append(Finding("info", "placement", "\n".join([placement.banner(), *placement.notes])))
    return tuple(findings)
