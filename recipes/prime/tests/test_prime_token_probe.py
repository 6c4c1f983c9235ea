"""The PRM token probe (recipes/prime/scripts/prm_token_probe.py) scores clean and slipped answers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "prm_token_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("prm_token_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_prm_equal_to_its_reference_gives_zero_rewards_everywhere(
    prime_tiny_model_and_task, capsys
) -> None:
    model = prime_tiny_model_and_task["model"]
    assert _probe().main([model, model, prime_tiny_model_and_task["test"], "--beta", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "problems)" in out
    lines = dict(line.split() for line in out.splitlines() if line.startswith("  "))
    assert lines["slip_full_stop"] == "+0.0000" and lines["clean_q"] == "+0.0000"
    assert lines["clean_beats_slip"] == "+0.0000"  # equal scores: never strictly better
