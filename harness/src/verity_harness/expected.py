"""Expected-metric files: what a recipe promises on one (hardware, rollout backend).

``expected/<hardware>-<backend>.yaml`` (e.g. ``cpu-hf.yaml``, ``cuda-hf.yaml``)::

    hardware: cpu
    backend: hf
    configs:
      cpu:                              # the config (file stem under configs/)
        source: measured                # measured (reruns here) | published (a paper or log) | config:<name>
        reference: "5 runs, 2026-11-22, 2-core x86 CPU"
        train_engine: fsdp2             # optional: the training engine the promise is for
        nodes: 2                        # optional: the Ray nodes the run's pools must have used
        trainer_mode: async             # optional: the trainer.mode the run must report it ran (ran.mode)
        metrics:
          accuracy_after: {target: 0.80, tolerance: 0.06}
          accuracy_gain:  {target: 0.30, tolerance: 0.12, mode: at_least, seed_spread: 0.01}

Each metric passes when, with ``t = target`` and ``d = tolerance``:

| mode       | passes when        | for                                          |
|------------|--------------------|----------------------------------------------|
| ``within`` | ``|x - t| <= d``   | the default: a rerun must reproduce the run  |
| ``at_least`` | ``x >= t - d``   | scores where doing better is not a failure   |
| ``at_most``  | ``x <= t + d``   | costs (seconds, memory) where less is fine   |

``seed_spread`` (optional, >= 0) is the metric's max - min over the seeds it was measured
from on ONE warm-start build of the model (the tolerance usually covers several builds or
machines as well). The checks do not use it; it is carried into each check's dict for the
nightly's accuracy gate (``ci/nightly_gates.py``), which allows a smaller drop when tonight's
warm-start build is the accepted night's.

A metric missing from the run fails (a promise nobody checked is not kept). A config
entry with ``train_engine`` (e.g. the ``cpu-megatron`` config of recipes/grpo) also
fails when the run's workers reported another training engine; one with ``nodes`` (the
``cpu-2node`` config) when the run's pools used another number of nodes (``ran.nodes``); one
with ``trainer_mode`` (the ``cpu-async`` config) when the run reported another ``trainer.mode``
running (``ran.mode``: ``async`` when a rollout worker group of its own generated ahead).

``source: config:<name>`` says the targets are another config's of the same file, measured
there and carried over because the two configs are shown to run identically (e.g. ``cpu-2node``
and ``cpu``: tests/e2e/test_multinode_runs.py). The entry repeats that config's metrics, and a
file whose copy differs from them is refused, so the two promises cannot drift apart.
Lookup (:func:`find_expectations`): ``<hardware>-<backend>.yaml`` for the
hardware's own label (``h100``), then for its family (``cuda``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MODES = ("within", "at_least", "at_most")
SOURCES = ("measured", "published")
#: ``source: config:<name>``: the targets are config ``<name>``'s of the same file (module docstring)
CONFIG_SOURCE_PREFIX = "config:"


@dataclass(frozen=True)
class Check:
    """The outcome of one metric against its expectation."""

    metric: str
    value: float | None
    target: float
    tolerance: float
    mode: str
    passed: bool
    reason: str  # "" when passed; otherwise why, with the numbers
    seed_spread: float | None = None  # the expectation's seed spread on one build; None: not recorded

    def as_dict(self) -> dict[str, Any]:
        """The check as a result document keeps it; ``seed_spread`` only when the expected file records one."""
        out: dict[str, Any] = {
            "metric": self.metric,
            "value": self.value,
            "target": self.target,
            "tolerance": self.tolerance,
            "mode": self.mode,
            "passed": self.passed,
            "reason": self.reason,
        }
        if self.seed_spread is not None:
            out["seed_spread"] = self.seed_spread
        return out


@dataclass(frozen=True)
class Expectation:
    """One metric's target, tolerance and comparison mode (see the module docstring)."""

    metric: str
    target: float
    tolerance: float
    mode: str = "within"
    seed_spread: float | None = None  # max - min over the seeds on one warm-start build; None: not recorded

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"metric {self.metric!r}: mode must be one of {', '.join(MODES)}, got {self.mode!r}"
            )
        if not math.isfinite(self.target):
            raise ValueError(f"metric {self.metric!r}: target must be a finite number, got {self.target!r}")
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(
                f"metric {self.metric!r}: tolerance must be a number >= 0, got {self.tolerance!r}"
            )
        if self.seed_spread is not None and not (math.isfinite(self.seed_spread) and self.seed_spread >= 0):
            raise ValueError(
                f"metric {self.metric!r}: seed_spread must be a number >= 0 (max - min over the seeds on "
                f"one warm-start build), got {self.seed_spread!r}"
            )

    def check(self, value: float | None) -> Check:
        """Compare ``value`` (None: the run did not report the metric) with this expectation."""
        t, d = self.target, self.tolerance
        if value is None or not math.isfinite(value):
            return Check(
                self.metric, None, t, d, self.mode, False, "metric missing from the run", self.seed_spread
            )
        if self.mode == "within":
            passed = abs(value - t) <= d + 1e-12
            reason = f"{value:.4g} is outside {t:.4g} ± {d:.4g}"
        elif self.mode == "at_least":
            passed = value >= t - d - 1e-12
            reason = f"{value:.4g} is below {t:.4g} - {d:.4g} = {t - d:.4g}"
        else:
            passed = value <= t + d + 1e-12
            reason = f"{value:.4g} is above {t:.4g} + {d:.4g} = {t + d:.4g}"
        return Check(
            self.metric, float(value), t, d, self.mode, passed, "" if passed else reason, self.seed_spread
        )


@dataclass(frozen=True)
class ConfigExpectations:
    """The expectations of one config on one (hardware, backend), and where the targets come from."""

    config: str
    expectations: tuple[Expectation, ...]
    source: str = "measured"
    reference: str = ""
    path: Path | None = None
    train_engine: str | None = None  # the engine the promise is for; None: any
    nodes: int | None = None  # the Ray nodes the run's pools must have used; None: any
    trainer_mode: str | None = None  # the trainer.mode the run must report it ran (ran.mode); None: any

    def check_mode(self, ran: str | None) -> Check | None:
        """A failing Check when the run did not report running the promised ``trainer.mode``, else None."""
        if self.trainer_mode is None or ran == self.trainer_mode:
            return None
        said = f"ran trainer.mode={ran}" if ran else "did not report the trainer.mode it ran"
        reason = f"this expectation is for trainer.mode={self.trainer_mode}; the run {said}"
        return Check("trainer_mode", None, 0.0, 0.0, "within", False, reason)

    def check_engine(self, ran: str | None) -> Check | None:
        """A failing Check when the run's training engine is not the one promised, else None."""
        if self.train_engine is None or ran == self.train_engine:
            return None
        reason = f"this expectation is for the {self.train_engine} engine; the run trained with {ran}"
        return Check("train_engine", None, 0.0, 0.0, "within", False, reason)

    def check_nodes(self, ran: int | None) -> Check | None:
        """The Check of the nodes the run's pools used (``ran``; None: not reported) when ``nodes`` is promised."""
        if self.nodes is None:
            return None
        target = float(self.nodes)
        if ran is None:
            reason = "the run did not report the nodes it used"
            return Check("nodes", None, target, 0.0, "within", False, reason)
        passed = int(ran) == self.nodes
        reason = "" if passed else f"this expectation is for a run on {self.nodes} nodes; the run used {ran}"
        return Check("nodes", float(ran), target, 0.0, "within", passed, reason)


@dataclass(frozen=True)
class ExpectedFile:
    """A parsed ``expected/<hardware>-<backend>.yaml``."""

    hardware: str
    backend: str
    configs: dict[str, ConfigExpectations] = field(default_factory=dict)
    path: Path | None = None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _parse_metric(name: str, spec: Any, where: str) -> Expectation:
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: expected a mapping with target and tolerance, got {spec!r}")
    unknown = sorted(set(spec) - {"target", "tolerance", "mode", "seed_spread", "note"})
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {unknown}; allowed: target, tolerance, mode, seed_spread, note"
        )
    for key in ("target", "tolerance"):
        if key not in spec:
            raise ValueError(f"{where}: missing {key!r}")
    return Expectation(
        metric=name,
        target=_number(spec["target"], f"{where}.target"),
        tolerance=_number(spec["tolerance"], f"{where}.tolerance"),
        mode=str(spec.get("mode", "within")),
        seed_spread=_number(spec["seed_spread"], f"{where}.seed_spread") if "seed_spread" in spec else None,
    )


def parse_expected(data: Any, source: str = "<expected>", path: Path | None = None) -> ExpectedFile:
    """Validate the parsed YAML of an expected file; ValueError naming the key that is wrong."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a mapping with hardware, backend and configs")
    for key in ("hardware", "backend", "configs"):
        if key not in data:
            raise ValueError(f"{source}: missing top-level key {key!r}")
    if not isinstance(data["configs"], Mapping) or not data["configs"]:
        raise ValueError(f"{source}: 'configs' must map config names to their expectations")
    configs: dict[str, ConfigExpectations] = {}
    for config, body in data["configs"].items():
        where = f"{source}: configs.{config}"
        if (
            not isinstance(body, Mapping)
            or not isinstance(body.get("metrics"), Mapping)
            or not body["metrics"]
        ):
            raise ValueError(f"{where}: expected a mapping with a non-empty 'metrics' mapping")
        src = str(body.get("source", "measured"))
        if src not in SOURCES and not src.startswith(CONFIG_SOURCE_PREFIX):
            raise ValueError(
                f"{where}.source: must be one of {', '.join(SOURCES)} or {CONFIG_SOURCE_PREFIX}<name>, got {src!r}"
            )
        expectations = []
        for name, spec in body["metrics"].items():
            try:
                expectations.append(_parse_metric(str(name), spec, f"{where}.metrics.{name}"))
            except ValueError as err:
                if str(err).startswith(where):
                    raise
                raise ValueError(f"{where}.metrics.{name}: {err}") from None
        unknown = sorted(
            set(body) - {"source", "reference", "metrics", "train_engine", "nodes", "trainer_mode"}
        )
        if unknown:
            raise ValueError(
                f"{where}: unknown keys {unknown}; allowed: source, reference, train_engine, nodes, "
                "trainer_mode, metrics"
            )
        mode = body.get("trainer_mode")
        if mode is not None and mode not in ("sync", "async"):
            raise ValueError(f"{where}.trainer_mode: expected sync or async, got {mode!r}")
        engine = body.get("train_engine")
        nodes = body.get("nodes")
        if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
            raise ValueError(f"{where}.nodes: expected a whole number of nodes >= 1, got {nodes!r}")
        configs[str(config)] = ConfigExpectations(
            str(config),
            tuple(expectations),
            src,
            str(body.get("reference", "")),
            path,
            str(engine) if engine is not None else None,
            nodes,
            mode,
        )
    for config, entry in configs.items():
        _check_config_source(entry, configs, f"{source}: configs.{config}")
    return ExpectedFile(str(data["hardware"]), str(data["backend"]), configs, path)


def _check_config_source(
    entry: ConfigExpectations, configs: Mapping[str, ConfigExpectations], where: str
) -> None:
    """A ``source: config:<name>`` entry names another config of the file and repeats its metrics exactly."""
    if not entry.source.startswith(CONFIG_SOURCE_PREFIX):
        return
    name = entry.source[len(CONFIG_SOURCE_PREFIX) :]
    other = configs.get(name)
    if other is None or name == entry.config:
        known = ", ".join(c for c in configs if c != entry.config) or "none"
        raise ValueError(
            f"{where}.source: {entry.source!r} names no other config of this file (it has: {known})"
        )
    if other.source.startswith(CONFIG_SOURCE_PREFIX):
        raise ValueError(
            f"{where}.source: {entry.source!r} is itself carried over ({other.source}); name the measured one"
        )
    if {e.metric: e for e in entry.expectations} != {e.metric: e for e in other.expectations}:
        raise ValueError(
            f"{where}.metrics: the targets carried over from config {name!r} (source {entry.source}) must equal its "
            f"metrics, targets, tolerances, modes and seed spreads; they differ"
        )


def load_expected(path: str | Path) -> ExpectedFile:
    """Read and validate one expected file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err})") from None
    expected = parse_expected(data, str(path), path)
    stem = f"{expected.hardware}-{expected.backend}"
    if path.stem != stem:
        raise ValueError(f"{path}: file name must be {stem}.yaml to match its hardware and backend keys")
    return expected


def find_expectations(
    expected_dir: Path, config: str, hardware_labels: Sequence[str], backend: str
) -> ConfigExpectations | None:
    """The expectations of ``config`` for the first of ``hardware_labels`` that has a file, else None.

    ``hardware_labels`` go from most to least specific, e.g. ``["h100", "cuda"]``.
    """
    for label in hardware_labels:
        path = expected_dir / f"{label}-{backend}.yaml"
        if path.is_file():
            found = load_expected(path).configs.get(config)
            if found is not None:
                return found
    return None


def check_metrics(metrics: Mapping[str, float | None], expectations: ConfigExpectations) -> list[Check]:
    """One :class:`Check` per expectation, in file order."""
    return [e.check(metrics.get(e.metric)) for e in expectations.expectations]


def format_checks(checks: Sequence[Check], title: str = "") -> str:
    """The pass/fail table printed after a run (plain text, fixed columns)."""
    symbol = {"within": "±", "at_least": "≥", "at_most": "≤"}
    lines = [title] if title else []
    header = f"{'metric':32} {'value':>10} {'expected':>18} {'result':>6}"
    lines += [header, "-" * len(header)]
    for c in checks:
        value = "missing" if c.value is None else f"{c.value:.4g}"
        if c.mode == "within":
            expected = f"{c.target:.4g} ± {c.tolerance:.3g}"
        else:
            bound = c.target - c.tolerance if c.mode == "at_least" else c.target + c.tolerance
            expected = f"{symbol[c.mode]} {bound:.4g}"
        lines.append(f"{c.metric:32} {value:>10} {expected:>18} {'PASS' if c.passed else 'FAIL':>6}")
    failed = [c for c in checks if not c.passed]
    if failed:
        lines.append("")
        lines += [f"FAIL {c.metric}: {c.reason}" for c in failed]
    return "\n".join(lines)
