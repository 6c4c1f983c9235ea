"""verity diagnose --ray really starts and stops a private local Ray instance."""

from __future__ import annotations

import json

import pytest
from verity.cli import diagnose


def test_ray_flag_starts_a_local_instance(monkeypatch, capsys):
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert diagnose.main(["--ray", "--json"]) == 0
    local = json.loads(capsys.readouterr().out)["ray"]["local_start"]
    assert local["ok"] is True, local
    assert local["resources"]["CPU"] == 1.0
    assert not ray.is_initialized()
