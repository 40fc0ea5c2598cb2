"""The one placement decision (mgpu_helpers.placement) and DistEnv under torchrun's variables."""

from __future__ import annotations

import warnings

import pytest
import torch

from mgpu_helpers.dist_env import DistEnv
from mgpu_helpers.placement import Placement, place, usable_cpus

VIRTUAL = "(virtual: one device stands in for each)"


@pytest.fixture
def with_nccl(monkeypatch):
    """A torch with NCCL built in (the Linux CUDA wheels), whatever this one has."""
    monkeypatch.setattr("mgpu_helpers.devices.available_backends", lambda: ("gloo", "nccl"))


@pytest.fixture
def without_nccl(monkeypatch):
    """A torch without NCCL (macOS, Windows, CPU wheels)."""
    monkeypatch.setattr("mgpu_helpers.devices.available_backends", lambda: ("gloo",))


CASES = [
    # world_size, n_gpus, share_gpus, device_type, devices, backend, share_gpus field, banner kind
    (2, 0, False, "cpu", ("cpu", "cpu"), "gloo", False, "[CPU only]"),
    (3, 0, True, "cpu", ("cpu", "cpu", "cpu"), "gloo", False, "[CPU only]"),
    (1, 0, False, "cpu", ("cpu",), "gloo", False, "[CPU only]"),
    (1, 1, False, "cuda", ("cuda:0",), "nccl", False, "[1 GPU]"),
    (2, 1, True, "cuda", ("cuda:0", "cuda:0"), "gloo", True, "[1 GPU]"),
    (2, 2, False, "cuda", ("cuda:0", "cuda:1"), "nccl", False, "[2 GPUs]"),
    (3, 2, True, "cuda", ("cuda:0", "cuda:1", "cuda:0"), "gloo", True, "[2 GPUs]"),
    (2, 4, False, "cuda", ("cuda:0", "cuda:1"), "nccl", False, "[4 GPUs]"),
    (2, 4, True, "cuda", ("cuda:0", "cuda:1"), "nccl", False, "[4 GPUs]"),  # enough GPUs
]


@pytest.mark.parametrize(
    ("world_size", "n_gpus", "share", "device_type", "devices", "backend", "shared", "kind"), CASES
)
def test_place_decides_devices_and_backend_from_the_gpus(
    with_nccl, world_size, n_gpus, share, device_type, devices, backend, shared, kind
) -> None:
    p = place(world_size, share_gpus=share, n_gpus=n_gpus, cpu_count=8)
    assert isinstance(p, Placement)
    assert (p.world_size, p.device_type, p.devices) == (world_size, device_type, devices)
    assert (p.backend, p.share_gpus, p.n_gpus) == (backend, shared, n_gpus)
    assert p.virtual == (len(set(devices)) < world_size)
    where = ", ".join(devices)
    if len(set(devices)) == 1 and len(devices) > 1:
        where = f"{devices[0]} ×{len(devices)}"
    virtual = f" {VIRTUAL}" if p.virtual else ""
    assert p.banner() == f"{kind} lessons use {where}{virtual}; backend {backend}"
    assert len(p.banner()) <= 100  # a printed line within the output area
    assert bool(p.notes) == (n_gpus < world_size)  # fewer GPUs than ranks: it says so


def test_notes_say_what_stands_in(with_nccl) -> None:
    assert "CPU process" in place(2, n_gpus=0).notes[0]
    assert "share a GPU" in place(2, n_gpus=1, share_gpus=True).notes[0]
    assert "GPU(s) idle" in place(2, "cpu", n_gpus=2).notes[0]  # CPU by request


def test_cpu_by_request_on_a_gpu_machine(with_nccl) -> None:
    p = place(2, "cpu", n_gpus=2, cpu_count=4)
    assert (p.device_type, p.devices, p.backend, p.virtual) == ("cpu", ("cpu", "cpu"), "gloo", True)
    assert p.banner().startswith("[2 GPUs, not used] lessons use cpu ×2")


def test_the_banner_of_many_gpus_fits_a_line(with_nccl) -> None:
    p = place(8, n_gpus=8, cpu_count=64)
    assert "cuda:0 … cuda:7 (8)" in p.banner() and len(p.banner()) <= 100


def test_without_nccl_gpus_get_gloo_and_it_says_so(without_nccl) -> None:
    p = place(2, n_gpus=2)
    assert (p.backend, p.virtual, p.share_gpus) == ("gloo", False, False)
    assert any("NCCL is not built" in note for note in p.notes)
    with pytest.raises(ValueError, match="NCCL is not built into this torch; use backend='gloo'"):
        place(2, n_gpus=2, backend="nccl")


def test_backend_can_be_chosen_where_it_works(with_nccl) -> None:
    own = place(2, n_gpus=2, backend="gloo")
    assert (own.backend, own.notes) == ("gloo", ())  # the user's choice: no note
    assert place(2, "cuda", n_gpus=1, share_gpus=True, backend="gloo").backend == "gloo"


def test_threads_split_the_cores() -> None:
    assert place(2, "cpu", n_gpus=0, cpu_count=8).threads_per_rank == 4
    assert place(3, "cpu", n_gpus=0, cpu_count=2).threads_per_rank == 1  # never below one
    assert place(2, n_gpus=2, cpu_count=64).threads_per_rank == 4  # a GPU rank needs few
    assert place(2, n_gpus=2, cpu_count=4).threads_per_rank == 2


def test_threads_follow_the_cores_this_process_may_use(monkeypatch) -> None:
    """taskset, SLURM's --cpus-per-task and container cpusets narrow the affinity, not cpu_count."""
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert usable_cpus() == 4
    assert place(2, "cpu", n_gpus=0).threads_per_rank == 2  # not 64 // 2
    monkeypatch.delattr("os.sched_getaffinity", raising=False)  # macOS, Windows
    assert usable_cpus() == 64
    assert place(2, "cpu", n_gpus=0).threads_per_rank == 32


def test_describe_is_the_launch_line(with_nccl) -> None:
    assert place(2, n_gpus=0, cpu_count=2).describe() == (
        "launching 2 ranks as CPU processes, backend gloo, 1 CPU thread(s) per rank"
    )
    assert place(3, n_gpus=1, share_gpus=True, cpu_count=12).describe() == (
        "launching 3 ranks as ranks sharing GPUs, backend gloo, 4 CPU thread(s) per rank"
    )
    assert place(1, n_gpus=1, cpu_count=2).describe().startswith("launching 1 rank as GPUs")


def test_counts_the_gpus_here_when_not_told(monkeypatch, with_nccl) -> None:
    monkeypatch.setattr("mgpu_helpers.devices.gpu_count", lambda: 3)
    p = place(2)
    assert (p.n_gpus, p.devices, p.backend) == (3, ("cuda:0", "cuda:1"), "nccl")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be a whole number >= 1, got 0"),
        ({"world_size": 2.0}, "world_size must be a whole number"),
        ({"world_size": True}, "world_size must be a whole number"),
        ({"world_size": 2, "device": "tpu"}, "device='tpu' is unknown; choose 'auto', 'cpu'"),
        ({"world_size": 2, "device": "cuda:1"}, "choose 'auto', 'cpu' or 'cuda'"),
        ({"world_size": 2, "n_gpus": -1}, "n_gpus cannot be negative"),
        ({"world_size": 2, "n_gpus": 0, "cpu_count": 0}, "cpu_count must be"),
        ({"world_size": 2, "device": "cuda", "n_gpus": 0}, "no GPU is visible; use device='cpu'"),
        ({"world_size": 4, "device": "cuda", "n_gpus": 2}, "world_size<=2, share_gpus=True"),
        ({"world_size": 4, "n_gpus": 2}, "needs 4 GPUs but 2 are visible"),
        ({"world_size": 2, "n_gpus": 1}, "but 1 is visible; .*device='cpu' \\(CPU processes\\)"),
        ({"world_size": 2, "device": "cpu", "backend": "nccl"}, "use backend='gloo' for CPU"),
        (
            {"world_size": 2, "device": "cuda", "n_gpus": 1, "share_gpus": True, "backend": "nccl"},
            "NCCL refuses two ranks on one GPU; use backend='gloo'.*entry 4: two ranks on one GPU",
        ),
        ({"world_size": 2, "backend": "mpi", "n_gpus": 0}, "backend='mpi' is unknown; choose"),
    ],
)
def test_bad_requests_are_refused_with_the_fix(with_nccl, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        place(**kwargs)


def test_a_hand_made_placement_must_be_consistent() -> None:
    with pytest.raises(ValueError, match="one device per rank"):
        Placement(2, "cpu", ("cpu",), "gloo", False, 0, 1)
    with pytest.raises(ValueError, match="build the placement with place"):
        Placement(1, "tpu", ("tpu",), "gloo", False, 0, 1)


def test_a_placement_is_a_value() -> None:
    p = place(2, n_gpus=0, cpu_count=2)
    assert p == place(2, n_gpus=0, cpu_count=2)
    with pytest.raises(AttributeError):
        p.backend = "nccl"  # type: ignore[misc]


# --- DistEnv.from_environ: the same decision under torchrun ----------------------------------


def torchrun_environ(monkeypatch, rank: int, local_rank: int, world: int, local_world: int):
    """The variables torchrun sets for one rank."""
    for name, value in (
        ("RANK", rank),
        ("LOCAL_RANK", local_rank),
        ("WORLD_SIZE", world),
        ("LOCAL_WORLD_SIZE", local_world),
    ):
        monkeypatch.setenv(name, str(value))


def test_from_environ_needs_the_launcher_variables(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK is not set: start this with .*torchrun"):
        DistEnv.from_environ("cpu")


def test_from_environ_on_cpu(monkeypatch) -> None:
    torchrun_environ(monkeypatch, rank=1, local_rank=1, world=2, local_world=2)
    env = DistEnv.from_environ("cpu")
    assert env == DistEnv(1, 1, 2, torch.device("cpu"), "gloo")
    assert not env.is_main


def test_from_environ_more_local_ranks_than_gpus_shares_them_over_gloo(
    monkeypatch, with_nccl
) -> None:
    monkeypatch.setattr("mgpu_helpers.devices.gpu_count", lambda: 2)
    # torchrun --nproc-per-node 4 on a 2-GPU machine, second node: global rank 7, local rank 3
    torchrun_environ(monkeypatch, rank=7, local_rank=3, world=8, local_world=4)
    env = DistEnv.from_environ()
    assert (env.rank, env.local_rank, env.world_size) == (7, 3, 8)
    assert (env.device, env.backend) == (torch.device("cuda:1"), "gloo")  # never NCCL


def test_from_environ_says_once_on_local_rank_0_why_gpus_talk_over_gloo(
    monkeypatch, with_nccl
) -> None:
    from mgpu_helpers.dist_env import _say_once

    _say_once.cache_clear()  # once per process: forget earlier tests' warnings
    monkeypatch.setattr("mgpu_helpers.devices.gpu_count", lambda: 2)
    torchrun_environ(monkeypatch, rank=4, local_rank=0, world=8, local_world=4)
    with pytest.warns(UserWarning, match=r"chose the gloo backend: Only 2 GPU\(s\) for 4"):
        assert DistEnv.from_environ().backend == "gloo"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call, or another local rank: silent
        DistEnv.from_environ()
        torchrun_environ(monkeypatch, rank=5, local_rank=1, world=8, local_world=4)
        DistEnv.from_environ()


def test_from_environ_honours_the_launchers_placement(monkeypatch, with_nccl) -> None:
    monkeypatch.setattr("mgpu_helpers.devices.gpu_count", lambda: 2)
    torchrun_environ(monkeypatch, rank=1, local_rank=1, world=2, local_world=2)
    monkeypatch.setenv("MGPU_DEVICE", "cpu")  # launch(worker, place(2, "cpu")) set these
    monkeypatch.setenv("MGPU_BACKEND", "gloo")
    assert DistEnv.from_environ() == DistEnv(1, 1, 2, torch.device("cpu"), "gloo")
    with pytest.raises(RuntimeError, match="launch placed this rank on cpu"):
        DistEnv.from_environ("cuda")


def test_from_environ_one_gpu_per_local_rank_gets_nccl(monkeypatch, with_nccl) -> None:
    monkeypatch.setattr("mgpu_helpers.devices.gpu_count", lambda: 4)
    torchrun_environ(monkeypatch, rank=5, local_rank=1, world=8, local_world=4)
    env = DistEnv.from_environ()
    assert (env.device, env.backend) == (torch.device("cuda:1"), "nccl")


def test_from_environ_without_local_world_size_uses_the_world_size(
    monkeypatch, with_nccl
) -> None:
    monkeypatch.setattr("mgpu_helpers.devices.gpu_count", lambda: 1)
    torchrun_environ(monkeypatch, rank=1, local_rank=1, world=2, local_world=2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    env = DistEnv.from_environ()
    assert (env.device, env.backend) == (torch.device("cuda:0"), "gloo")


def test_from_environ_refuses_a_local_rank_outside_the_local_world(monkeypatch) -> None:
    torchrun_environ(monkeypatch, rank=3, local_rank=3, world=4, local_world=2)
    with pytest.raises(RuntimeError, match="set LOCAL_WORLD_SIZE"):
        DistEnv.from_environ("cpu")
