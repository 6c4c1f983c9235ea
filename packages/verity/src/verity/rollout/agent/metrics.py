"""Per-step metrics of multi-turn rollouts (the agent loop), from the rows ``generate`` returned.

The trainer's stage ``agent_metrics`` reports them right after ``generate`` when ``rollout.agent.enabled``;
validation reports the same rates on the held-out set under ``val/agent/``:

==============================  ===========================================================
``agent/tool_call_rate``        share of responses that made at least one tool call
``agent/tool_calls_mean``       tool calls per response
``agent/tool_error_rate``       tool calls answered with an error / tool calls (0 with no call)
``agent/tool_errors``           tool calls answered with an error, this step
``agent/tool_errors/<kind>``    the same by kind (``timeout``, ``crash``, ``parse``, ...; see
                                ``verity.rollout.agent.executor``)
``agent/turns_mean``            model turns per response
``agent/tool_tokens_mean``      tool-answer tokens per response (context, not trained)
``agent/stop/<reason>``         share of responses that ended by ``answer``, ``max_turns``, ``budget``
``agent/tool_wait_s_mean``      seconds a response waited for its tool answers (queue included),
                                summed over its turns, mean over responses
``agent/tool_queue_s_mean``     of which its calls waited for a free tool worker (the caps)
``agent/engine_busy_fraction``  share of the rollout's wall time the engine was decoding requests
                                (mean over the rollout workers' generate calls, by rows)
``agent/requests_in_flight_mean``  requests the engine held per decode step (mean, by rows)
``agent/requests_in_flight_max``   most requests the engine held at one step
==============================  ===========================================================
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

__all__ = ["agent_batch_metrics", "merge_validation_counts", "validation_agent_metrics"]


def agent_batch_metrics(batch: Any, prefix: str = "agent/") -> dict[str, float]:
    """The metrics of the module docstring for one batch of multi-turn rollouts (empty without them)."""
    keys = batch.keys() if hasattr(batch, "keys") else ()
    if "tool_calls" not in keys:
        return {}
    calls = batch["tool_calls"].float()
    errors = batch["tool_errors"].float()
    total_calls = float(calls.sum())
    out = {
        f"{prefix}tool_call_rate": float((calls > 0).float().mean()),
        f"{prefix}tool_calls_mean": float(calls.mean()),
        f"{prefix}tool_error_rate": float(errors.sum()) / total_calls if total_calls else 0.0,
        f"{prefix}tool_errors": float(errors.sum()),
        f"{prefix}turns_mean": float(batch["num_turns"].float().mean()),
    }
    if "tool_tokens" in keys:
        out[f"{prefix}tool_tokens_mean"] = float(batch["tool_tokens"].float().mean())
    elif "attention_mask" in getattr(batch, "tensors", {}) and "response_mask" in keys:
        width = batch["response_mask"].shape[1]
        tool_tokens = batch["attention_mask"][:, -width:].float() - batch["response_mask"].float()
        out[f"{prefix}tool_tokens_mean"] = float(tool_tokens.sum(-1).mean())
    for key, name in (("tool_wait_s", "tool_wait_s_mean"), ("tool_queue_s", "tool_queue_s_mean")):
        if key in keys:
            out[f"{prefix}{name}"] = float(batch[key].float().mean())
    for key, name in (
        ("agent_engine_busy_fraction", "engine_busy_fraction"),
        ("agent_requests_in_flight_mean", "requests_in_flight_mean"),
    ):
        if key in keys:
            out[f"{prefix}{name}"] = float(batch[key].float().mean())
    if "agent_requests_in_flight_max" in keys:
        out[f"{prefix}requests_in_flight_max"] = float(batch["agent_requests_in_flight_max"].float().max())
    records = batch["trajectory"] if "trajectory" in getattr(batch, "non_tensors", {}) else []
    kinds: Counter = Counter()
    stops: Counter = Counter()
    for record in records:
        kinds.update(record.get("error_kinds", {}))
        stops[record.get("stop")] += 1
    for kind, count in sorted(kinds.items()):
        out[f"{prefix}tool_errors/{kind}"] = float(count)
    for reason, count in sorted(stops.items(), key=lambda item: str(item[0])):
        out[f"{prefix}stop/{reason}"] = count / max(len(records), 1)
    return out


def merge_validation_counts(totals: dict[str, float], batch: Any) -> None:
    """Accumulate the held-out counts behind ``val/agent/*`` (responses, with-call, calls, errors)."""
    keys = batch.keys() if hasattr(batch, "keys") else ()
    if "tool_calls" not in keys:
        return
    calls = batch["tool_calls"].float()
    totals["responses"] = totals.get("responses", 0.0) + float(calls.numel())
    totals["with_call"] = totals.get("with_call", 0.0) + float((calls > 0).sum())
    totals["calls"] = totals.get("calls", 0.0) + float(calls.sum())
    totals["errors"] = totals.get("errors", 0.0) + float(torch.as_tensor(batch["tool_errors"]).float().sum())


def validation_agent_metrics(totals: dict[str, float]) -> dict[str, float]:
    """``val/agent/tool_call_rate``, ``val/agent/tool_calls_mean``, ``val/agent/tool_error_rate``."""
    if not totals.get("responses"):
        return {}
    return {
        "val/agent/tool_call_rate": totals["with_call"] / totals["responses"],
        "val/agent/tool_calls_mean": totals["calls"] / totals["responses"],
        "val/agent/tool_error_rate": totals["errors"] / totals["calls"] if totals["calls"] else 0.0,
    }
