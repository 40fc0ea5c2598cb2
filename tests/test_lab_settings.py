"""The JupyterLab defaults `make lab` installs name real settings of the installed extensions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_name_settings_that_exist() -> None:
    overrides = json.loads((ROOT / "jupyter" / "overrides.json").read_text())
    extensions = Path(sys.prefix) / "share" / "jupyter" / "labextensions"
    for plugin_id, values in overrides.items():
        package, _, plugin = plugin_id.partition(":")
        schema_path = extensions / package / "schemas" / package / f"{plugin}.json"
        assert schema_path.exists(), f"{plugin_id}: no such JupyterLab plugin installed"
        properties = json.loads(schema_path.read_text())["properties"]
        for key, value in values.items():
            assert key in properties, f"{plugin_id} has no setting {key!r}"
            assert isinstance(value, bool) == (properties[key]["type"] == "boolean")


def test_widget_state_is_saved_with_the_notebook() -> None:
    overrides = json.loads((ROOT / "jupyter" / "overrides.json").read_text())
    assert overrides["@jupyter-widgets/jupyterlab-manager:plugin"]["saveState"] is True
