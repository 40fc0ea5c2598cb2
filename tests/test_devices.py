"""What hardware is here (devices.py); the GPU test markers. Placement: test_placement.py.

`mgpu doctor` is tested in test_doctor.py and the `mgpu` command in test_cli.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mgpu_helpers.devices import (
    _probe_cuda_elsewhere,
    available_backends,
    describe_hardware,
    gpu_count,
    hardware_as_dict,
    nvidia_smi,
)

ON_CPU_ONLY = pytest.mark.skipif(gpu_count() > 0, reason="describes a machine without GPUs")

def test_gpu_count_survives_a_broken_driver(monkeypatch):
    def broken():
        raise RuntimeError("driver/library version mismatch")

    monkeypatch.setattr(torch.cuda, "device_count", broken)
    assert gpu_count() == 0


# --- describe_hardware, backends, nvidia-smi -------------------------------------------------


def test_available_backends_include_gloo():
    backends = available_backends()
    assert "gloo" in backends
    assert set(backends) <= {"gloo", "nccl", "mpi"}


def test_available_backends_without_torch_distributed(monkeypatch):
    monkeypatch.setattr("torch.distributed.is_available", lambda: False)
    assert available_backends() == ()


@ON_CPU_ONLY
def test_describe_hardware_on_a_cpu_machine():
    hw = describe_hardware()
    assert hw.gpus == () and hw.peer_access == () and not hw.cuda_available
    assert hw.cuda_error is None and hw.nccl_version is None
    assert hw.torch == torch.__version__ and hw.cuda_build == torch.version.cuda
    assert "gloo" in hw.backends
    assert hw.cpu_count == (os.cpu_count() or 1)
    assert hw.visible_devices == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert json.loads(json.dumps(hardware_as_dict(hw)))["gpus"] == []


def test_describe_hardware_leaves_cuda_uninitialised():
    """In a fresh process, as in a notebook kernel: later lessons must still start workers."""
    code = textwrap.dedent(
        """
        import json, torch
        from mgpu_helpers.devices import describe_hardware
        from mgpu_helpers.placement import place
        hw = describe_hardware()
        place(2, share_gpus=True)
        print(json.dumps({"gpus": len(hw.gpus), "initialized": torch.cuda.is_initialized()}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"gpus": gpu_count(), "initialized": False}


FAKE_PROBE = {
    "gpus": [
        {
            "index": i,
            "name": "NVIDIA H100 80GB HBM3",
            "total_memory_gib": 79.19,
            "capability": [9, 0],
            "multi_processor_count": 132,
        }
        for i in range(2)
    ],
    "peer": [[True, True], [True, True]],
    "nccl": "2.27.3",
}


def test_describe_hardware_probes_gpus_in_another_process(monkeypatch):
    monkeypatch.setattr("mgpu_helpers.devices.gpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr("mgpu_helpers.devices._probe_cuda_elsewhere", lambda: FAKE_PROBE)

    def in_process():
        raise AssertionError("probed CUDA in this process: it would create a CUDA context")

    monkeypatch.setattr("mgpu_helpers.devices._probe_cuda", in_process)
    hw = describe_hardware()
    assert hw.cuda_available and hw.cuda_error is None
    assert [g.index for g in hw.gpus] == [0, 1]
    assert hw.gpus[0].capability == (9, 0) and hw.gpus[1].total_memory_gib == 79.19
    assert hw.peer_access == ((True, True), (True, True)) and hw.nccl_version == "2.27.3"


def test_describe_hardware_reports_a_failed_probe(monkeypatch):
    def failing():
        raise RuntimeError("CUDA probe failed: CUDA driver initialization failed")

    monkeypatch.setattr("mgpu_helpers.devices.gpu_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr("mgpu_helpers.devices._probe_cuda_elsewhere", failing)
    hw = describe_hardware()  # never raises: `mgpu doctor` reports it
    assert not hw.cuda_available and hw.gpus == ()
    assert "driver initialization failed" in hw.cuda_error


def test_cuda_probe_subprocess_round_trip():
    probe = _probe_cuda_elsewhere()
    assert len(probe["gpus"]) == gpu_count()
    assert len(probe["peer"]) == gpu_count()


def test_nvidia_smi_missing(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert nvidia_smi("-L") is None


def _fake_tool(tmp_path: Path, body: str) -> str:
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    return str(tool)


def test_nvidia_smi_passes_arguments_and_returns_stdout(monkeypatch, tmp_path):
    tool = _fake_tool(tmp_path, 'echo "args: $*"')
    monkeypatch.setattr(shutil, "which", lambda name: tool if name == "nvidia-smi" else None)
    assert nvidia_smi("topo", "-m") == "args: topo -m\n"


def test_nvidia_smi_failing_returns_none(monkeypatch, tmp_path):
    tool = _fake_tool(tmp_path, "echo 'NVIDIA-SMI has failed'; exit 9")
    monkeypatch.setattr(shutil, "which", lambda name: tool)
    assert nvidia_smi("-L") is None


@pytest.mark.gpu
def test_describe_hardware_with_gpus():
    hw = describe_hardware()
    assert hw.cuda_available and len(hw.gpus) == torch.cuda.device_count()
    assert all(g.name and g.total_memory_gib > 0 for g in hw.gpus)
    assert len(hw.peer_access) == len(hw.gpus)


# --- the gpu / multigpu markers (conftest.py) -----------------------------------------------


@pytest.mark.parametrize(("n_gpus", "outcomes"), [(0, (1, 2)), (1, (2, 1)), (2, (3, 0))])
def test_gpu_markers_skip_without_the_hardware(pytester, monkeypatch, n_gpus, outcomes):
    """The hook in conftest.py, in an inner pytest run with the GPU count faked."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n_gpus)
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: one GPU\n    multigpu: two GPUs\n")
    pytester.makepyfile(
        """
        import pytest

        def test_cpu():
            pass

        @pytest.mark.gpu
        def test_one_gpu():
            pass

        @pytest.mark.multigpu
        def test_two_gpus():
            pass
        """
    )
    result = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider")
    passed, skipped = outcomes
    result.assert_outcomes(passed=passed, skipped=skipped)
    if n_gpus < 1:
        result.stdout.fnmatch_lines(["*needs a CUDA GPU; torch sees none*"])
    if n_gpus < 2:
        result.stdout.fnmatch_lines([f"*needs 2 or more CUDA GPUs; torch sees {n_gpus}*"])
