"""The harness's MLflow side: a shared store for its runs, tags and metrics on each, reading back.

Every ``verity-harness run`` logs into one store (default
``sqlite:///<output root>/mlflow.db``; ``--tracking-uri`` or ``MLFLOW_TRACKING_URI``
for a server), experiment ``verity-harness/<recipe>``. The trainer already logs the
config as params and every step's metrics; the harness adds

- tags: ``harness=1``, ``recipe``, ``recipe.config``, ``hardware``, ``hardware.family``,
  ``device_name``, ``cpu_isa`` (empty off CPU), ``rollout_engine`` (result files call it
  ``backend``), ``train_engine``, ``git_commit``, ``git_dirty``, ``version.<package>``,
  ``harness.passed``, ``date``, ``nodes`` and ``simulated_nodes`` (empty when unknown or
  none) (the trainer's own tag ``backend`` stays the hardware backend, e.g. ``cpu``; the
  rollout engine is ``rollout_engine``);
- metrics ``score/<name>`` and ``throughput/<name>`` at the run's last step;
- the result document as the artifact ``harness_result.json``.

:func:`results_from_mlflow` turns such runs back into result dicts (for the
leaderboard and ``compare``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HARNESS_TAG = "harness"
EXPERIMENT_PREFIX = "verity-harness/"
RESULT_ARTIFACT = "harness_result.json"


def store_uri(output_root: Path) -> str:
    """The harness's tracking URI: ``MLFLOW_TRACKING_URI`` if set, else its SQLite store."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    return env or "sqlite:///" + str(Path(output_root).resolve() / "mlflow.db")


def ensure_experiment(tracking_uri: str, name: str, artifact_root: Path | None) -> str:
    """Create experiment ``name`` (artifacts under ``artifact_root`` for a local store) if missing."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if artifact_root is not None and tracking_uri.startswith("sqlite:"):
        location = (Path(artifact_root).resolve() / "mlartifacts").as_uri()
    return client.create_experiment(name, artifact_location=location)


def run_tags(result: Mapping[str, Any]) -> dict[str, str]:
    """The tags the harness sets on a run (see the module docstring)."""
    tags = {
        HARNESS_TAG: "1",
        "recipe": result["recipe"],
        "recipe.config": result["config"],
        "hardware": result["hardware"],
        "hardware.family": result.get("family", ""),
        "device_name": result.get("device_name", ""),
        "cpu_isa": result.get("cpu_isa") or "",
        "rollout_engine": result["backend"],
        "train_engine": result.get("train_engine", ""),
        "git_commit": result.get("git_commit") or "unknown",
        "git_dirty": str(result.get("git_dirty")),
        "harness.passed": str(result.get("passed")),
        "date": result["date"],
        "nodes": "" if result.get("nodes") is None else result["nodes"],
        "simulated_nodes": result.get("simulated_nodes") or "",
    }
    for package, version in (result.get("versions") or {}).items():
        tags[f"version.{package}"] = str(version)
    return {k: str(v) for k, v in tags.items()}


def log_result(tracking_uri: str, run_id: str, result: Mapping[str, Any], step: int) -> None:
    """Tag the trainer's run, log the harness's score/throughput metrics and the result artifact."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    client = MlflowClient(tracking_uri=tracking_uri)
    metrics = {f"score/{k}": v for k, v in result["scores"].items()}
    t = result["throughput"]
    for key in ("tokens_per_s", "generated_tokens_per_s", "train_tokens_per_s", "step_seconds", "mfu"):
        metrics[f"throughput/{key}"] = t.get(key)
    for stage, seconds in (t.get("stage_seconds") or {}).items():
        metrics[f"throughput/{stage}_s"] = seconds
    now = int(time.time() * 1000)
    entries = [Metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, int | float)]
    tags = [RunTag(k, v) for k, v in run_tags(result).items()]
    client.log_batch(run_id, metrics=entries, tags=tags, synchronous=True)
    with tempfile.TemporaryDirectory(prefix="verity-harness-") as tmp:
        path = Path(tmp) / RESULT_ARTIFACT
        path.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
        client.log_artifact(run_id, str(path))


def _result_from_run(client: Any, run: Any) -> dict[str, Any] | None:
    """Rebuild a result dict from a harness-tagged run: its artifact, else its tags and metrics."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        with tempfile.TemporaryDirectory(prefix="verity-harness-") as tmp:
            local = client.download_artifacts(run.info.run_id, RESULT_ARTIFACT, tmp)
            result = json.loads(Path(local).read_text(encoding="utf-8"))
    except Exception:  # artifact store moved or missing: fall back to tags + metrics
        tags, metrics = run.data.tags, run.data.metrics

        def count(tag: str) -> int | None:
            return int(tags[tag]) if tags.get(tag, "").isdigit() else None

        if "recipe" not in tags:
            return None
        result = {
            "recipe": tags["recipe"],
            "config": tags.get("recipe.config", "?"),
            "hardware": tags.get("hardware", "?"),
            "family": tags.get("hardware.family", ""),
            "device_name": tags.get("device_name", ""),
            "cpu_isa": tags.get("cpu_isa") or None,
            "backend": tags.get("rollout_engine", "?"),
            "date": tags.get("date", ""),
            "git_commit": tags.get("git_commit"),
            "passed": {"True": True, "False": False}.get(tags.get("harness.passed", "")),
            "nodes": count("nodes"),
            "simulated_nodes": count("simulated_nodes"),
            "scores": {k[len("score/") :]: v for k, v in metrics.items() if k.startswith("score/")},
            "throughput": {
                k[len("throughput/") :]: v for k, v in metrics.items() if k.startswith("throughput/")
            },
        }
    result.setdefault("mlflow", {})
    result["mlflow"] = {**result["mlflow"], "run_id": run.info.run_id}
    result["source"] = f"mlflow:{run.info.run_id}"
    return result


def results_from_mlflow(tracking_uri: str) -> list[dict[str, Any]]:
    """Every finished harness run in the store, as result dicts (oldest first)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiments = [
        e.experiment_id for e in client.search_experiments() if e.name.startswith(EXPERIMENT_PREFIX)
    ]
    if not experiments:
        return []
    runs = client.search_runs(
        experiments, filter_string=f"tags.{HARNESS_TAG} = '1' and attributes.status = 'FINISHED'"
    )
    out = [r for r in (_result_from_run(client, run) for run in runs) if r is not None]
    return sorted(out, key=lambda r: str(r.get("finished_at") or r.get("date")))


def find_run(tracking_uri: str, run_id: str) -> dict[str, Any] | None:
    """One harness run by id, as a result dict, or None when the store does not hold it."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        return None
    return _result_from_run(client, run)
