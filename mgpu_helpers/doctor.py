"""Is this environment ready for the course? Findings, not printouts (lesson 00, `mgpu doctor`).

``mgpu doctor`` prints the findings of :func:`diagnose` (``tooling/cli.py``) and lesson 00 reads
them, so each verdict is decided once. Looking creates no CUDA context in the calling process.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mgpu_helpers.config import course_root
from mgpu_helpers.devices import Hardware, describe_hardware, nvidia_smi
from mgpu_helpers.placement import place, usable_cpus

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


_REINSTALL = f"pip install torch=={PINNED['torch']} torchvision=={PINNED['torchvision']}"


def _versions() -> Iterator[Finding]:
    for name, want in PINNED.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = "missing"
        if not have.startswith(want):
            message = f"{name} {have} installed; the course pins {want}"
            yield Finding("warning", "versions", message, "pip install -r requirements.txt")


def _torchvision() -> Finding:
    try:
        import torch
        import torchvision
        from torchvision.ops import nms

        nms(torch.zeros(1, 4), torch.zeros(1), 0.5)  # fails when torchvision does not match torch
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        fix = f"reinstall the matching pair: {_REINSTALL}"
        return Finding("problem", "torchvision", f"torchvision is broken ({first_line})", fix)
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
    driver = found.group(1) if found else None
    have, want = _version(driver or ""), _version(build or "")
    older = bool(driver and build) and have < want
    older_major = older and have[:1] < want[:1]

    def verdict(level: str, message: str, fix: str = "") -> Finding:
        return Finding(level, "driver", message, fix)

    if hw.gpus and not hw.cuda_error:
        works = f"torch for CUDA {build or '?'} sees {len(hw.gpus)} GPU(s)"
        if older_major:
            return verdict(
                "ok",
                f"{works}, although nvidia-smi reports a driver for CUDA {driver}, an older "
                "major version: a CUDA forward-compatibility package (datacenter GPUs, e.g. NGC "
                "containers) bridges the gap",
            )
        if older:
            return verdict(
                "ok",
                f"{works}; the driver (CUDA {driver}) is older than torch's CUDA {build} but "
                "of the same major version, which works (minor-version compatibility); only "
                "PTX-only GPU code and the newest CUDA features need a newer driver",
            )
        return verdict(
            "ok",
            works + ("" if smi_installed else " (nvidia-smi is not on the PATH, as under WSL2)"),
        )
    if not smi_installed and hw.gpus:  # the probe found GPUs but failed on them
        return verdict(
            "problem",
            f"torch finds {len(hw.gpus)} GPU(s) but cannot use them, and nvidia-smi is not on "
            "the PATH to say why",
            "install or repair the NVIDIA driver (its nvidia-smi shows the CUDA version it "
            "supports)",
        )
    if not smi_installed and build is None:
        return verdict(
            "ok", "CPU-only torch on a machine without NVIDIA GPUs; every lesson runs on the CPU"
        )
    if not smi_installed:
        return verdict(
            "ok", f"a CUDA {build} build of torch, but no NVIDIA driver: torch uses the CPU"
        )
    if listing is None:
        fix = "run nvidia-smi in a terminal to see why (often a driver that is not loaded)"
        return verdict("problem", "nvidia-smi is installed but fails", fix)
    if not listing.strip():
        return verdict("info", "the NVIDIA driver is installed but lists no GPU")
    if build is None:
        return verdict(
            "problem",
            "nvidia-smi lists GPUs but torch sees none: this torch is a CPU-only build",
            f"install the CUDA build: {_REINSTALL}",
        )
    if older_major:
        return verdict(
            "problem",
            f"the driver supports CUDA {driver}, an older major version than torch's "
            f"CUDA {build}: torch cannot use the GPUs",
            f"update the NVIDIA driver, or install a torch built for CUDA {have[0]} (datacenter "
            "GPUs: or the CUDA forward-compatibility package)",
        )
    return verdict(
        "problem",
        "nvidia-smi lists GPUs but torch " + ("cannot use them" if hw.gpus else "sees none"),
        f"update the NVIDIA driver to one that supports CUDA {build}, or install a torch "
        "built for an older CUDA",
    )


def _gpu_memory(usage: str | None) -> Iterator[Finding]:
    """GPU memory already in use before the course starts (lesson 00, section 5.3)."""
    busy, checked = 0, 0
    fix = (
        "another process holds it; `nvidia-smi --query-compute-apps=pid,used_memory "
        "--format=csv` names it: stop it, or use another GPU"
    )
    for line in (usage or "").strip().splitlines():
        try:
            index, used, total = (int(float(part)) for part in line.split(","))
        except ValueError:  # "[N/A]" on some GPUs, e.g. MIG partitions
            continue
        checked += 1
        if total > 0 and used / total >= BUSY_SHARE:
            busy += 1
            message = f"GPU {index}: {used:,} of {total:,} MiB already in use ({used / total:.0%})"
            yield Finding("warning", "gpu memory", message, fix)
    if checked and not busy:
        message = f"under {BUSY_SHARE:.0%} in use on each of {checked} GPU(s)"
        yield Finding("ok", "gpu memory", message)


def _hidden_gpus(hw: Hardware, names: str | None) -> Iterator[Finding]:
    """GPUs the driver lists that CUDA_VISIBLE_DEVICES hides from torch (section 5.5)."""
    listed = sum(line.startswith("GPU ") for line in (names or "").splitlines())
    if hw.visible_devices is not None and listed > len(hw.gpus):
        hidden = f"CUDA_VISIBLE_DEVICES={hw.visible_devices!r}"
        message = f"torch sees {len(hw.gpus)} of the {listed} GPUs the driver lists ({hidden})"
        fix = "unset CUDA_VISIBLE_DEVICES unless you (or your scheduler) set it on purpose"
        yield Finding("warning", "visible GPUs", message, fix)


def diagnose(
    hardware: Hardware | None = None, *, min_free_disk_gib: float = 10.0
) -> tuple[Finding, ...]:
    """Everything `mgpu doctor` reports, in its order (lesson 00; pass ``hardware`` if at hand)."""
    hw = describe_hardware() if hardware is None else hardware
    usable = usable_cpus()
    findings: list[Finding] = []

    def add(level: str, topic: str, message: str, fix: str = "") -> None:
        findings.append(Finding(level, topic, message, fix))

    add("info", "python", f"{hw.python} ({sys.executable})")
    add("info", "torch", f"{hw.torch}  (CUDA build: {hw.cuda_build or 'none, CPU-only build'})")
    findings += [*_versions(), _torchvision()]
    add("info", "backends", f"{', '.join(hw.backends) or 'none'}  (NCCL {hw.nccl_version or '-'})")
    if "gloo" not in hw.backends:
        fix = "reinstall torch from the official wheels (pip install -r requirements.txt)"
        add("problem", "backends", "torch.distributed has no gloo backend", fix)
    add("info", "CPU cores", f"{hw.cpu_count} ({usable} usable by this process)")
    add("info", "CUDA_VISIBLE_DEVICES", repr(hw.visible_devices))
    add("info", "MPS (Apple)", "available" if hw.mps_available else "no")
    if not hw.gpus:
        add("info", "GPUs", "none visible to torch")
    for g in hw.gpus:
        facts = f"{g.total_memory_gib} GiB, compute capability {g.capability[0]}.{g.capability[1]}"
        add("info", f"cuda:{g.index}", f"{g.name}, {facts}, {g.multi_processor_count} SMs")
    if len(hw.gpus) > 1:
        pairs = itertools.permutations(range(len(hw.gpus)), 2)
        peer = [f"{i}->{j}:{'yes' if hw.peer_access[i][j] else 'no'}" for i, j in pairs]
        add("info", "peer access", "  ".join(peer))
    query = ("--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader")
    listing = nvidia_smi(*query)
    if listing:
        add("info", "nvidia-smi", listing.strip())
        topology = nvidia_smi("topo", "-m")
        if topology and len(hw.gpus) > 1:
            add("info", "topology", topology.rstrip())
    smi_installed = listing is not None or shutil.which("nvidia-smi") is not None
    findings.append(_driver(hw, smi_installed, listing, nvidia_smi() or ""))
    if hw.cuda_error:
        fix = (
            "check the driver (nvidia-smi) and that no other process holds the GPUs in "
            "exclusive mode"
        )
        add("problem", "cuda", f"CUDA is present but unusable ({hw.cuda_error})", fix)
    if listing:
        findings += _hidden_gpus(hw, nvidia_smi("-L"))
        query = ("--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits")
        findings += _gpu_memory(nvidia_smi(*query))
    root = course_root()
    free = shutil.disk_usage(root).free / 2**30
    message = f"{free:.1f} GiB free where the course is ({root})"
    if free < min_free_disk_gib:
        fix = f"free some space: data sets and checkpoints want at least {min_free_disk_gib:g} GiB"
        add("warning", "disk", message, fix)
    else:
        add("ok", "disk", message)
    try:
        import ipykernel  # noqa: F401
    except ImportError:
        fix = "pip install -r requirements.txt"
        add("warning", "ipykernel", "ipykernel is missing: notebooks cannot run", fix)
    # Where the multi-device lessons' ranks would run: one per GPU, at least two (lesson 00).
    placement = place(max(2, len(hw.gpus)), share_gpus=True, n_gpus=len(hw.gpus))
    add("info", "placement", "\n".join([placement.banner(), *placement.notes]))
    return tuple(findings)
