"""The JupyterLab defaults `make lab` installs name real settings of the installed extensions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_name_settings_that_exist() -> None:
    overrides = json.loads((ROOT / "jupyter" / "overrides.json").read_text())
    share = Path(sys.prefix) / "share" / "jupyter"
    for plugin_id, values in overrides.items():
        package, _, plugin = plugin_id.partition(":")
        places = [  # an installed extension's schemas; JupyterLab's own plugins'
            share / "labextensions" / package / "schemas" / package / f"{plugin}.json",
            share / "lab" / "schemas" / package / f"{plugin}.json",
        ]
        schema_path = next((p for p in places if p.exists()), None)
        assert schema_path is not None, f"{plugin_id}: no such JupyterLab plugin installed"
        properties = json.loads(schema_path.read_text())["properties"]
        for key, value in values.items():
            assert key in properties, f"{plugin_id} has no setting {key!r}"
            assert isinstance(value, bool) == (properties[key]["type"] == "boolean")
            allowed = [choice["const"] for choice in properties[key].get("oneOf", [])]
            assert not allowed or value in allowed, f"{plugin_id}: {key} must be one of {allowed}"


def test_widget_state_is_saved_with_the_notebook() -> None:
    overrides = json.loads((ROOT / "jupyter" / "overrides.json").read_text())
    assert overrides["@jupyter-widgets/jupyterlab-manager:plugin"]["saveState"] is True


def test_no_news_popup_over_the_lessons() -> None:
    """JupyterLab's "fetch official Jupyter news?" pop-up covers the corner of cell outputs."""
    overrides = json.loads((ROOT / "jupyter" / "overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"


def test_comms_do_not_ask_for_subshells() -> None:
    """A widget's comm makes JupyterLab 4.5+ ask ipykernel 7 for a subshell, and that request's
    "idle" shows as the kernel's state while the cell still runs (README, the kernel status)."""
    overrides = json.loads((ROOT / "jupyter" / "overrides.json").read_text())
    kernels = overrides["@jupyterlab/apputils-extension:kernels-settings"]
    assert kernels["commsOverSubshells"] == "disabled"
