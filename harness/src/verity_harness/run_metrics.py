"""The numbers the harness reads from a finished run directory.

A run directory (``trainer.output_dir``) holds ``summary.json``, ``metrics.jsonl``
(one row per RL step) and ``validation.jsonl``. From them:

**Scores** (:func:`score_metrics`): every numeric ``final_metrics`` entry (the last
step's training metrics and the last evaluation's ``val/*``), plus

- ``accuracy_before`` / ``accuracy_after``: held-out greedy accuracy before the first
  and after the last step (0..1);
- ``accuracy_gain = accuracy_after - accuracy_before``;
- with sampled evaluation (``rollout.val_n = k > 1``): ``avg_at_k_before`` /
  ``avg_at_k_after`` (mean correctness of the k samples per held-out prompt, avg@k),
  ``avg_at_k_gain``, ``pass_at_k_before`` / ``pass_at_k_after`` (pass@k) and ``val_k``
  (the k); ``accuracy_*`` stay the greedy ones;
- ``reward/mean_last10``: mean of ``reward/mean`` over the last 10 steps (less noisy
  than the last step alone);
- ``steps``, ``wall_seconds``.

**Throughput** (:func:`throughput`), over the steps after the first (step 1 pays
for start-up and is left out when there is more than one step):

- ``tokens_per_s``: prompt + response tokens (padding excluded) per second of step time;
- ``generated_tokens_per_s``: response tokens per second of the ``generate`` stage;
- ``train_tokens_per_s``: tokens through the actor's forward + backward per second
  of actor training, ``sum(actor_trained_tokens) / sum(update_actor_s - weight_sync_s)``
  (``perf/actor_trained_tokens``: what the update actually ran, rows skipped for a zero
  advantage left out; runs that do not log it count ``total_tokens * ppo_epochs``);
- ``stage_seconds``: mean seconds per step of each stage (``timing/<stage>_s``);
- ``max_memory_gb``: the busiest worker's memory peak over those steps (``perf/max_memory_gb``,
  GiB: device memory on an accelerator, the resident set on a CPU; ``docs/hardware.md``);
- ``mfu``: ``6 * n_params * train_tokens_per_s / (peak_flops * devices)``
  (:func:`verity.hardware.mfu`), ``None`` where the device's peak is unknown. On CPU the
  harness measures the peak (float32 matmuls on the actor's threads,
  :mod:`verity.hardware.cpu_peak`) and counts the CPU as one device; the result's
  ``peak_flops_source`` says which. An MFU above 100% (the peak was measured while the
  machine was busy, then the run went faster) is not reported: ``mfu`` is ``None`` and
  ``mfu_note`` says why.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

LAST_K = 10
SAMPLED_SCORES = ("avg_at_k_before", "avg_at_k_after", "pass_at_k_before", "pass_at_k_after", "val_k")
"""Summary fields of a run with sampled held-out evaluation (``rollout.val_n > 1``), kept as scores."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file ([] when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def score_metrics(summary: Mapping[str, Any], steps: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The run's scores (see the module docstring), by name."""
    out: dict[str, float] = {}
    for key, value in (summary.get("final_metrics") or {}).items():
        number = _finite(value)
        if number is not None:
            out[key] = number
    for key in ("accuracy_before", "accuracy_after", *SAMPLED_SCORES, "steps", "wall_seconds"):
        number = _finite(summary.get(key))
        if number is not None:
            out[key] = number
    for name in ("accuracy", "avg_at_k"):
        if f"{name}_before" in out and f"{name}_after" in out:
            out[f"{name}_gain"] = out[f"{name}_after"] - out[f"{name}_before"]
    rewards = [v for v in (_finite(row.get("reward/mean")) for row in steps[-LAST_K:]) if v is not None]
    if rewards:
        out[f"reward/mean_last{LAST_K}"] = sum(rewards) / len(rewards)
    return out


def _measured_steps(steps: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    return steps[1:] if len(steps) > 1 else steps


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def throughput(
    steps: Sequence[Mapping[str, Any]],
    *,
    ppo_epochs: int = 1,
    n_params: int | None = None,
    peak_flops: float | None = None,
    num_devices: int = 1,
) -> dict[str, Any]:
    """Throughput figures of a run from its per-step metrics (see the module docstring).

    ``peak_flops`` is one device's dense peak in FLOP/s (None when unknown);
    ``num_devices`` the devices the actor trained on.
    """
    from verity.hardware import mfu

    rows = _measured_steps(steps)

    def column(key: str) -> list[float]:
        return [v for v in (_finite(row.get(key)) for row in rows) if v is not None]

    stage_seconds: dict[str, float] = {}
    for row in rows:
        for key in row:
            if key.startswith("timing/") and key.endswith("_s") and key != "timing/step_s":
                stage_seconds.setdefault(key[len("timing/") : -2], 0.0)
    for stage in list(stage_seconds):
        stage_seconds[stage] = _mean(column(f"timing/{stage}_s")) or 0.0

    trained = column("perf/actor_trained_tokens")
    if trained and len(trained) == len(rows):
        train_tokens = sum(trained)
    else:
        train_tokens = sum(column("perf/total_tokens")) * max(1, ppo_epochs)
    train_seconds = sum(column("timing/update_actor_s")) - sum(column("timing/weight_sync_s"))
    train_tps = train_tokens / train_seconds if train_tokens > 0 and train_seconds > 0 else None
    utilisation = None
    mfu_note = None
    if train_tps is not None and n_params and peak_flops:
        utilisation = mfu(train_tps, n_params, peak_flops, num_devices=num_devices)
        if utilisation > 1.0:
            # the training ran faster than the "peak": the peak was measured while other
            # work shared the device (a busy CPU), so the ratio means nothing
            mfu_note = (
                f"not reported: the update reached {utilisation:.0%} of the peak measured before the run "
                f"({peak_flops / 1e9:.1f} GFLOP/s), so that peak was measured under load"
            )
            utilisation = None
    return {
        "tokens_per_s": _mean(column("perf/tokens_per_s")),
        "generated_tokens_per_s": _mean(column("perf/generated_tokens_per_s")),
        "train_tokens_per_s": train_tps,
        "step_seconds": _mean(column("timing/step_s")),
        # the busiest worker's peak over the measured steps (GiB; None for a run that recorded none)
        "max_memory_gb": max(column("perf/max_memory_gb"), default=None),
        "stage_seconds": dict(sorted(stage_seconds.items())),
        "mfu": utilisation,
        "mfu_note": mfu_note,
        "peak_flops": peak_flops,
        "n_params": n_params,
        "num_devices": num_devices,
        "measured_steps": len(rows),
    }


def curves(steps: Sequence[Mapping[str, Any]], validation: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """Per-step training curves and the held-out accuracy curve, for plots."""
    out: dict[str, list] = {"step": list(range(1, len(steps) + 1))}
    for key in ("reward/mean", "acc/mean", "perf/tokens_per_s"):
        values = [_finite(row.get(key)) for row in steps]
        if any(v is not None for v in values):
            out[key] = values
    out["val_step"] = [int(row["step"]) for row in validation if "step" in row]
    out["val/acc"] = [_finite(row.get("val/acc")) for row in validation if "step" in row]
    if any("val/avg_at_k" in row for row in validation):
        out["val/avg_at_k"] = [_finite(row.get("val/avg_at_k")) for row in validation if "step" in row]
    return out
