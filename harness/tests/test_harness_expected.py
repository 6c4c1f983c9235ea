"""Expected files: parsing, the three comparison modes at their boundaries, lookup order, the table."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from verity_harness.expected import (
    Expectation,
    check_metrics,
    find_expectations,
    format_checks,
    load_expected,
    parse_expected,
)

VALID = {
    "hardware": "cpu",
    "backend": "hf",
    "configs": {
        "cpu": {
            "source": "measured",
            "reference": "3 runs",
            "metrics": {
                "accuracy_after": {"target": 0.80, "tolerance": 0.05},
                "accuracy_gain": {"target": 0.30, "tolerance": 0.10, "mode": "at_least"},
                "wall_seconds": {"target": 100, "tolerance": 50, "mode": "at_most"},
            },
        }
    },
}


def test_parse_valid_file_keeps_order_and_modes() -> None:
    parsed = parse_expected(VALID)
    cfg = parsed.configs["cpu"]
    assert [e.metric for e in cfg.expectations] == ["accuracy_after", "accuracy_gain", "wall_seconds"]
    assert [e.mode for e in cfg.expectations] == ["within", "at_least", "at_most"]
    assert cfg.source == "measured" and cfg.reference == "3 runs"


def test_a_seed_spread_is_optional_and_carried_into_the_checks_dict() -> None:
    import copy

    data = copy.deepcopy(VALID)
    data["configs"]["cpu"]["metrics"]["accuracy_gain"]["seed_spread"] = 0.01
    cfg = parse_expected(data).configs["cpu"]
    spreads = {e.metric: e.seed_spread for e in cfg.expectations}
    assert spreads == {"accuracy_after": None, "accuracy_gain": 0.01, "wall_seconds": None}
    checks = {
        c.metric: c.as_dict() for c in check_metrics({"accuracy_gain": 0.35, "accuracy_after": 0.8}, cfg)
    }
    assert checks["accuracy_gain"]["seed_spread"] == 0.01 and checks["accuracy_gain"]["passed"]
    assert "seed_spread" not in checks["accuracy_after"]  # none recorded: the dict is as before
    missing = check_metrics({}, cfg)[1]
    assert not missing.passed and missing.seed_spread == 0.01


def test_the_shipped_seed_spreads_are_the_recorded_seeds_spread() -> None:
    root = Path(__file__).resolve().parents[2]
    grpo = load_expected(root / "recipes/grpo/src/verity_recipe_grpo/expected/cpu-hf.yaml").configs
    gain = {
        name: {e.metric: e.seed_spread for e in c.expectations}["accuracy_gain"] for name, c in grpo.items()
    }
    assert gain["cpu"] == pytest.approx(0.432 - 0.422)  # seeds 0-2 on the 0.534 build
    assert gain["cpu-async"] == pytest.approx(0.428 - 0.422)
    assert gain["cpu-2node"] == gain["cpu"]  # carried over with the targets
    assert gain["cpu-megatron"] is None and gain["cpu-tools"] is None  # one seed, or seeds on no one build


@pytest.mark.parametrize(
    ("mode", "value", "passed"),
    [
        ("within", 0.85, True),  # |0.85 - 0.80| = 0.05 <= 0.05
        ("within", 0.75, True),
        ("within", 0.851, False),
        ("within", 0.749, False),
        ("at_least", 0.75, True),  # >= 0.80 - 0.05
        ("at_least", 0.99, True),
        ("at_least", 0.749, False),
        ("at_most", 0.85, True),  # <= 0.80 + 0.05
        ("at_most", 0.10, True),
        ("at_most", 0.851, False),
    ],
)
def test_modes_at_their_boundaries(mode: str, value: float, passed: bool) -> None:
    check = Expectation("m", 0.80, 0.05, mode).check(value)
    assert check.passed is passed
    assert (check.reason == "") is passed


def test_missing_or_nan_metric_fails_with_a_reason() -> None:
    for value in (None, float("nan")):
        check = Expectation("val/acc", 0.5, 0.1).check(value)
        assert not check.passed and check.value is None
        assert "missing" in check.reason


def test_check_metrics_and_table_name_the_failing_metric() -> None:
    cfg = parse_expected(VALID).configs["cpu"]
    checks = check_metrics({"accuracy_after": 0.90, "accuracy_gain": 0.25}, cfg)
    assert [c.passed for c in checks] == [False, True, False]  # 0.90 outside 0.80±0.05; wall missing
    table = format_checks(checks)
    assert "FAIL accuracy_after: 0.9 is outside 0.8 ± 0.05" in table
    assert "FAIL wall_seconds: metric missing from the run" in table
    assert "≥ 0.2" in table  # at_least bound 0.30 - 0.10


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("backend"), "missing top-level key 'backend'"),
        (lambda d: d["configs"]["cpu"]["metrics"]["accuracy_after"].pop("target"), "missing 'target'"),
        (
            lambda d: d["configs"]["cpu"]["metrics"]["accuracy_after"].update(mode="near"),
            "mode must be one of",
        ),
        (
            lambda d: d["configs"]["cpu"]["metrics"]["accuracy_after"].update(tolerance=-1),
            "tolerance must be",
        ),
        (
            lambda d: d["configs"]["cpu"]["metrics"]["accuracy_after"].update(target="high"),
            "expected a number",
        ),
        (lambda d: d["configs"]["cpu"]["metrics"]["accuracy_after"].update(tol=1), "unknown keys ['tol']"),
        (
            lambda d: d["configs"]["cpu"]["metrics"]["accuracy_after"].update(tol=1),
            "allowed: target, tolerance, mode, seed_spread, note",
        ),
        (
            lambda d: d["configs"]["cpu"]["metrics"]["accuracy_gain"].update(seed_spread=-0.01),
            "configs.cpu.metrics.accuracy_gain: metric 'accuracy_gain': seed_spread must be a number >= 0",
        ),
        (
            lambda d: d["configs"]["cpu"]["metrics"]["accuracy_gain"].update(seed_spread="0.01"),
            "configs.cpu.metrics.accuracy_gain.seed_spread: expected a number, got '0.01'",
        ),
        (
            lambda d: d["configs"]["cpu"]["metrics"]["accuracy_gain"].update(seed_spread=True),
            "accuracy_gain.seed_spread: expected a number",
        ),
        (lambda d: d["configs"]["cpu"].update(source="guess"), "source: must be one of"),
        (lambda d: d["configs"]["cpu"].update(metrics={}), "non-empty 'metrics'"),
    ],
)
def test_bad_files_name_the_key(mutate, message: str) -> None:
    import copy

    data = copy.deepcopy(VALID)
    mutate(data)
    with pytest.raises(ValueError) as err:
        parse_expected(data, "cpu-hf.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("cpu-hf.yaml")


def test_file_name_must_match_hardware_and_backend(tmp_path: Path) -> None:
    path = tmp_path / "h100-hf.yaml"
    path.write_text(yaml.safe_dump(VALID))
    with pytest.raises(ValueError, match="must be cpu-hf.yaml"):
        load_expected(path)


def test_lookup_prefers_the_label_then_the_family(tmp_path: Path) -> None:
    for hardware, target in (("h100", 0.9), ("cuda", 0.5)):
        data = {**VALID, "hardware": hardware}
        data["configs"] = {"cpu": {"metrics": {"accuracy_after": {"target": target, "tolerance": 0.1}}}}
        (tmp_path / f"{hardware}-hf.yaml").write_text(yaml.safe_dump(data))
    assert find_expectations(tmp_path, "cpu", ["h100", "cuda"], "hf").expectations[0].target == 0.9
    assert find_expectations(tmp_path, "cpu", ["a100", "cuda"], "hf").expectations[0].target == 0.5
    assert find_expectations(tmp_path, "cpu", ["a100", "cuda"], "vllm") is None
    assert find_expectations(tmp_path, "other-config", ["h100", "cuda"], "hf") is None


def test_a_promise_for_one_engine_fails_a_run_of_another(tmp_path: Path) -> None:
    data = {**VALID}
    data["configs"] = {
        "cpu-megatron": {
            "train_engine": "megatron",
            "metrics": {"accuracy_after": {"target": 0.9, "tolerance": 0.1}},
        }
    }
    (tmp_path / "cpu-hf.yaml").write_text(yaml.safe_dump(data))
    expectations = find_expectations(tmp_path, "cpu-megatron", ["cpu"], "hf")
    assert expectations.train_engine == "megatron"
    assert expectations.check_engine("megatron") is None
    wrong = expectations.check_engine("fsdp2")
    assert wrong is not None and not wrong.passed and "trained with fsdp2" in wrong.reason
    with pytest.raises(ValueError, match="unknown keys \\['engine'\\]"):
        parse_expected(
            {**VALID, "configs": {"cpu": {"engine": "x", "metrics": VALID["configs"]["cpu"]["metrics"]}}}
        )


def test_a_promise_for_some_nodes_fails_a_run_on_another_number() -> None:
    data = {**VALID, "configs": {"cpu-2node": {"nodes": 2, "metrics": VALID["configs"]["cpu"]["metrics"]}}}
    expectations = parse_expected(data).configs["cpu-2node"]
    assert expectations.nodes == 2
    passed = expectations.check_nodes(2)
    assert passed is not None and passed.passed
    assert (passed.metric, passed.value, passed.target) == ("nodes", 2, 2)
    wrong = expectations.check_nodes(1)
    assert wrong is not None and not wrong.passed and "for a run on 2 nodes; the run used 1" in wrong.reason
    missing = expectations.check_nodes(None)
    assert missing is not None and not missing.passed and "did not report" in missing.reason
    assert parse_expected(VALID).configs["cpu"].check_nodes(3) is None  # no promise: any number
    for bad in (0, "two", True, 1.5):
        with pytest.raises(ValueError, match=r"configs.cpu-2node.nodes: expected a whole number"):
            parse_expected({**data, "configs": {"cpu-2node": {**data["configs"]["cpu-2node"], "nodes": bad}}})


def test_targets_carried_over_from_another_config_must_be_its_own() -> None:
    import copy

    data = copy.deepcopy(VALID)
    metrics = copy.deepcopy(VALID["configs"]["cpu"]["metrics"])
    data["configs"]["cpu-2node"] = {"source": "config:cpu", "metrics": metrics}
    assert parse_expected(data).configs["cpu-2node"].source == "config:cpu"
    drifted = copy.deepcopy(data)
    drifted["configs"]["cpu-2node"]["metrics"]["accuracy_after"]["target"] = 0.81
    with pytest.raises(ValueError, match=r"cpu-2node.metrics: the targets carried over from config 'cpu'"):
        parse_expected(drifted)
    for source, message in (
        ("config:gpu", "names no other config of this file"),
        ("config:cpu-2node", "names no other config of this file"),
        ("config", "must be one of measured, published or config:<name>"),
    ):
        named = copy.deepcopy(data)
        named["configs"]["cpu-2node"]["source"] = source
        with pytest.raises(ValueError, match=message):
            parse_expected(named)


def test_grpo_cpu_2node_promises_the_cpu_targets_on_two_nodes(result_factory) -> None:
    from verity_harness.recipes import find_recipe
    from verity_harness.runner import attach_checks

    grpo = find_recipe("grpo", Path(__file__).resolve().parents[2])
    expected = load_expected(grpo.expected_dir / "cpu-hf.yaml").configs
    two = expected["cpu-2node"]
    assert two.nodes == 2 and two.source == "config:cpu" and expected["cpu"].nodes is None
    assert two.expectations == expected["cpu"].expectations
    scores = {"accuracy_before": 0.525, "accuracy_after": 0.93, "accuracy_gain": 0.405}
    for nodes, passed in ((2, True), (1, False), (None, False)):
        result = result_factory(config="cpu-2node", nodes=nodes, simulated_nodes=2, scores=scores)
        checks = attach_checks(result, grpo, ["cpu"])
        assert [c.metric for c in checks][-1] == "nodes"
        assert result["passed"] is passed and result["expected_source"] == "config:cpu"


def test_an_entry_with_a_trainer_mode_fails_a_run_that_ran_another() -> None:
    data = {
        **VALID,
        "configs": {"cpu-async": {"trainer_mode": "async", "metrics": VALID["configs"]["cpu"]["metrics"]}},
    }
    expectations = parse_expected(data).configs["cpu-async"]
    assert expectations.trainer_mode == "async"
    assert expectations.check_mode("async") is None
    wrong = expectations.check_mode("sync")
    assert wrong is not None and not wrong.passed and "the run ran trainer.mode=sync" in wrong.reason
    silent = expectations.check_mode(None)  # a run from before runs reported their mode
    assert silent is not None and not silent.passed and "did not report" in silent.reason
    with pytest.raises(ValueError, match="trainer_mode: expected sync or async, got 'fast'"):
        parse_expected({**VALID, "configs": {"x": {**data["configs"]["cpu-async"], "trainer_mode": "fast"}}})
