"""scripts/train_ddp.py under torchrun on GPUs (lesson 07); skipped without a CUDA GPU.

Two ranks: one per GPU over NCCL with two or more GPUs, both on cuda:0 over gloo with one
(NCCL refuses two ranks on one GPU). A rank killed mid-run with --max-restarts=1 must end
where an uninterrupted run does, within a tolerance, and --amp must pick lesson 06c's precision.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from mgpu_helpers.jobs import JobResult, run_job

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_ddp.py"
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # one store per attempt (see the script)
# Why not bitwise, as on the CPU: a restarted attempt is a new process, and some CUDA kernels
# of the backward pass (cuDNN's weight gradients of a convolution, pooling's backward) add
# with atomics in an order that changes from run to run; TF32 convolutions round those
# differences at about 1e-3 relative. Over the dozen steps after the resume they stay far below
# what a wrong resume costs (a skipped or repeated batch moves weights by ~1e-2).
RTOL, ATOL = 1e-3, 1e-4


def torchrun(tmp: Path, name: str, *args: str, restarts: int = 0) -> tuple[dict, JobResult]:
    out = tmp / name
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        f"--max-restarts={restarts}", str(SCRIPT), "--device", "cuda", "--quick",
        "--epochs", "2", "--out", str(out), *args,
    ]  # fmt: skip
    job = run_job(cmd, timeout=240, env=ENV, cwd=ROOT, prefix=f"[{name}] ")
    assert job.ok, f"exit status {job.returncode}:\n{job.tail()}"
    return json.loads((out / "result.json").read_text()), job


def weights(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp / name / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torchrun_gpu")


def test_killed_rank_on_gpus_resumes_to_the_same_weights(tmp):
    ref, _ = torchrun(tmp, "ref")
    killed, job = torchrun(tmp, "killed", "--snapshot", str(tmp / "killed" / "snap.pt"),
                           "--snapshot-every", "5", "--kill-at-step", "23", restarts=1)  # fmt: skip
    expected = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert ref["backend"] == killed["backend"] == expected and ref["device"] == "cuda:0"
    assert killed["restart_count"] == 1 and killed["resumed_from"]["step"] == 20
    assert "SIGKILL to myself after 23 optimizer steps" in job.output
    a, b = weights(tmp, "ref"), weights(tmp, "killed")
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"largest weight difference after the restart: {worst:.2e}")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=RTOL, atol=ATOL, msg=name)
    for metric in ("train_loss", "test_loss"):
        torch.testing.assert_close(killed["history"][metric], ref["history"][metric],
                                   rtol=1e-3, atol=1e-4)  # fmt: skip
    assert ref["history"]["test_acc"][-1] > 0.5, "the GPU run did not learn"


def test_amp_picks_lesson_06s_precision(tmp):
    result, _ = torchrun(tmp, "amp", "--amp", "--snapshot", str(tmp / "amp" / "snap.pt"))
    assert result["config"]["amp"] and result["history"]["test_acc"][-1] > 0.5
    snap = torch.load(tmp / "amp" / "snap.pt", weights_only=True, map_location="cpu")
    fp16 = torch.cuda.get_device_capability(0) < (8, 0)  # no bf16: fp16 with a GradScaler
    assert bool(snap["scaler"]) == fp16, "the grad scaler's state belongs in fp16 snapshots only"
    if fp16:
        assert snap["scaler"]["scale"] > 0
