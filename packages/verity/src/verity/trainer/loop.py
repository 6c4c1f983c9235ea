"""The one RL loop: for each step, run the stages in order, time them, log the metrics.

The loop knows nothing of a particular algorithm: the stages chosen from the
config (:func:`verity.trainer.stages.default_stages`) carry that. It evaluates
held-out accuracy (greedy) before training, every ``trainer.val_every`` steps and
at the end, logs everything to MLflow, and writes ``summary.json``.

A stage may leave no rows (a filter that kept no prompt group): the step then ends
there, without the remaining stages (no update), and logs ``train/step_skipped = 1``
with the metrics the stages reported so far.

Everything a run wires in is passed at construction: the role handles (typed in
:mod:`verity.trainer.role_handles`), ``start_step`` and ``result`` of a run restored from
a checkpoint (steps already done, their metrics), the ``step_end`` hooks run in order after
each step (``metrics.jsonl``: :mod:`verity.tracking.metrics_file`; checkpoints and SIGTERM:
:mod:`verity.checkpoint.hooks`) and the ``stage_guard`` that puts a time limit on every
stage (:mod:`verity.trainer.stage_guard`); :mod:`verity.trainer.recovery` builds the last four.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from verity.batch import Batch
from verity.batch.transport import DRIVER_TRANSFERS
from verity.config.schema import VerityConfig
from verity.trainer.evaluation import run_validation
from verity.trainer.metrics import StageTimer, batch_metrics, real_tokens
from verity.trainer.role_handles import ActorHandle, CriticHandle, StepEndHook
from verity.trainer.stage_guard import StageGuard
from verity.trainer.stages import Stage, StepContext


@dataclass
class TrainResult:
    """What a finished run reports (also written to ``summary.json``)."""

    history: list[dict[str, float]] = field(default_factory=list)  # per-step metrics
    validation: list[dict[str, float]] = field(default_factory=list)  # with a "step" key
    wall_seconds: float = 0.0


class RLTrainer:
    """Drives the worker groups through ``trainer.total_steps`` RL steps.

    Args:
        cfg: the validated run config.
        actor: the actor/rollout/reference worker group.
        rewards: a :class:`verity.rewards.RewardManager`.
        train_batches: a loader with ``next_batch()`` giving prompt batches (``input_ids``/``attention_mask``/
            ``position_ids`` ``[B, P]`` left-padded, non-tensors ``data_source``,
            ``ground_truth``), ``data.train_batch_size`` prompts each.
        val_batches: a callable returning an iterable of held-out prompt batches.
        tracker: a :class:`verity.tracking.Tracker` (or ``None``).
        kl_controller: for KL in the reward.
        critic: the critic worker group (``compute_values``, ``update_critic``), or ``None``.
        roles: every role's handle by name (the actor and critic are added from the
            arguments above), for stages that use other roles (``ctx.roles``).
        stages: override the stage list (default: the config's stage plan, plug-in
            planners included, :func:`verity.trainer.stage_plan.build_stage_plan`).
        progress: a callable ``(step, metrics)`` for console progress, or ``None``.
        note: a callable ``(message)`` printing a line between steps (validation), or ``None``.
        start_step: RL steps already done (a run restored from a checkpoint; 0 when fresh).
        result: their metrics and evaluations (default: empty).
        step_end: hooks called in this order as ``hook(step, result)`` after each step.
        stage_guard: the time limit on every stage, or ``None`` (no limit).
    """

    def __init__(
        self,
        cfg: VerityConfig,
        *,
        actor: ActorHandle,
        rewards: Any,
        train_batches: Any,
        val_batches: Any,
        tracker: Any | None = None,
        kl_controller: Any | None = None,
        critic: CriticHandle | None = None,
        roles: dict[str, Any] | None = None,
        stages: list[Stage] | None = None,
        progress: Any | None = None,
        note: Any | None = None,
        start_step: int = 0,
        result: TrainResult | None = None,
        step_end: Sequence[StepEndHook] = (),
        stage_guard: StageGuard | None = None,
    ) -> None:
        self.cfg = cfg
        self.actor = actor
        self.rewards = rewards
        self.train_batches = train_batches
        self.val_batches = val_batches
        self.tracker = tracker
        self.kl_controller = kl_controller
        self.critic = critic
        self.roles = dict(roles or {})
        if stages is None:
            from verity.trainer.stage_plan import build_stage_plan

            stages = build_stage_plan(cfg).stages
        self.stages = stages
        self.progress = progress
        self.note = note
        self.start_step = start_step
        self.result = result if result is not None else TrainResult()
        self.step_end = tuple(step_end)
        self.stage_guard = stage_guard

    def _guard(self, name: str, step: int) -> contextlib.AbstractContextManager:
        return (
            self.stage_guard.stage(name, step) if self.stage_guard is not None else contextlib.nullcontext()
        )

    # ---------------------------------------------------------------- validation
    def validate(self, step: int) -> dict[str, float]:
        """Held-out metrics at ``step`` (:func:`verity.trainer.evaluation.run_validation`).

        One response per prompt (``val/acc``, ``val/reward``, ...): greedy, or sampled at
        ``rollout.val_temperature`` when it is > 0 and ``rollout.val_n`` is 1. With
        ``rollout.val_n = k > 1`` also ``k`` samples per prompt: ``val/avg_at_k``,
        ``val/pass_at_k``, ``val/maj_at_k`` (:mod:`verity.trainer.evaluation`).
        """
        started = time.perf_counter()
        if self.note is not None:
            self.note(f"validating at step {step}")
        metrics = run_validation(self.cfg, self.actor, self.rewards, self.val_batches, step)
        total = metrics["val/samples"]
        if self.note is not None:
            seconds = time.perf_counter() - started
            self.note(
                f"validation at step {step}: accuracy {metrics['val/acc']:.3f} on {int(total)} prompts ({seconds:.0f}s)"
            )
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=step)
        return metrics

    # ------------------------------------------------------------------ training
    def step(self, step: int, prompts: Batch) -> dict[str, float]:
        """Run every stage once on one batch of prompts; returns the step's metrics."""
        ctx = StepContext(
            self.cfg,
            self.actor,
            self.rewards,
            self.kl_controller,
            step=step,
            critic=self.critic,
            roles=dict(self.roles),
            loader=self.train_batches,
        )
        timer = StageTimer()
        DRIVER_TRANSFERS.take()  # what validation or start-up moved is not this step's
        batch = prompts
        for stage in self.stages:
            with timer.stage(stage.name), self._guard(stage.name, step):
                batch = stage.run(ctx, batch)
            if len(batch) == 0:
                # a stage (a filter) left no rows: nothing for the remaining stages to score or train on
                ctx.metrics["train/step_skipped"] = 1.0
                break
        metrics = batch_metrics(batch) if len(batch) else {}
        metrics.update(ctx.metrics)
        metrics.update(timer.metrics())
        tokens = float(real_tokens(batch).sum())
        metrics["perf/total_tokens"] = tokens
        metrics["perf/tokens_per_s"] = tokens / max(metrics["timing/step_s"], 1e-9)
        # a stage that generated more than it kept (e.g. dynamic sampling) reports perf/generated_tokens
        generated = metrics.get("perf/generated_tokens", float(batch["response_mask"].sum()))
        metrics["perf/generated_tokens_per_s"] = generated / max(metrics.get("timing/generate_s", 0.0), 1e-9)
        sent, received = DRIVER_TRANSFERS.take()
        metrics["perf/driver_bytes_sent"] = float(sent)
        metrics["perf/driver_bytes_received"] = float(received)
        return metrics

    def fit(self) -> TrainResult:
        """Validate, train ``trainer.total_steps`` steps (validating every ``val_every``), validate."""
        cfg = self.cfg.trainer
        result = self.result
        start = time.perf_counter()
        if cfg.val_before_train and self.start_step == 0:
            with self._guard("validate", 0):
                result.validation.append({"step": 0, **self.validate(0)})
        for step in range(self.start_step + 1, cfg.total_steps + 1):
            prompts = self.train_batches.next_batch()
            metrics = self.step(step, prompts)
            metrics["train/step"] = float(step)
            result.history.append(metrics)
            if self.tracker is not None:
                self.tracker.log_metrics(metrics, step=step)
            if self.progress is not None:
                self.progress(step, metrics)
            last = step == cfg.total_steps
            if (cfg.val_every and step % cfg.val_every == 0) or last:
                with self._guard("validate", step):
                    result.validation.append({"step": step, **self.validate(step)})
            for hook in self.step_end:
                hook(step, result)
        result.wall_seconds += time.perf_counter() - start
        return result
