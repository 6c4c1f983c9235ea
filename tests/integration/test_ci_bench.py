"""ci/bench.py at a toy size: every pair runs, ratios are the quotients of the figures it reports."""

from __future__ import annotations

import math

import pytest
from helpers.ci_scripts import load_ci_script


def test_bench_reports_side_by_side_ratios() -> None:
    bench = load_ci_script("bench")
    result = bench.run_bench(repeats=1, batch=4, prompt_len=8, response_len=4, vllm_sizes=())
    g, t, s = result["generate"], result["train"], result["weight_sync"]
    ratios = result["ratios"]
    assert ratios["generate_vs_hf_generate"] == pytest.approx(
        g["verity_tokens_per_s"] / g["hf_generate_tokens_per_s"]
    )
    assert ratios["train_vs_plain_torch"] == pytest.approx(
        t["verity_tokens_per_s"] / t["plain_torch_tokens_per_s"]
    )
    assert ratios["weight_sync_vs_load_state_dict"] == pytest.approx(
        s["verity_seconds"] / s["load_state_dict_seconds"]
    )
    assert all(math.isfinite(v) and v > 0 for v in ratios.values())
    table = bench.format_bench(result)
    assert "generation tokens/s" in table and "batch 4 x (prompt 8 + response 4)" in table


def test_bench_vllm_pairs_at_each_size() -> None:
    from helpers.vllm_required import require_vllm

    require_vllm()
    bench = load_ci_script("bench")
    result = bench.run_bench(repeats=1, batch=4, prompt_len=8, response_len=4, vllm_sizes=("tiny",))
    tiny = result["vllm_generate"]["tiny"]
    assert set(result["vllm_generate"]) == {"tiny"}
    assert result["ratios"]["vllm_generate_vs_hf_generate_tiny"] == pytest.approx(
        tiny["vllm_tokens_per_s"] / tiny["hf_generate_tokens_per_s"]
    )
    assert tiny["n_params"] == result["settings"]["n_params"]  # the tiny size is the bench's model
    assert "vLLM gen tok/s tiny" in bench.format_bench(result)
    with pytest.raises(ValueError, match="vllm_sizes: unknown"):
        bench.run_bench(repeats=1, batch=2, prompt_len=4, response_len=2, vllm_sizes=("huge",))


def test_bench_rejects_zero_repeats() -> None:
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        load_ci_script("bench").run_bench(repeats=0)


def test_a_planted_update_slowdown_is_flagged_by_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training pair's verity side runs the update; slowed by 100% (planted) its ratio fails the gate."""
    from verity.testing import slow_stage

    bench = load_ci_script("bench")
    gates = load_ci_script("nightly_gates")
    size = {"repeats": 3, "batch": 32, "prompt_len": 16, "response_len": 16, "vllm_sizes": ()}
    accepted = bench.run_bench(**size)
    monkeypatch.setitem(slow_stage.SLOWED, "update_actor", 1.0)
    planted = bench.run_bench(**size)
    name = "train_vs_plain_torch"
    assert len(planted["ratio_rounds"][name]) == 3
    spec = {"value": accepted["ratios"][name], "rounds": accepted["ratio_rounds"][name]}
    finding = gates.judge(
        f"bench.{name}", gates.Figure(planted["ratios"][name], planted["ratio_rounds"][name]), spec
    )
    assert not finding.ok, finding
    # a doubled update halves the ratio on a quiet machine; other work on the cores dilutes the
    # planted share (0.69 measured beside a CI run), so only a clear drop is asserted
    assert 0.3 < finding.ratio < 0.8
