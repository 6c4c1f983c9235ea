"""``verity-harness run``: rerun one recipe config, check it, record it.

    outcome = run_recipe("grpo")                                  # config "cpu", this machine
    outcome = run_recipe("ppo", "gsm8k-qwen2.5-0.5b", overrides=["model.path=/models/q"])

Order of work:

1. find the recipe and its config file; detect the machine (or take the one named);
2. compose the config with :func:`verity.config.load_config` — harness settings
   (output directory, the shared MLflow store, a run name) first, the caller's
   overrides after them, so the caller wins; a config that spans several nodes and names
   no cluster (``trainer.nnodes: 2``, no ``trainer.ray_address``) runs on a cluster of that
   many nodes simulated on this machine (:mod:`verity_harness.simulated_cluster`), torn
   down after the run; ``trainer.ray_address=auto`` runs it on a real one instead;
3. train with :func:`verity.launch.run.run_training` (the trainer logs params and
   per-step metrics to MLflow);
4. read the run directory: scores, throughput, curves (:mod:`verity_harness.run_metrics`);
5. compare the scores with ``expected/<hardware>-<backend>.yaml`` of the recipe;
6. tag the MLflow run and log the harness's metrics (:mod:`verity_harness.tracking`),
   write the result file (:mod:`verity_harness.results`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verity_harness.expected import Check, check_metrics, find_expectations, format_checks
from verity_harness.machine import (
    FAMILIES,
    Machine,
    detect_machine,
    device_text,
    git_commit,
    package_versions,
)
from verity_harness.recipes import DEFAULT_CONFIG, Recipe, find_recipe
from verity_harness.results import write_result
from verity_harness.run_metrics import curves, read_jsonl, score_metrics, throughput
from verity_harness.simulated_cluster import SimulatedShape, shape_to_simulate, simulated_cluster
from verity_harness.tracking import EXPERIMENT_PREFIX, ensure_experiment, log_result, store_uri

DEFAULT_OUTPUT_ROOT = Path("outputs/harness")
DEFAULT_RESULTS_DIR = Path("leaderboards/results")
#: where ``verity-harness run`` puts the result of a run with overrides unless ``--results-dir`` says
#: otherwise: a shortened or altered run is not the recipe's, so it stays off the committed leaderboard
SCRATCH_RESULTS_DIR = DEFAULT_OUTPUT_ROOT / "results-scratch"


def results_dir_for(overrides: Sequence[str], asked: Path | None) -> tuple[Path, str | None]:
    """Where a run's result file goes, and why when it is not where the user would look.

    ``asked`` (``--results-dir``) always wins; otherwise a run with overrides goes to
    :data:`SCRATCH_RESULTS_DIR`, a run of the recipe as it is to :data:`DEFAULT_RESULTS_DIR`.
    """
    if asked is not None:
        return Path(asked), None
    if overrides:
        return SCRATCH_RESULTS_DIR, (
            f"the run has overrides ({' '.join(overrides)}), so its result went to {SCRATCH_RESULTS_DIR}/, "
            f"not to the leaderboard's {DEFAULT_RESULTS_DIR}/ (--results-dir {DEFAULT_RESULTS_DIR} puts it there)"
        )
    return DEFAULT_RESULTS_DIR, None


@dataclass
class RunOutcome:
    """A finished harness run: its result document, the checks, where it was written."""

    result: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    result_path: Path | None = None

    @property
    def passed(self) -> bool | None:
        """True/False against the expected file; None when no expected file applies."""
        return self.result.get("passed")


def machine_for(hardware: str | None) -> Machine:
    """The detected machine; ``hardware`` a family (``cpu``) forces that backend, any other name relabels."""
    if hardware is None:
        return detect_machine()
    if hardware in FAMILIES:
        return detect_machine(family=hardware)
    return detect_machine(label=hardware)


def harness_overrides(
    recipe: Recipe, config: str, machine: Machine, run_dir: Path, tracking_uri: str
) -> list[str]:
    """The settings the harness gives every run (the caller's overrides come after these)."""
    out = [
        f"trainer.output_dir={run_dir}",
        f"trainer.tracking_uri={tracking_uri}",
        f"trainer.experiment_name={EXPERIMENT_PREFIX}{recipe.name}",
        f"trainer.run_name={recipe.name}-{config}-{machine.label}",
        f"trainer.device={machine.family}",
    ]
    return out


def actor_compute_dtype(cfg: Any) -> str:
    """The dtype the config asks the actor's matmuls to run in: ``bfloat16`` or ``float32``.

    bf16 where the weights are bf16 (``model.dtype``) or the fsdp2 engine is told to use
    mixed precision; the run's own record (``ran.actor_compute_dtype``) is checked against it.
    """
    actor = getattr(cfg, "actor", None)
    mixed = getattr(actor, "engine", None) == "fsdp2" and getattr(actor.fsdp2, "mixed_precision", None) is True
    model_bf16 = getattr(getattr(cfg, "model", None), "dtype", "float32") == "bfloat16"
    return "bfloat16" if mixed or model_bf16 else "float32"


def with_measured_cpu_peak(machine: Machine, cfg: Any) -> tuple[Machine, str | None]:
    """On CPU, ``machine`` with the matmul peak measured on the threads the actor's workers get.

    Returns ``(machine, source)``: ``source`` says where ``peak_flops`` came from
    (``"spec sheet"`` for known accelerators, the measurement on CPU, None when unknown).
    Measured before the run starts, so the run's own workers do not compete with it, in the
    dtype the actor will compute in (:func:`actor_compute_dtype`).
    """
    if machine.family != "cpu":
        return machine, "spec sheet" if machine.peak_flops else None
    import torch
    from verity.hardware.cpu_peak import measure_matmul_flops

    threads = max(1, round(cfg.trainer.n_workers * cfg.trainer.cpus_per_worker))
    dtype = actor_compute_dtype(cfg)
    peak = measure_matmul_flops(threads, dtype=getattr(torch, dtype))
    source = f"measured: {dtype} 512x512 matmul on {threads} threads, {peak / 1e9:.1f} GFLOP/s"
    return dataclasses.replace(machine, peak_flops=peak), source


def check_peak_dtype(throughput: dict[str, Any], summary: dict[str, Any], measured_dtype: str) -> None:
    """Drop a CPU MFU whose peak was measured in another dtype than the actor ran in (``mfu_note`` says so)."""
    ran = (summary.get("ran") or {}).get("actor_compute_dtype")
    if ran is not None and ran != measured_dtype and throughput.get("mfu") is not None:
        throughput["mfu"] = None
        throughput["mfu_note"] = (
            f"the CPU peak was measured in {measured_dtype} but the actor computed in {ran}: no MFU"
        )


def ran_engine(summary: dict[str, Any], role: str) -> str:
    """The engine the workers reported running for ``role`` (``rollout``, ``actor``), from ``summary.json``.

    A result records what ran, never the config's string; a summary without it cannot be a result.
    """
    ran = summary.get("ran") or {}
    if role not in ran:
        raise ValueError(
            f"summary.json has no record of the {role} engine that ran (summary['ran'] = {ran}); "
            "it was written by a verity older than this harness"
        )
    return str(ran[role])


def ran_nodes(summary: dict[str, Any]) -> int | None:
    """How many Ray nodes the run's pools used (``summary['ran']['nodes']``); None when not reported."""
    value = (summary.get("ran") or {}).get("nodes")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def build_result(
    recipe: Recipe,
    config: str,
    machine: Machine,
    cfg: Any,
    summary: dict[str, Any],
    run_dir: Path,
    overrides: Sequence[str],
    n_params: int | None,
    simulated: SimulatedShape | None = None,
) -> dict[str, Any]:
    """The result document of a finished run (schema in :mod:`verity_harness.results`), without checks.

    ``simulated``: the cluster the harness simulated for the run (None: it ran on a private
    single-node cluster or joined a real one).
    """
    steps = read_jsonl(run_dir / "metrics.jsonl")
    validation = read_jsonl(run_dir / "validation.jsonl")
    commit, dirty = git_commit()
    now = dt.datetime.now(dt.UTC)
    return {
        "recipe": recipe.name,
        "config": config,
        "recipe_version": recipe.version,
        "hardware": machine.label,
        "family": machine.family,
        "device_name": machine.device_name,
        "device_count": machine.device_count,
        "cpu_isa": machine.cpu_isa,  # CPU runs: the widest matrix instruction set (machine.cpu_matmul_isa)
        "backend": ran_engine(summary, "rollout"),
        "train_engine": ran_engine(summary, "actor"),
        "ran": dict(summary.get("ran") or {}),  # everything the workers reported running (dtypes included)
        "nodes": ran_nodes(summary),  # Ray nodes the run's pools used
        "simulated_nodes": simulated.nodes if simulated is not None else None,  # nodes the harness simulated
        "date": now.date().isoformat(),
        "finished_at": now.isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": dirty,
        "versions": package_versions(),
        "scores": score_metrics(summary, steps),
        "throughput": throughput(
            steps,
            ppo_epochs=cfg.actor.ppo_epochs,
            n_params=n_params,
            peak_flops=machine.peak_flops,
            num_devices=cfg.trainer.n_workers if machine.family != "cpu" else 1,
        ),
        "curves": curves(steps, validation),
        "overrides": list(overrides),
        "mlflow": {"run_id": summary.get("run_id"), "tracking_uri": summary.get("tracking_uri")},
        "run_dir": str(run_dir),
    }


def attach_checks(result: dict[str, Any], recipe: Recipe, labels: Sequence[str]) -> list[Check]:
    """Compare ``result['scores']`` with the recipe's expected file; record checks and ``passed``."""
    expectations = find_expectations(recipe.expected_dir, result["config"], labels, result["backend"])
    if expectations is None:
        result.update(checks=[], passed=None, expected_source=None, expected_file=None)
        return []
    checks = check_metrics(result["scores"], expectations)
    wrong_engine = expectations.check_engine(result.get("train_engine"))
    if wrong_engine is not None:
        checks.append(wrong_engine)
    nodes = expectations.check_nodes(result.get("nodes"))
    if nodes is not None:
        checks.append(nodes)
    mode = expectations.check_mode((result.get("ran") or {}).get("mode"))
    if mode is not None:
        checks.append(mode)
    result.update(
        checks=[c.as_dict() for c in checks],
        passed=all(c.passed for c in checks),
        expected_source=expectations.source,
        expected_file=str(expectations.path) if expectations.path else None,
    )
    return checks


def _n_params(tracking_uri: str, run_id: str | None) -> int | None:
    if not run_id:
        return None
    from mlflow import MlflowClient

    params = MlflowClient(tracking_uri=tracking_uri).get_run(run_id).data.params
    # MFU counts what a token computes with: a mixture-of-experts model's active parameters
    value = params.get("model.n_active_params") or params.get("model.n_params")
    return int(value) if value else None


def run_recipe(
    name: str,
    config: str = DEFAULT_CONFIG,
    *,
    hardware: str | None = None,
    overrides: Sequence[str] = (),
    output_root: Path = DEFAULT_OUTPUT_ROOT,
    results_dir: Path | None = DEFAULT_RESULTS_DIR,
    tracking_uri: str | None = None,
) -> RunOutcome:
    """Train recipe ``name`` with ``config``, check it, log it, write its result file (if ``results_dir``)."""
    from verity.config import load_config
    from verity.launch.run import run_training

    recipe = find_recipe(name)
    config_file = recipe.config_path(config)
    machine = machine_for(hardware)
    output_root = Path(output_root)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    run_dir = output_root / recipe.name / f"{config}-{machine.label}-{stamp}"
    uri = tracking_uri or store_uri(output_root)
    ours = harness_overrides(recipe, config, machine, run_dir, uri)
    simulated = shape_to_simulate([*ours, *overrides], config_file, machine.family)
    with simulated_cluster(simulated) as address:
        joined = [] if address is None else [f"trainer.ray_address={address}"]
        cfg = load_config([*ours, *joined, *overrides], config_file=config_file)
        # after the config checks: a refused config (a missing package, say) leaves no store behind
        ensure_experiment(uri, f"{EXPERIMENT_PREFIX}{recipe.name}", output_root)
        machine, peak_source = with_measured_cpu_peak(machine, cfg)
        summary = run_training(cfg)
    run_dir = Path(cfg.trainer.output_dir)
    result = build_result(
        recipe,
        config,
        machine,
        cfg,
        summary,
        run_dir,
        overrides,
        _n_params(uri, summary.get("run_id")),
        simulated,
    )
    result["throughput"]["peak_flops_source"] = peak_source
    if machine.family == "cpu":
        check_peak_dtype(result["throughput"], summary, actor_compute_dtype(cfg))
    checks = attach_checks(result, recipe, machine.lookup_labels)
    if summary.get("run_id"):
        log_result(
            summary.get("tracking_uri") or uri, summary["run_id"], result, int(summary.get("steps") or 0)
        )
    (run_dir / "harness_result.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    path = write_result(Path(results_dir), result) if results_dir is not None else None
    return RunOutcome(result, checks, path)


def format_outcome(outcome: RunOutcome) -> str:
    """The report printed after ``verity-harness run``: checks, throughput, where things went."""
    r = outcome.result
    title = f"{r['recipe']} / {r['config']} on {r['hardware']} ({device_text(r)}), rollout {r['backend']}"
    if r.get("nodes") is not None and (r["nodes"] > 1 or r.get("simulated_nodes")):
        title += f", {nodes_text(r)}"
    lines = []
    if outcome.checks:
        lines.append(format_checks(outcome.checks, title=f"{title} — expected ({r['expected_source']})"))
    else:
        lines.append(f"{title}\nno expected file for this (config, hardware, backend): nothing checked")
    lines.append("")
    lines.append(format_throughput(r["throughput"]))
    lines.append("")
    if outcome.result_path is not None:
        lines.append(f"result:  {outcome.result_path}")
    lines.append(f"run dir: {r['run_dir']}")
    mlflow = r.get("mlflow") or {}
    if mlflow.get("run_id"):
        lines.append(f"MLflow:  run {mlflow['run_id']} in {mlflow.get('tracking_uri')}")
    verdict = {True: "PASS", False: "FAIL", None: "UNCHECKED"}[outcome.passed]
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)


def nodes_text(result: dict[str, Any]) -> str:
    """``2 nodes (simulated on this machine)`` / ``2 nodes``: the nodes a run's pools used, simulated or not."""
    nodes = result.get("nodes")
    text = f"{nodes} node" + ("" if nodes == 1 else "s")
    simulated = result.get("simulated_nodes")
    if simulated:
        text += " (simulated on this machine)" if simulated == nodes else f" (of {simulated} simulated here)"
    return text


def format_throughput(t: dict[str, Any]) -> str:
    """Throughput lines: tokens/s, per-stage seconds, MFU (or why there is none)."""

    def num(value: Any, spec: str = ".0f") -> str:
        return "n/a" if value is None else format(value, spec)

    mfu = t.get("mfu")
    mfu_text = (
        f"{mfu:.2%}"
        if mfu is not None
        else f"n/a ({t.get('mfu_note') or 'peak FLOP/s of this device unknown'})"
    )
    if mfu is not None and t.get("peak_flops_source"):
        mfu_text += f" (peak {t['peak_flops_source']})"
    lines = [
        f"throughput over {t.get('measured_steps')} steps (first step left out):",
        f"  tokens/s (step)        {num(t.get('tokens_per_s'))}",
        f"  generated tokens/s     {num(t.get('generated_tokens_per_s'))}",
        f"  train tokens/s         {num(t.get('train_tokens_per_s'))}",
        f"  seconds per step       {num(t.get('step_seconds'), '.2f')}",
        f"  MFU (actor update)     {mfu_text}",
        "  seconds per stage      "
        + ", ".join(f"{k} {v:.2f}" for k, v in (t.get("stage_seconds") or {}).items()),
    ]
    return "\n".join(lines)
