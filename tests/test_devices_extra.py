"""The per-device tensor sanity check of lesson 00 (mgpu_helpers.devices)."""

from __future__ import annotations

import pytest

from mgpu_helpers.devices import DeviceCheck, gpu_count, sanity_check_devices, tensor_sanity


def test_tensor_sanity_passes_on_the_cpu() -> None:
    result = tensor_sanity("cpu", size=32)
    assert result.ok, result.error
    assert result.device == "cpu"
    assert result.error is None
    assert result.max_abs_error is not None and result.max_abs_error < 1e-3
    assert result.seconds is not None and result.seconds > 0


def test_tensor_sanity_reports_a_device_that_cannot_copy_back() -> None:
    # the meta device holds shapes but no data, so copying the product back must fail
    result = tensor_sanity("meta", size=8)
    assert not result.ok
    assert result.max_abs_error is None and result.seconds is None
    assert result.error is not None and result.error.startswith("NotImplementedError")


def test_tensor_sanity_reports_a_missing_gpu_instead_of_raising() -> None:
    missing = f"cuda:{gpu_count()}"  # one past the last GPU, on any machine
    result = tensor_sanity(missing, size=8)
    assert not result.ok
    assert result.error


@pytest.mark.parametrize("size", [0, -3, 2.5])
def test_tensor_sanity_rejects_a_bad_size(size: object) -> None:
    with pytest.raises(ValueError, match="size"):
        tensor_sanity("cpu", size=size)  # type: ignore[arg-type]


def test_sanity_check_devices_checks_each_distinct_device_once_in_order() -> None:
    results = sanity_check_devices(["cpu", "meta", "cpu"], size=8, in_subprocess=False)
    assert [r.device for r in results] == ["cpu", "meta"]
    assert [r.ok for r in results] == [True, False]


@pytest.mark.slow  # make test-long (CI): a child importing torch
def test_sanity_check_devices_in_a_child_process_matches_in_process() -> None:
    here = sanity_check_devices(["cpu", "meta"], size=16, in_subprocess=False)
    there = sanity_check_devices(["cpu", "meta"], size=16, in_subprocess=True)
    assert all(isinstance(r, DeviceCheck) for r in there)
    assert [(r.device, r.ok, r.error) for r in there] == [(r.device, r.ok, r.error) for r in here]
    # same seed and size, same CPU: the same rounding error
    assert there[0].max_abs_error == pytest.approx(here[0].max_abs_error)


def test_sanity_check_devices_on_cpu_only_runs_in_process() -> None:
    # nothing to protect from CUDA, so no child process: the result is immediate and correct
    (result,) = sanity_check_devices(["cpu", "cpu"], size=8)
    assert result.ok


def test_sanity_check_devices_reports_a_failed_child_as_failed_checks() -> None:
    results = sanity_check_devices(["cpu"], size=8, in_subprocess=True, timeout=0.001)
    assert [r.ok for r in results] == [False]
    assert results[0].error


def test_sanity_check_devices_needs_devices() -> None:
    with pytest.raises(ValueError, match="no devices"):
        sanity_check_devices([])


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU")
def test_sanity_check_devices_on_every_gpu_in_a_child_process() -> None:
    devices = [f"cuda:{i}" for i in range(gpu_count())]
    results = sanity_check_devices(devices, size=64, in_subprocess=True)
    assert [r.device for r in results] == devices
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]


def test_full_float32_switches_tf32_off() -> None:
    import torch

    from mgpu_helpers.devices import full_float32

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    before = (cudnn.allow_tf32, matmul.allow_tf32)
    try:
        cudnn.allow_tf32, matmul.allow_tf32 = True, True
        full_float32()
        assert cudnn.allow_tf32 is False
        assert matmul.allow_tf32 is False
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = before


def test_full_float32_can_make_cudnn_deterministic() -> None:
    import torch

    from mgpu_helpers.devices import full_float32

    cudnn = torch.backends.cudnn
    before = (cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark)
    try:
        cudnn.deterministic, cudnn.benchmark = False, True
        full_float32()  # TF32 only: cuDNN's algorithm choice left alone
        assert (cudnn.deterministic, cudnn.benchmark) == (False, True)
        full_float32(deterministic=True)
        assert (cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark) == (False, True, False)
    finally:
        cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark = before
