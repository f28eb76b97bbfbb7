"""rota-adapter-verl where verl is not installed (the main venv): its range is data in one place, ``rota`` loads
its plugin without verl, and the ``verl.plugins`` entry point fails loudly when verl is missing."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import pathlib
import subprocess
import sys

import pytest
import tomllib

import rota_verl
from rota.errors import UnsupportedVersion

PYPROJECT = pathlib.Path(__file__).parents[1] / "pyproject.toml"


def test_the_verl_range_is_the_extra_in_pyproject() -> None:
    (dep,) = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["verl"]
    assert rota_verl.verl_spec() == dep.removeprefix("verl") == ">=0.9.1,<0.10"


def test_both_entry_points_are_declared() -> None:
    plugins = importlib.metadata.entry_points(group="verl.plugins")
    (verl_ep,) = [ep for ep in plugins if ep.value.startswith("rota_verl")]
    assert verl_ep.value == "rota_verl.verl_plugin"
    (rota_ep,) = [ep for ep in importlib.metadata.entry_points(group="rota") if ep.name == "rota_verl"]
    assert rota_ep.value == "rota_verl.plugin"


def test_rota_loads_its_plugin_without_verl() -> None:
    code = "import sys, rota_verl.plugin, rota_verl; print('verl' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed here")
def test_the_verl_plugin_fails_loudly_without_verl(caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="rota_verl"), pytest.raises(UnsupportedVersion,
                                                                          match="verl is not installed"):
        importlib.import_module("rota_verl.verl_plugin")
    assert "the verl plugin failed to load" in caplog.text and "rota_sync" in caplog.text
