"""The environment findings behind `mgpu doctor` and lesson 00 (mgpu_helpers.doctor).

The driver and the GPUs are faked: ``nvidia-smi`` answers from a table and the hardware record
is today's with a few fields replaced, so every verdict is checked on a machine without GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from mgpu_helpers.devices import GpuInfo, describe_hardware
from mgpu_helpers.doctor import LEVELS, Finding, diagnose, exit_code, first
from mgpu_helpers.placement import place

QUERY = ("--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader")
NAMES = ("-L",)
USAGE = ("--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits")
H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", 79.19, (9, 0), 132)
LISTING = "0, NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB\n"


@pytest.fixture(scope="module")
def here():
    return describe_hardware()


@pytest.fixture
def machine(monkeypatch, here):
    """Fake what the doctor sees: the hardware fields given, and nvidia-smi's answers."""

    def fake(*, installed: bool = False, answers: dict | None = None, **hardware) -> None:
        hw = dataclasses.replace(here, **hardware)
        monkeypatch.setattr("mgpu_helpers.doctor.describe_hardware", lambda: hw)
        table = answers or {}
        monkeypatch.setattr("mgpu_helpers.doctor.nvidia_smi", lambda *args, **kw: table.get(args))
        where = "/usr/bin/nvidia-smi" if installed else None
        monkeypatch.setattr("shutil.which", lambda name: where if name == "nvidia-smi" else None)

    return fake


def _header(cuda: str) -> str:
    return f"| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   CUDA Version: {cuda}  |\n"


# --- the record ------------------------------------------------------------------------------


def test_finding_is_a_frozen_record():
    f = Finding("info", "torch", "2.11")
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.level = "problem"  # type: ignore[misc]


@pytest.mark.parametrize("level", ["error", "OK", ""])
def test_finding_rejects_unknown_levels(level):
    with pytest.raises(ValueError, match="level must be one of ok, info, warning, problem"):
        Finding(level, "torch", "x")


@pytest.mark.parametrize("level", ["warning", "problem"])
def test_warnings_and_problems_must_say_the_fix(level):
    with pytest.raises(ValueError, match="needs a fix"):
        Finding(level, "disk", "full")


def test_exit_code_is_1_exactly_when_something_is_a_problem():
    fine = [Finding(level, "t", "m", "f") for level in ("ok", "info", "warning")]
    assert exit_code(fine) == 0
    assert exit_code([*fine, Finding("problem", "t", "m", "do this")]) == 1
    assert exit_code([]) == 0


def test_first_finds_a_topic_and_names_the_others_when_missing():
    findings = [Finding("info", "torch", "a"), Finding("ok", "driver", "b")]
    assert first(findings, "driver").message == "b"
    with pytest.raises(
        ValueError, match="no finding about 'disk'; the topics found: torch, driver"
    ):
        first(findings, "disk")


# --- this machine ----------------------------------------------------------------------------


def test_diagnose_here_reports_the_facts_and_no_problem(monkeypatch):
    monkeypatch.setattr("mgpu_helpers.doctor.nvidia_smi", lambda *args, **kw: None)
    monkeypatch.setattr("shutil.which", lambda name: None)  # whatever driver is installed
    findings = diagnose(min_free_disk_gib=0)
    assert all(f.level in LEVELS for f in findings)
    assert exit_code(findings) == 0, [f for f in findings if f.level == "problem"]
    assert torch.__version__ in first(findings, "torch").message
    n = torch.cuda.device_count()
    placement = place(max(2, n), share_gpus=True, n_gpus=n)
    assert first(findings, "placement").message.splitlines()[0] == placement.banner()
    assert first(findings, "disk").level == "ok"
    assert first(findings, "driver").level in ("ok", "info")


@pytest.mark.gpu  # without a GPU torch never creates a CUDA context: nothing to test
def test_diagnose_leaves_cuda_uninitialised():
    """Lesson 00 runs it in its kernel, which must stay free of a CUDA context."""
    code = textwrap.dedent(
        """
        import json, torch
        from mgpu_helpers.doctor import diagnose
        findings = diagnose()
        print(json.dumps({"n": len(findings), "initialized": torch.cuda.is_initialized()}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["n"] > 5 and result["initialized"] is False


# --- the driver verdict (lesson 00, section 5.2) ---------------------------------------------

PROBE_FAILED = "CUDA probe failed: CUDA driver version is insufficient for CUDA runtime version"
DRIVER_CASES = [
    # installed, answers, cuda_build, gpus, cuda_error, level, in the message, in the fix
    (False, {}, None, (), None, "ok", "CPU-only torch on a machine without NVIDIA GPUs", ""),
    (False, {}, "13.0", (), None, "ok", "no NVIDIA driver: torch uses the CPU", ""),
    (True, {}, "13.0", (), None, "problem", "nvidia-smi is installed but fails", "in a terminal"),
    (True, {QUERY: ""}, "13.0", (), None, "info", "lists no GPU", ""),
    (
        True,
        {QUERY: LISTING},
        None,
        (),
        None,
        "problem",
        "torch sees none: this torch is a CPU-only build",
        "install the CUDA build: pip install torch==2.14.1 torchvision==0.29.1",
    ),
    (  # an older-major driver and no GPU for torch: the version explains the failure
        True,
        {QUERY: LISTING, (): _header("12.8")},
        "13.0",
        (),
        PROBE_FAILED,
        "problem",
        "the driver supports CUDA 12.8, an older major version than torch's CUDA 13.0",
        "install a torch built for CUDA 12",
    ),
    (  # the probe saw the GPU but failed on it: nvidia-smi's older major still explains it
        True,
        {QUERY: LISTING, (): _header("12.8")},
        "13.0",
        (H100,),
        PROBE_FAILED,
        "problem",
        "an older major version than torch's CUDA 13.0",
        "forward-compatibility package",
    ),
    (  # the same driver, but CUDA works: a forward-compatibility package (NGC containers)
        True,
        {QUERY: LISTING, (): _header("12.8")},
        "13.0",
        (H100,),
        None,
        "ok",
        "sees 1 GPU(s), although nvidia-smi reports a driver for CUDA 12.8",
        "",
    ),
    (
        True,
        {QUERY: LISTING},
        "13.0",
        (),
        None,
        "problem",
        "nvidia-smi lists GPUs but torch sees none",
        "update the NVIDIA driver to one that supports CUDA 13.0",
    ),
    (  # WSL2: the GPUs work, nvidia-smi is not on the PATH
        False,
        {},
        "13.0",
        (H100,),
        None,
        "ok",
        "torch for CUDA 13.0 sees 1 GPU(s) (nvidia-smi is not on the PATH",
        "",
    ),
    (
        False,
        {},
        "13.0",
        (H100,),
        PROBE_FAILED,
        "problem",
        "torch finds 1 GPU(s) but cannot use them",
        "install or repair the NVIDIA driver",
    ),
    (
        True,
        {QUERY: LISTING, (): _header("13.0")},
        "13.2",
        (H100,),
        None,
        "ok",
        "older than torch's CUDA 13.2 but of the same major version",
        "",
    ),
    (
        True,
        {QUERY: LISTING, (): _header("13.2")},
        "13.0",
        (H100,),
        None,
        "ok",
        "torch for CUDA 13.0 sees 1 GPU(s)",
        "",
    ),
]


@pytest.mark.parametrize(
    ("installed", "answers", "cuda_build", "gpus", "cuda_error", "level", "message", "fix"),
    DRIVER_CASES,
)
def test_driver_verdict(
    machine, installed, answers, cuda_build, gpus, cuda_error, level, message, fix
):
    machine(
        installed=installed,
        answers=answers,
        cuda_build=cuda_build,
        gpus=gpus,
        cuda_error=cuda_error,
    )
    findings = diagnose(min_free_disk_gib=0)
    driver = first(findings, "driver")
    assert (driver.level, message in driver.message, fix in driver.fix) == (level, True, True), (
        driver
    )
    assert exit_code(findings) == (level == "problem" or cuda_error is not None)


# --- the other checks ------------------------------------------------------------------------


def test_busy_gpu_memory_is_a_warning_per_gpu(machine):
    usage = "0, 40000, 81559\n1, 3, 81559\n2, [N/A], [N/A]\n"
    machine(installed=True, answers={QUERY: LISTING, USAGE: usage}, gpus=(H100,))
    memory = [f for f in diagnose(min_free_disk_gib=0) if f.topic == "gpu memory"]
    assert [f.level for f in memory] == ["warning"]
    assert memory[0].message.startswith("GPU 0: 40,000 of 81,559 MiB already in use")
    assert "--query-compute-apps" in memory[0].fix


def test_idle_gpu_memory_is_ok(machine):
    usage = "0, 3, 81559\n1, 0, 81559\n"
    machine(installed=True, answers={QUERY: LISTING, USAGE: usage}, gpus=(H100,))
    memory = first(diagnose(min_free_disk_gib=0), "gpu memory")
    assert memory.level == "ok" and "2 GPU(s)" in memory.message


@pytest.mark.parametrize(("visible", "warned"), [("0", True), (None, False)])
def test_gpus_hidden_by_cuda_visible_devices(machine, visible, warned):
    names = "GPU 0: NVIDIA H100 (UUID: a)\nGPU 1: NVIDIA H100 (UUID: b)\n"
    machine(
        installed=True,
        answers={QUERY: LISTING, NAMES: names},
        gpus=(H100,),
        visible_devices=visible,
    )
    hidden = [f for f in diagnose(min_free_disk_gib=0) if f.topic == "visible GPUs"]
    assert bool(hidden) == warned
    if warned:
        assert hidden[0].level == "warning"
        assert "torch sees 1 of the 2 GPUs" in hidden[0].message and "'0'" in hidden[0].message


def test_low_disk_is_a_warning(machine):
    machine()
    disk = first(diagnose(min_free_disk_gib=1e9), "disk")
    assert disk.level == "warning" and "at least 1e+09 GiB" in disk.fix


def test_missing_gloo_is_a_problem(machine):
    machine(backends=("nccl",))
    findings = diagnose(min_free_disk_gib=0)
    problems = [f for f in findings if f.level == "problem"]
    assert [f.topic for f in problems] == ["backends"]
    assert "no gloo backend" in problems[0].message


def test_unusable_cuda_is_a_problem(machine):
    machine(cuda_error="CUDA probe failed: no CUDA-capable device is detected")
    cuda = first(diagnose(min_free_disk_gib=0), "cuda")
    assert cuda.level == "problem" and "CUDA is present but unusable (CUDA probe" in cuda.message


def test_a_torchvision_that_does_not_match_torch_is_a_problem(machine, monkeypatch):
    def broken_nms(*args, **kwargs):
        raise RuntimeError("operator torchvision::nms does not exist")

    machine()
    monkeypatch.setattr("torchvision.ops.nms", broken_nms)
    tv = first(diagnose(min_free_disk_gib=0), "torchvision")
    assert tv.level == "problem"
    assert tv.message == "torchvision is broken (operator torchvision::nms does not exist)"
    assert "pip install torch==2.14.1 torchvision==0.29.1" in tv.fix


def test_gpus_and_peer_access_are_listed(machine):
    second = dataclasses.replace(H100, index=1)
    machine(gpus=(H100, second), peer_access=((True, True), (False, True)))
    findings = diagnose(min_free_disk_gib=0)
    assert (
        "NVIDIA H100 80GB HBM3, 79.19 GiB, compute capability 9.0"
        in first(findings, "cuda:1").message
    )
    assert first(findings, "peer access").message == "0->1:yes  1->0:no"
