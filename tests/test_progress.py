"""progress_bar: a live widget in a notebook that ends as plain text; tqdm's text bar elsewhere.

The notebook case runs in a real Jupyter kernel (nbclient applies the kernel's display updates
to the saved outputs exactly as JupyterLab does), so the test sees what a saved notebook keeps.
"""

from __future__ import annotations

import io
import os
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
    # 3: a bar that is never closed stays a live widget (nothing to summarise yet)
    "open_bar = progress_bar(total=10, desc='open')\nopen_bar.update(3)",
    # 4: a closed bar's widgets are closed too (their models leave the saved widget state)
    "kept = progress_bar(range(2), desc='kept')\n"
    "for _ in kept:\n"
    "    pass\n"
    "parts = (*kept.container.children, kept.container)\n"
    "models = [m for w in parts for m in (w, w.layout, getattr(w, 'style', None)) if m]\n"
    "print('widgets closed:', all(m.comm is None for m in models))",
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


def test_in_a_notebook_an_open_bar_is_a_live_widget(kernel_outputs):
    outputs = kernel_outputs[3]
    assert any(WIDGET_MIME in o.get("data", {}) for o in outputs)


def test_a_closed_bar_closes_its_widgets(kernel_outputs):
    printed = "".join(o.get("text", "") for o in kernel_outputs[4] if o["output_type"] == "stream")
    assert "widgets closed: True" in printed, printed
