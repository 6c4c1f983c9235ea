"""ci/nightly_cross_class.py: which figures travel, their measured moves, the nearest class, and the gates across classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.ci_scripts import load_ci_script
from verity.hardware.cpu_peak import MATMUL_ISA_FLAGS

cross = load_ci_script("nightly_cross_class")
gates = load_ci_script("nightly_gates")

ROOT = Path(__file__).resolve().parents[2]
INTEL, AMD = "cpu-intel-xeon/amx_bf16", "cpu-amd-epyc/avx512_bf16"


def test_figures_split_into_same_run_ratios_absolute_figures_and_gains() -> None:
    assert cross.figure_kind("bench.train_vs_plain_torch") == "same-run ratio"
    assert cross.figure_kind("bench.grpo_step_vs_trl_quickstart") == "same-run ratio"
    assert cross.figure_kind("bench.weight_sync_vs_load_state_dict") == "same-run ratio"
    assert cross.figure_kind("grpo.tokens_per_s_vs_plain_torch") == "absolute"
    assert cross.figure_kind("grpo/cpu-vllm.accuracy_gain") == "accuracy"


def test_the_isa_ladder_is_verity_s() -> None:
    assert cross.ISA_LADDER == MATMUL_ISA_FLAGS


@pytest.mark.parametrize(
    ("klass", "accepted", "nearest", "why"),
    [
        # today's class: an EPYC without AVX-512; AVX-512 is one rung closer than AMX
        ("cpu-amd-epyc/avx2", [INTEL, AMD], AMD, "2 rung(s) away"),
        ("cpu-intel-xeon/amx_bf16", [AMD], AMD, "another CPU maker"),
        # the same family beats the same maker
        ("cpu-amd-epyc/avx512f", [INTEL, "cpu-intel-xeon/avx512_bf16"], "cpu-intel-xeon/avx512_bf16", "same"),
        ("cpu-amd-epyc/avx512f", ["cpu-intel-xeon/avx512_bf16", AMD], AMD, "the same CPU maker"),
    ],
)
def test_the_nearest_class_is_the_same_isa_family_first(
    klass: str, accepted: list[str], nearest: str, why: str
) -> None:
    found, reason = cross.nearest_class(klass, accepted)
    assert found == nearest and why in reason


def test_no_nearest_class_says_why() -> None:
    assert cross.nearest_class("h200/none", [AMD]) == (
        None,
        "h200/none is not a CPU class and the cross-class moves were measured on CPUs only",
    )
    assert cross.nearest_class(AMD, [AMD, "h200/none"]) == (None, "no CPU class has an accepted baseline")


def test_every_report_named_class_is_in_its_report() -> None:
    for report, (klass, words) in cross.REPORT_CLASSES.items():
        assert words in (cross.REPORTS_DIR / report).read_text(), f"{report} does not say {words!r}"
        assert klass.split("/")[1] in cross.ISA_LADDER


def _night(klass: str, figures: dict[str, float], source: str = "", planted: list | None = None) -> dict:
    return {
        "kind": "verity-nightly-night",
        "machine_class": klass,
        "source": source,
        "planted": planted or [],
        "figures": {m: {"value": v} for m, v in figures.items()},
    }


def test_a_move_is_the_largest_gap_between_class_medians() -> None:
    nights = {
        "a1": _night(
            INTEL, {"bench.x": 1.0, "grpo.accuracy_gain": 0.44, "grpo.tokens_per_s_vs_plain_torch": 2}
        ),
        "a2": _night(INTEL, {"bench.x": 1.02, "grpo.accuracy_gain": 0.44}),
        "b1": _night(
            AMD, {"bench.x": 1.1, "grpo.accuracy_gain": 0.42, "grpo.tokens_per_s_vs_plain_torch": 1}
        ),
        "b2": _night(AMD, {"bench.x": 1.1, "grpo.accuracy_gain": 0.42, "bench.only_amd": 3.0}),
        "b3": _night(AMD, {"bench.x": 0.1}, planted=["slowdown update_actor:0.1"]),
        "old": _night("unrecorded", {"bench.x": 5.0}, source="2026-11-22-accepted.md"),
        "named": _night("unrecorded", {"bench.x": 1.01}, source="2026-11-26-nightly-2.md"),
    }
    m = cross.measure(nights)
    x = m["figures"]["bench.x"]
    assert x["classes"][INTEL] == {"median": 1.01, "nights": 3}  # the report names night "named" Intel
    assert x["move"] == pytest.approx(1.1 / 1.01 - 1, abs=1e-4)
    assert m["figures"]["grpo.accuracy_gain"]["move"] == pytest.approx(0.02)
    assert m["figures"]["grpo.tokens_per_s_vs_plain_torch"]["move"] is None  # absolute: never across
    assert m["figures"]["bench.only_amd"]["move"] is None  # one class: nothing to measure
    assert set(m["left_out"]) == {"b3", "old"} and "planted" in m["left_out"]["b3"]


def test_the_committed_moves_are_the_measurement_of_the_nights_they_name() -> None:
    doc = json.loads((ROOT / "ci" / "cross_class.json").read_text())
    names = [n for ns in doc["measured"]["nights"].values() for n in ns] + list(doc["measured"]["left_out"])
    nights = cross.load_nights(ROOT / doc["measured"]["nights_dir"])
    assert cross.measure({n: nights[n] for n in names})["figures"] == doc["figures"]
    moves = cross.load_moves(ROOT / "ci" / "cross_class.json")
    assert set(moves) >= {
        "bench.train_vs_plain_torch",
        "bench.weight_sync_vs_load_state_dict",
        "grpo.accuracy_gain",
    }
    assert not any(m.endswith("tokens_per_s_vs_plain_torch") for m in moves)


def test_a_cross_class_file_of_another_layout_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("[]")
    with pytest.raises(ValueError, match="expected a cross-class file with a 'figures' object"):
        cross.load_moves(tmp_path / "x.json")
    assert cross.load_moves(tmp_path / "none.json") == {}


def _speed(value: float, spread: float = 0.01) -> gates.Figure:
    return gates.Figure(value, [value * (1 + k * spread) for k in (-2, -1, 0, 1, 2)])


def test_across_classes_the_speed_floor_grows_by_the_move() -> None:
    spec = {"value": 1.0}
    inside = gates.judge("bench.train_vs_plain_torch", _speed(0.93), spec, "x/avx2", AMD, 0.03)
    assert inside.ok and inside.allowed_drop == pytest.approx(0.08) and inside.compared_with == AMD
    assert f"judged against {AMD}" in inside.note
    assert not gates.judge("bench.train_vs_plain_torch", _speed(0.91), spec, "x/avx2", AMD, 0.03).ok
    # within its own class the same figure would fail: the move counts only across classes
    assert not gates.judge("bench.train_vs_plain_torch", _speed(0.93), spec).ok


def test_a_speed_figure_without_a_measured_move_is_not_judged_across_and_says_so() -> None:
    f = gates.judge("bench.new_ratio", _speed(0.1), {"value": 1.0}, "x/avx2", AMD, None)
    assert (
        f.ok and f.allowed_drop is None and f.note.startswith("not judged: no move between machine classes")
    )
    f = gates.judge("bench.new_ratio", _speed(0.1), None, "x/avx2", AMD, 0.03)
    assert f.ok and f.note == f"not judged: {AMD} has no accepted value for this figure"


GRPO_AMD = {"value": 0.422, "allowed_drop": 0.06, "seed_spread": 0.01, "accuracy_before": 0.534}


def _gain(gain: float, before: float = 0.516) -> gates.Figure:
    return gates.Figure(gain, kind="accuracy", allowed_drop=0.06, seed_spread=0.01, accuracy_before=before)


def test_a_halved_learning_rate_is_caught_against_another_class() -> None:
    # 0.362: grpo's gain with actor.optim.lr halved (ci/reports/2026-11-28-nightly-gates.md, night D)
    halved = gates.judge("grpo.accuracy_gain", _gain(0.362), GRPO_AMD, "x/avx2", AMD, 0.018)
    assert not halved.ok and halved.allowed_drop == pytest.approx(0.038)
    assert halved.threshold == ">= 0.384 (baseline - 0.038)" and f"judged against {AMD}" in halved.note
    for unchanged in (0.404, 0.422, 0.44):  # the accepted gain moved down or up by the measured move
        assert gates.judge("grpo.accuracy_gain", _gain(unchanged), GRPO_AMD, "x/avx2", AMD, 0.018).ok


def test_on_another_build_of_its_own_class_a_gain_uses_the_move_when_measured() -> None:
    other_build = gates.judge("grpo.accuracy_gain", _gain(0.362), GRPO_AMD, AMD, None, 0.018)
    assert not other_build.ok and "another warm-start build" in other_build.note
    assert "cross-class move 0.018" in other_build.note
    unmeasured = gates.judge("grpo.accuracy_gain", _gain(0.370), GRPO_AMD, AMD, None, None)
    assert unmeasured.ok and unmeasured.allowed_drop == pytest.approx(0.06)  # the expected file's tolerance


def test_a_gain_without_a_seed_spread_keeps_the_tolerance_as_its_noise_term() -> None:
    figure = gates.Figure(0.30, kind="accuracy", allowed_drop=0.1, accuracy_before=0.05)
    f = gates.judge("grpo/cpu-tools.accuracy_gain", figure, {"value": 0.6953}, "x/avx2", AMD, 0.109)
    assert f.allowed_drop == pytest.approx(0.129) and not f.ok
    assert "the expected file's tolerance 0.1" in f.note
