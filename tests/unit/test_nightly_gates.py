"""ci/nightly_gates.py: the noise-aware gates on synthetic figures, and the planted-slowdown hook they are proven with."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers.ci_scripts import load_ci_script
from verity.testing import slow_stage
from verity.trainer.loop import StageTimer

gates = load_ci_script("nightly_gates")


def _speed(value: float, spread: float = 0.0) -> gates.Figure:
    """Five rounds around ``value`` whose MAD is ``spread`` (relative)."""
    rounds = [value * (1 + k * spread) for k in (-2, -1, 0, 1, 2)]
    return gates.Figure(value, rounds)


def test_mad_is_the_median_absolute_deviation() -> None:
    assert gates.mad([1.0, 2.0, 3.0, 4.0, 100.0]) == 1.0
    assert gates.mad([5.0]) == 0.0
    with pytest.raises(ValueError, match="at least one value"):
        gates.mad([])


@pytest.mark.parametrize(
    ("spread", "drop", "flagged"),
    [
        (0.0, 0.04, False),  # inside the 5% floor
        (0.0, 0.06, True),  # past it: a quiet machine catches a 6% loss
        (0.03, 0.08, False),  # 3 x 3% = 9% allowed
        (0.03, 0.10, True),
        (0.10, 0.25, False),  # a noisy night allows 30%: it says so instead of crying wolf
    ],
)
def test_a_speed_figure_regresses_past_three_mads_or_the_floor(
    spread: float, drop: float, flagged: bool
) -> None:
    tonight = _speed(1.0 * (1 - drop), spread)
    finding = gates.judge("bench.train_vs_plain_torch", tonight, {"value": 1.0})
    assert finding.ok is not flagged
    assert finding.allowed_drop == pytest.approx(max(3 * spread, 0.05))
    assert finding.spread == pytest.approx(spread * tonight.value)


def test_the_accepted_nights_spread_counts_too() -> None:
    quiet_tonight = _speed(0.9)  # 10% down, no spread tonight
    noisy_baseline = {"value": 1.0, "rounds": [0.8, 0.9, 1.0, 1.1, 1.2]}  # MAD/median 10%
    assert gates.judge("bench.x", quiet_tonight, noisy_baseline).ok
    assert not gates.judge("bench.x", quiet_tonight, {"value": 1.0}).ok


def test_lower_is_better_figures_regress_upwards() -> None:
    assert not gates.judge("bench.weight_sync_vs_load_state_dict", _speed(1.1), {"value": 1.0}).ok
    assert gates.judge("bench.weight_sync_vs_load_state_dict", _speed(0.5), {"value": 1.0}).ok


def test_a_rows_tokens_per_s_figure_is_information_only() -> None:
    for tonight in (_speed(0.3), gates.Figure(0.5, [0.5]), gates.Figure(None)):
        finding = gates.judge("grpo.tokens_per_s_vs_plain_torch", tonight, {"value": 1.0})
        assert finding.ok and finding.threshold == "info" and "information only" in finding.note
        assert finding.allowed_drop is None and finding.baseline == 1.0
    assert gates.judge(
        "grpo.tokens_per_s_vs_plain_torch", _speed(0.3), {"value": 1.0}
    ).ratio == pytest.approx(0.3)
    assert "information only" in gates.RULE and "tokens/s vs plain torch" in gates.RULE


def test_a_speed_figure_needs_three_rounds() -> None:
    finding = gates.judge("bench.x", gates.Figure(1.0, [1.0, 1.0]), {"value": 1.0})
    assert not finding.ok and "needs >= 3" in finding.note


def test_an_accuracy_gain_may_drop_by_the_expected_files_tolerance() -> None:
    spec = {"value": 0.44, "allowed_drop": 0.05}
    assert gates.judge("grpo.accuracy_gain", gates.Figure(0.39, kind="accuracy", allowed_drop=0.06), spec).ok
    assert not gates.judge(
        "grpo.accuracy_gain", gates.Figure(0.37, kind="accuracy", allowed_drop=0.06), spec
    ).ok
    # no check tonight: the tolerance stored with the baseline
    assert not gates.judge("grpo.accuracy_gain", gates.Figure(0.385, kind="accuracy"), spec).ok
    missing = gates.judge("grpo.accuracy_gain", gates.Figure(0.4, kind="accuracy"), {"value": 0.44})
    assert not missing.ok and "no tolerance" in missing.note


# the grpo row on the 0.534 warm-start build: accepted gain 0.422 (night A of 2026-11-28), seeds
# 0-2 spread 0.010 on that build; the expected file's tolerance 0.06 covers the 0.516 build too
GRPO_ACCEPTED = {"value": 0.422, "allowed_drop": 0.06, "accuracy_before": 0.534}


def _gain(gain: float, before: float | None = 0.534, spread: float | None = 0.010) -> gates.Figure:
    return gates.Figure(gain, kind="accuracy", allowed_drop=0.06, seed_spread=spread, accuracy_before=before)


def test_a_halved_learning_rate_is_flagged_on_the_accepted_build() -> None:
    finding = gates.judge("grpo.accuracy_gain", _gain(0.362), GRPO_ACCEPTED)  # night D: lr 1.5e-5
    assert not finding.ok
    assert finding.allowed_drop == pytest.approx(0.03)  # max(3 x 0.010, 0.02)
    assert finding.threshold == ">= 0.392 (baseline - 0.03)" and "same warm-start build" in finding.note


def test_an_unchanged_night_on_the_accepted_build_passes() -> None:
    for gain in (0.422, 0.426, 0.432, 0.395):  # the seeds, and a drop just inside 3 seed spreads
        assert gates.judge("grpo.accuracy_gain", _gain(gain), GRPO_ACCEPTED).ok
    assert not gates.judge("grpo.accuracy_gain", _gain(0.389), GRPO_ACCEPTED).ok


def test_a_tiny_seed_spread_is_floored() -> None:
    finding = gates.judge("grpo.accuracy_gain", _gain(0.405, spread=0.001), GRPO_ACCEPTED)
    assert finding.ok and finding.allowed_drop == pytest.approx(0.02)
    assert not gates.judge("grpo.accuracy_gain", _gain(0.40, spread=0.001), GRPO_ACCEPTED).ok


@pytest.mark.parametrize(
    ("figure", "spec", "why"),
    [
        (
            _gain(0.384, before=0.516),
            GRPO_ACCEPTED,
            "another warm-start build (accuracy before 0.516, accepted 0.534)",
        ),
        (_gain(0.384, spread=None), GRPO_ACCEPTED, "records no seed_spread"),
        (_gain(0.384, before=None), GRPO_ACCEPTED, "tonight reported none"),
        (_gain(0.384), {"value": 0.422, "allowed_drop": 0.06}, "the accepted night kept no accuracy_before"),
    ],
)
def test_otherwise_the_gain_falls_back_to_the_tolerance_and_says_why(
    figure: gates.Figure, spec: dict, why: str
) -> None:
    finding = gates.judge("grpo.accuracy_gain", figure, spec)
    assert finding.ok and finding.allowed_drop == pytest.approx(0.06)
    assert why in finding.note and "the expected file's tolerance" in finding.note
    figure.value = 0.36
    assert not gates.judge("grpo.accuracy_gain", figure, spec).ok


def test_the_baselines_seed_spread_serves_when_tonight_has_none() -> None:
    spec = {**GRPO_ACCEPTED, "seed_spread": 0.01}
    assert not gates.judge("grpo.accuracy_gain", _gain(0.362, spread=None), spec).ok


def _night(update_slowdown: float = 0.0, gain: float = 0.44) -> dict[str, gates.Figure]:
    """A synthetic night: the figures a 10%-slower update moves, each with a 1% round spread.

    The update is 40% of a GRPO step, so slowing it by f slows the step (and the TRL ratio, and the
    row's tokens/s) by 0.4 f: diluted below their floors.
    """
    step = 1 + 0.4 * update_slowdown
    return {
        "bench.train_vs_plain_torch": _speed(1.0 / (1 + update_slowdown), 0.01),
        "bench.generate_vs_hf_generate": _speed(1.2, 0.01),
        "bench.grpo_step_vs_trl_quickstart": _speed(2.0 / step, 0.01),
        "grpo.tokens_per_s_vs_plain_torch": _speed(2.0 / step, 0.01),
        "grpo.accuracy_gain": gates.Figure(gain, kind="accuracy", allowed_drop=0.06),
    }


def _flagged(night: dict[str, gates.Figure], accepted: dict[str, gates.Figure]) -> list[str]:
    specs = {m: {"value": f.value, "rounds": f.rounds} for m, f in accepted.items()}
    return [m for m, f in night.items() if not gates.judge(m, f, specs[m]).ok]


def test_a_slowed_update_flags_its_figure_and_no_other_and_an_unchanged_night_nothing() -> None:
    accepted = _night()
    assert _flagged(_night(), accepted) == []
    assert _flagged(_night(update_slowdown=0.10), accepted) == ["bench.train_vs_plain_torch"]
    assert _flagged(_night(gain=0.30), accepted) == ["grpo.accuracy_gain"]


def test_slowdowns_parse_or_refuse_with_the_variable_named() -> None:
    assert slow_stage.parse_slowdowns("") == {}
    assert slow_stage.parse_slowdowns("update_actor:0.1, generate:2") == {
        "update_actor": 0.1,
        "generate": 2.0,
    }
    for bad in ("update_actor", "update_actor:x", ":0.1", "update_actor:0", "update_actor:-1", "a:inf"):
        with pytest.raises(ValueError, match="VERITY_TEST_SLOW_STAGE: .* is not stage:fraction"):
            slow_stage.parse_slowdowns(bad)


def test_the_stage_timer_stretches_only_a_slowed_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(slow_stage.SLOWED, "update_actor", 1.0)
    timer = StageTimer()
    for name in ("generate", "update_actor"):
        with timer.stage(name):
            time.sleep(0.05)
    assert timer.seconds["generate"] < 0.09
    assert timer.seconds["update_actor"] >= 0.1  # 0.05 s of work + 100%


def test_unset_the_hook_adds_nothing() -> None:
    assert slow_stage.SLOWED == {}  # the test session runs without VERITY_TEST_SLOW_STAGE
    assert slow_stage.slow_down("update_actor", 1.0) == 0.0


def test_a_spun_slowdown_spends_the_clocks_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(slow_stage.SLOWED, "update_actor", 0.5)
    start = time.process_time()
    assert slow_stage.slow_down("update_actor", 0.1, clock=time.process_time) == pytest.approx(0.05)
    assert time.process_time() - start >= 0.05


def test_two_bench_documents_are_judged_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def bench(train: float) -> dict:
        return {
            "ratios": {"train_vs_plain_torch": train},
            "ratio_rounds": {"train_vs_plain_torch": [train] * 3},
        }

    (tmp_path / "a.json").write_text(json.dumps(bench(1.0)))
    (tmp_path / "b.json").write_text(json.dumps(bench(0.9)))
    assert gates.main([str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    capsys.readouterr()
    assert gates.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    out = capsys.readouterr().out
    assert "bench.train_vs_plain_torch: 0.9000" in out and out.rstrip().endswith("REGRESSION")
    assert gates.main([]) == 2
