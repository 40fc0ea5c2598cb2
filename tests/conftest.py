"""Shared fixtures for the tests, the GPU markers, and an offline guard.

Tests marked ``gpu`` need one CUDA device and tests marked ``multigpu`` two or more. Without
them they are reported as skipped, with the reason, never silently passed (STYLE.md, rule 10).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester"]  # test_devices_cli.py runs the marker hook in an inner session


def pytest_configure(config: pytest.Config) -> None:
    # The unit tests run tiny models, where extra intra-op threads gain nothing. On a busy
    # 2-core machine OpenMP threads spin against other processes and made a 4-epoch digits
    # fit 50x slower (0.2 s -> 11 s, measured); one thread keeps the suite fast and steady.
    torch.set_num_threads(1)


def _cuda_device_count() -> int:
    try:
        return torch.cuda.device_count()  # asks NVML; creates no CUDA context
    except Exception:  # a broken driver can make even the count raise
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `gpu` / `multigpu` tests as skipped when this machine lacks the GPUs."""
    n = _cuda_device_count()
    skip_multi = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs; torch sees {n}")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none")
    for item in items:
        if item.get_closest_marker("multigpu") is not None and n < 2:
            item.add_marker(skip_multi)
        elif item.get_closest_marker("gpu") is not None and n < 1:
            item.add_marker(skip_gpu)


# --- offline guard --------------------------------------------------------------------------

_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "", socket.gethostname()}


def _is_local(address: object) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX socket path
        return True
    if isinstance(address, tuple) and address:
        host = str(address[0])
        return host in _LOCAL_HOSTS or host.startswith("127.")
    return False


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse connections from this process to anything but this machine.

    A test that would download (torchvision data, pip) fails at once with a clear message
    instead of hanging or depending on the network. Loopback stays open for Jupyter kernels
    and gloo rendezvous; child processes are not affected.
    """
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def guard(address: object) -> None:
        if not _is_local(address):
            raise OSError(f"network access is blocked in the tests (tried {address!r})")

    def connect(self: socket.socket, address: object) -> None:
        guard(address)
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: object) -> int:
        guard(address)
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)


# --- shared fixtures ------------------------------------------------------------------------


@pytest.fixture
def no_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Full-size defaults: MGPU_QUICK unset for this test (the runner may set it outside)."""
    monkeypatch.delenv("MGPU_QUICK", raising=False)


@pytest.fixture(scope="session")
def digits_data():
    """The digits train and test sets, loaded once (read-only: do not modify them)."""
    from mgpu_helpers.data import digits

    return digits(train=True), digits(train=False)


NotebookCell = tuple[str, str]  # ("params" | "code" | "markdown", source)


def write_notebook(path: Path, cells: list[NotebookCell]) -> Path:
    """Write a small notebook: ("params", src) is a code cell tagged ``parameters``."""
    import nbformat  # here, not at the top: the GPU check runs without the Jupyter stack

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    for kind, source in cells:
        if kind == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(source))
        elif kind == "params":
            nb.cells.append(nbformat.v4.new_code_cell(source, metadata={"tags": ["parameters"]}))
        elif kind == "code":
            nb.cells.append(nbformat.v4.new_code_cell(source))
        else:
            raise ValueError(f"unknown cell kind {kind!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="session")
def notebook_writer() -> Callable[[Path, list[NotebookCell]], Path]:
    """The :func:`write_notebook` helper, for tests that build tiny notebooks."""
    return write_notebook
