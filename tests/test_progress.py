"""progress_bar: a live HTML bar in a notebook that ends as plain text; tqdm's text bar elsewhere.

The notebook cases run in a real Jupyter kernel: nbclient applies the kernel's display updates
to the saved outputs exactly as JupyterLab does, so the tests see what a saved notebook keeps;
and a client listening on the kernel's IOPub channel checks what JupyterLab's status bar shows
while a bar runs.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
from tqdm.std import tqdm as std_tqdm

from mgpu_helpers.progress import progress_bar

ROOT = Path(__file__).resolve().parents[1]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def test_outside_a_notebook_it_is_tqdms_text_bar():
    out = io.StringIO()
    bar = progress_bar(range(3), desc="steps", file=out)
    assert isinstance(bar, std_tqdm)
    assert "notebook" not in type(bar).__module__
    assert list(bar) == [0, 1, 2]
    assert "steps: 100%" in out.getvalue() and "3/3" in out.getvalue()


def test_disabled_bar_prints_nothing():
    out = io.StringIO()
    with progress_bar(total=4, disable=True, file=out) as bar:
        bar.update(4)
    assert out.getvalue() == ""


KERNEL_CELLS = [
    # 0: a finished loop
    "from mgpu_helpers.progress import progress_bar\n"
    "for _ in progress_bar(range(3), desc='demo', unit='step'):\n"
    "    pass",
    # 1: a loop left early
    "for i in progress_bar(range(5), desc='cut'):\n    if i == 2:\n        break",
    # 2: fit's epoch bar and batch bar
    "import torch\n"
    "from torch.utils.data import DataLoader, TensorDataset\n"
    "from mgpu_helpers.train import fit\n"
    "data = TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))\n"
    "model = torch.nn.Linear(4, 3)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "history = fit(model, DataLoader(data, batch_size=8), None, opt, 'cpu', 2)",
    # 3: a bar that is never closed stays a live HTML bar (nothing to summarise yet)
    "open_bar = progress_bar(total=10, desc='open', mininterval=0)\nopen_bar.update(3);",
]


@pytest.fixture(scope="module")
def kernel_outputs():
    """Run KERNEL_CELLS in a fresh kernel; return each cell's outputs as saved."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipywidgets")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in KERNEL_CELLS]
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + saved if saved else "")
    try:  # the kernel imports the package from this tree
        nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
    return [cell.outputs for cell in nb.cells]


def _texts(outputs) -> list[str]:
    return [o["data"]["text/plain"] for o in outputs if "data" in o]


def test_in_a_notebook_a_finished_bar_becomes_one_line_of_text(kernel_outputs):
    outputs = kernel_outputs[0]
    assert [o["output_type"] for o in outputs] == ["display_data"]
    assert set(outputs[0]["data"]) == {"text/plain"}, "the widget must be gone from the file"
    (text,) = _texts(outputs)
    assert text.startswith("demo: 100%") and "3/3" in text and "step/s" in text
    assert "\n" not in text


def test_in_a_notebook_a_bar_left_early_says_so(kernel_outputs):
    (text,) = _texts(kernel_outputs[1])
    assert set(kernel_outputs[1][0]["data"]) == {"text/plain"}
    assert text.startswith("cut:") and "2/5" in text and "stopped early" in text


def test_in_a_notebook_fits_bars_end_as_text(kernel_outputs):
    outputs = kernel_outputs[2]
    assert not any(WIDGET_MIME in o.get("data", {}) for o in outputs)
    epochs, batches = _texts(outputs)
    assert epochs.startswith("epochs: 100%") and "2/2" in epochs and "loss=" in epochs
    assert batches.startswith("epoch 2/2: 100%") and "4/4" in batches


def test_in_a_notebook_an_open_bar_is_drawn_as_html(kernel_outputs):
    (output,) = kernel_outputs[3]
    assert WIDGET_MIME not in output["data"], "a widget opens a comm (see the test below)"
    assert '<progress value="3" max="10"' in output["data"]["text/html"]
    assert output["data"]["text/plain"].startswith("open:  30%")


# A cell that runs for a few seconds with a bar, long enough for JupyterLab's traffic to land.
SLOW_BAR_CELL = (
    "import time\n"
    "from mgpu_helpers.progress import progress_bar\n"
    "for _ in progress_bar(range(12), desc='slow', mininterval=0):\n"
    "    time.sleep(0.25)"
)


def _untracked_message_types() -> set[str]:
    """Request types whose status messages JupyterLab ignores (jupyter_server sends the list)."""
    kernels = pytest.importorskip("jupyter_server.services.kernels.kernelmanager")
    return set(kernels.MappingKernelManager.class_traits()["untracked_message_types"].default())


def _wait_for_iopub(client, timeout: float = 60) -> None:
    """Return once the client's IOPub subscription receives the kernel's messages.

    A kernel_info reply comes on the shell channel; the IOPub subscription may connect later
    (ZeroMQ's slow joiner), and whatever the kernel publishes before is lost: on a busy machine
    a cell's "busy" status was. So ask again until a status for the request arrives on IOPub,
    and read up to its "idle".
    """
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        request = client.kernel_info()
        try:
            while True:
                msg = client.get_iopub_msg(timeout=1)
                mine = msg["parent_header"].get("msg_id") == request
                if mine and msg["content"].get("execution_state") == "idle":
                    return
        except queue.Empty:
            continue  # nothing for this request yet: ask again
    raise TimeoutError(f"the kernel's IOPub messages did not arrive within {timeout} s")


def test_jupyterlab_sees_the_kernel_busy_while_a_bar_runs():
    """The client below answers the kernel's IOPub traffic as JupyterLab 4.6 does.

    On a comm_open from the kernel (a widget), JupyterLab asks a kernel that supports subshells
    for one (create_subshell_request, on the control channel). It takes any status message as
    the kernel's status unless the status's parent is a request type in jupyter_server's
    untracked list, which lacks the subshell requests. So the control thread's "idle" for the
    subshell request showed the kernel "Idle" while a cell with tqdm's widget still ran.
    """
    jupyter_client = pytest.importorskip("jupyter_client")
    untracked = _untracked_message_types()
    kernel = jupyter_client.KernelManager(kernel_name="python3")
    saved = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + saved if saved else "")}
    kernel.start_kernel(env=env)
    client = kernel.client()
    client.start_channels()
    try:
        info = client.kernel_info(reply=True, timeout=60)
        subshells = "kernel subshells" in info["content"].get("supported_features", [])
        _wait_for_iopub(client)  # else the cell's first messages may be lost
        cell = client.execute(SLOW_BAR_CELL)
        seen = []  # (message type, its parent's type, execution state), in IOPub order
        shown = []  # what JupyterLab's status bar shows after each status message it tracks
        targets = set()  # comm targets JupyterLab asked a subshell for
        deadline = time.monotonic() + 60
        while True:
            msg = client.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
            kind, parent = msg["msg_type"], msg["parent_header"].get("msg_type")
            state = msg["content"].get("execution_state")
            seen.append((kind, parent, state))
            if kind == "comm_open" and subshells and msg["content"]["target_name"] not in targets:
                targets.add(msg["content"]["target_name"])
                client.control_channel.send(client.session.msg("create_subshell_request", {}))
            ours = msg["parent_header"].get("msg_id") == cell
            if kind == "status" and parent not in untracked and (shown or ours):
                shown.append(state)  # from the cell's "busy" on
            if kind == "status" and ours and state == "idle":
                break
    finally:
        client.stop_channels()
        kernel.shutdown_kernel(now=True)
    statuses = [m for m in seen if m[0] in ("status", "comm_open")]
    assert shown[0] == "busy" and shown[-1] == "idle", statuses
    assert "idle" not in shown[1:-1], f"JupyterLab would show 'Idle' while the cell ran: {statuses}"
    assert "comm_open" not in [m[0] for m in seen], "the bar opened a comm (a widget)"
    updates = [m for m in seen if m[0] == "update_display_data"]
    assert len(updates) >= 12, "the bar is redrawn in place by display updates"
