"""Gathering the runs a leaderboard shows: committed result files plus the harness's MLflow runs.

A run found in both (same MLflow run id) is shown once, from its result file.
Each run gets a display ``label`` ``<hardware>/<backend>[/<engine>][/<config>]`` and a
``key`` ``(recipe, config, hardware, backend, train engine)``: the "latest" tables keep
the newest run per key, so runs that differ only in their engines stand side by side.

A CPU result written before CPU hardware labels named the processor reads ``"hardware":
"cpu"``; it is shown under its processor's label (:func:`verity_harness.machine.cpu_label`
of its ``device_name``), so that a later run on the same processor replaces it in the
"latest" tables and a run on another processor stands beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from verity_harness.machine import cpu_label
from verity_harness.results import load_results

logger = logging.getLogger(__name__)


def hardware_of(run: Mapping[str, Any]) -> str:
    """The run's hardware label; a CPU run labelled just ``cpu`` gets its processor's (module docstring)."""
    hardware = str(run["hardware"])
    if hardware == "cpu" and run.get("family", "cpu") == "cpu" and run.get("device_name"):
        return cpu_label(str(run["device_name"]))
    return hardware


def run_key(run: Mapping[str, Any]) -> tuple[str, str, str, str, str]:
    engine = str(run.get("train_engine") or "fsdp2")
    return (str(run["recipe"]), str(run["config"]), str(run["hardware"]), str(run["backend"]), engine)


def run_label(run: Mapping[str, Any]) -> str:
    label = f"{run['hardware']}/{run['backend']}"
    engine = run.get("train_engine")
    if engine and engine != "fsdp2":
        label = f"{label}/{engine}"
    return label if run["config"] == "cpu" else f"{label}/{run['config']}"


def sort_time(run: Mapping[str, Any]) -> str:
    return str(run.get("finished_at") or run.get("date") or "")


def collect_runs(results_dir: Path | None, tracking_uris: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Result files under ``results_dir`` and harness runs in each MLflow store, oldest first."""
    runs = load_results(results_dir) if results_dir is not None else []
    seen = {(r.get("mlflow") or {}).get("run_id") for r in runs} - {None}
    for uri in tracking_uris:
        from verity_harness.tracking import results_from_mlflow

        try:
            found = results_from_mlflow(uri)
        except Exception as err:  # an unreadable store must not stop the pages from being built
            logger.warning("skipping MLflow store %s: %s", uri, err)
            continue
        for run in found:
            run_id = (run.get("mlflow") or {}).get("run_id")
            if run_id not in seen:
                runs.append(run)
                seen.add(run_id)
    for run in runs:
        run["hardware"] = hardware_of(run)
        run["label"] = run_label(run)
    return sorted(runs, key=sort_time)


def latest_per_key(runs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The newest run of each (recipe, config, hardware, backend, train engine, overrides), ordered by key.

    A run with overrides (a shortened ``trainer.total_steps=5``) is not the recipe as it is: it
    stands beside the recipe's own run, its overrides shown, instead of replacing it.
    """
    latest: dict[tuple[Any, ...], Mapping[str, Any]] = {}
    for run in sorted(runs, key=sort_time):
        latest[(*run_key(run), tuple(str(o) for o in run.get("overrides") or ()))] = run
    return [latest[k] for k in sorted(latest)]


def by_recipe(runs: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        grouped.setdefault(str(run["recipe"]), []).append(run)
    return dict(sorted(grouped.items()))
