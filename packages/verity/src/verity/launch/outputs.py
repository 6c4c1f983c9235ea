"""What a finished run leaves in its output directory.

- ``summary.json``: final and best metrics, ``accuracy_before``/``accuracy_after``
  (held-out greedy accuracy before and after training), with ``rollout.val_n = k > 1``
  also ``avg_at_k_before``/``avg_at_k_after``, ``pass_at_k_before``/``pass_at_k_after``
  and ``val_k`` (the sampled evaluation, :mod:`verity.evaluation.validation`), ``steps``, ``wall_seconds``,
  the config hash, the MLflow run id, ``ran`` (the engines the workers reported
  running: ``{"actor": "fsdp2", "rollout": "hf", "device": "cpu", ...}``),
  ``stage_plan``, ``resumed_from_step`` (the checkpoint's step this invocation
  continued from; null for a fresh run) and ``preset`` (the model preset's name and the
  keys it set, :mod:`verity.config.model_presets`; null without one);
- ``metrics.jsonl``: one JSON object of metrics per step (:mod:`verity.tracking.metrics_file`);
- ``validation.jsonl``: one JSON object per evaluation;
- ``curves.png``: training reward and accuracy per step, held-out accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verity.tracking.metrics_file import MetricsFile
from verity.trainer.loop import TrainResult

BEST_KEYS = ("val/acc", "val/avg_at_k", "reward/mean", "acc/mean")


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def best_metrics(result: TrainResult) -> dict[str, dict[str, float]]:
    """Highest value and its step for each of :data:`BEST_KEYS` seen during the run."""
    best: dict[str, dict[str, float]] = {}
    rows = [(int(v["step"]), v) for v in result.validation]
    rows += [(i + 1, m) for i, m in enumerate(result.history)]
    for step, metrics in rows:
        for key in BEST_KEYS:
            if key in metrics and (key not in best or metrics[key] > best[key]["value"]):
                best[key] = {"value": float(metrics[key]), "step": step}
    return best


def sampled_before_after(result: TrainResult) -> dict[str, float]:
    """``avg_at_k_before/after``, ``pass_at_k_before/after`` and ``val_k`` from the evaluations that have them.

    "before" is the evaluation at step 0 (absent when the run did not evaluate before
    training); "after" the last evaluation. Empty when the run sampled no avg@k.
    """
    rows = [v for v in result.validation if "val/avg_at_k" in v]
    if not rows:
        return {}
    out: dict[str, float] = {"val_k": float(rows[-1]["val/k"])}
    for name in ("avg_at_k", "pass_at_k"):
        if rows[0]["step"] == 0:
            out[f"{name}_before"] = float(rows[0][f"val/{name}"])
        out[f"{name}_after"] = float(rows[-1][f"val/{name}"])
    return out


def plot_curves(result: TrainResult, path: Path) -> None:
    """Reward and accuracy per training step, and held-out accuracy, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [i + 1 for i in range(len(result.history))]
    for key, label in (("reward/mean", "train reward"), ("acc/mean", "train accuracy")):
        values = [m.get(key) for m in result.history]
        if steps and all(v is not None for v in values):
            ax.plot(steps, values, label=label, linewidth=1.2)
    if result.validation:
        ax.plot(
            [v["step"] for v in result.validation],
            [v["val/acc"] for v in result.validation],
            "o-",
            label="held-out accuracy (greedy)",
            linewidth=2,
        )
    ax.set_xlabel("RL step")
    ax.set_ylabel("value")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_run_outputs(
    out_dir: Path,
    result: TrainResult,
    cfg_dict: dict[str, Any],
    cfg_hash: str,
    tracker: Any | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write every output file listed in the module docstring; return the summary dict.

    ``extra``: more summary fields (the run adds ``ran``: what the workers report running).
    """
    from verity.tracking import write_summary

    MetricsFile(out_dir).write(result.history)
    _write_jsonl(result.validation, out_dir / "validation.jsonl")
    (out_dir / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    plot_curves(result, out_dir / "curves.png")
    before = (
        result.validation[0]["val/acc"] if result.validation and result.validation[0]["step"] == 0 else None
    )
    after = result.validation[-1]["val/acc"] if result.validation else None
    sampled = sampled_before_after(result)
    final = dict(result.history[-1]) if result.history else {}
    if result.validation:
        final.update({k: v for k, v in result.validation[-1].items() if k != "step"})
    extra = {
        "accuracy_before": before,
        "accuracy_after": after,
        **sampled,
        "steps": len(result.history),
        "run_id": getattr(tracker, "run_id", None),
        "tracking_uri": getattr(tracker, "tracking_uri", None),
        **(extra or {}),
    }
    path = write_summary(out_dir, final, best_metrics(result), result.wall_seconds, cfg_hash, extra)
    if tracker is not None:
        for name in ("summary.json", "curves.png", "config.json"):
            tracker.log_artifact(out_dir / name)
    return json.loads(path.read_text())
