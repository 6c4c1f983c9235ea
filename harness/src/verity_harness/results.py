"""Result files: one JSON document per harness run, committed under ``leaderboards/results``.

Path: ``<results>/<recipe>/<date>-<hardware>-<backend>.json`` for a recipe's ``cpu``
config, ``<date>-<hardware>-<backend>-<config>.json`` for any other config (one file
per day and combination; a later run of the same day replaces it). Contents::

    {
      "schema": 1,
      "recipe": "grpo", "config": "cpu", "recipe_version": "0.1.0",
      "hardware": "cpu-amd-epyc", "family": "cpu", "device_name": "AMD EPYC", "device_count": 1,
      "cpu_isa": "avx512_bf16",             # CPU runs only (verity_harness.machine); null elsewhere
      "backend": "hf",                      # the rollout engine
      "train_engine": "fsdp2",
      "ran": {"actor": "fsdp2", "actor_compute_dtype": "float32", "rollout_dtype": "float32", ...},
      "nodes": 1,                           # Ray nodes the run's pools used (ran.nodes); null if unreported
      "simulated_nodes": null,              # nodes the harness simulated on this machine for the run
                                            # (verity_harness.simulated_cluster); null: none simulated
      "date": "2026-11-22", "finished_at": "2026-11-22T01:02:03+00:00",
      "git_commit": "8faab24...", "git_dirty": false,
      "versions": {"verity": "0.1.0", "torch": "2.13.0+cpu", ...},
      "scores": {"accuracy_after": 0.81, ...},          # verity_harness.run_metrics
      "throughput": {"tokens_per_s": ..., "stage_seconds": {...}, "mfu": null, ...},
      "checks": [{"metric": ..., "passed": true, ...}],  # [] when no expected file applies
      "expected_source": "measured" | "published" | "config:<name>" | null,
      "passed": true | false | null,                     # null: nothing to check against
      "curves": {"step": [...], "reward/mean": [...], "val_step": [...], "val/acc": [...]},
      "overrides": ["actor.optim.lr=0"],
      "mlflow": {"run_id": "...", "tracking_uri": "sqlite:///..."},
      "run_dir": "outputs/harness/grpo/..."
    }
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
REQUIRED_KEYS = ("recipe", "config", "hardware", "backend", "date", "scores", "throughput")


def result_filename(result: Mapping[str, Any]) -> str:
    """``<date>-<hardware>-<backend>[-<config>].json`` (no config suffix for the ``cpu`` config)."""
    stem = f"{result['date']}-{result['hardware']}-{result['backend']}"
    if result["config"] != "cpu":
        stem += f"-{result['config']}"
    return stem + ".json"


def result_path(results_dir: Path, result: Mapping[str, Any]) -> Path:
    return Path(results_dir) / str(result["recipe"]) / result_filename(result)


def _clean(node: Any) -> Any:
    if isinstance(node, Mapping):
        return {str(k): _clean(v) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [_clean(v) for v in node]
    if isinstance(node, float) and not math.isfinite(node):
        return None
    return node


def validate_result(result: Any, source: str = "<result>") -> dict[str, Any]:
    """Check a result document's required keys and types; ValueError naming what is wrong."""
    if not isinstance(result, Mapping):
        raise ValueError(f"{source}: a result must be a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in result]
    if missing:
        raise ValueError(f"{source}: missing keys {missing}")
    for key in ("scores", "throughput"):
        if not isinstance(result[key], Mapping):
            raise ValueError(f"{source}: {key!r} must be an object")
    if result.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise ValueError(f"{source}: schema {result.get('schema')!r} is not {SCHEMA_VERSION}")
    return dict(result)


def write_result(results_dir: Path, result: Mapping[str, Any]) -> Path:
    """Write ``result`` as pretty JSON at :func:`result_path` and return the path."""
    validate_result(result)
    path = result_path(results_dir, result)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"schema": SCHEMA_VERSION, **_clean(result)}
    path.write_text(json.dumps(body, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return path


def load_result(path: str | Path) -> dict[str, Any]:
    """Read and validate one result file; the dict gains ``"source": <path>``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a result file (a JSON document); it is not text") from None
    result = validate_result(data, str(path))
    result["source"] = str(path)
    return result


def load_results(results_dir: Path) -> list[dict[str, Any]]:
    """Every result file under ``results_dir`` (recursively), oldest first."""
    if not Path(results_dir).is_dir():
        return []
    results = [load_result(p) for p in sorted(Path(results_dir).rglob("*.json"))]
    return sorted(results, key=lambda r: (str(r.get("finished_at") or r["date"]), r["recipe"]))
