"""The one RL loop: for each step, run the stages in order, time them, log the metrics.

The loop knows nothing of a particular algorithm: the stages chosen from the
config (:func:`verity.trainer.stage_plan.build_stage_plan`) carry that. It evaluates
held-out accuracy before training, every ``trainer.val_every`` steps and at the end
(:mod:`verity.evaluation.validation`), and hands every step's metrics to its hooks.

A stage may leave no rows (a filter that kept no prompt group): the step then ends
there, without the remaining stages (no update), and logs ``train/step_skipped = 1``
with the metrics the stages reported so far.

What a run wires around the loop is passed at construction, by name: the stages (the run's
stage plan, :mod:`verity.trainer.stage_plan`, built once by the caller), every role's handle
(typed in :mod:`verity.trainer.role_handles`), the :class:`RunHooks` (tracker, console,
step-end hooks, stage time limit) and the :class:`RunStart` of a run restored from a
checkpoint. :mod:`verity.launch.recovery` builds the last two for a real run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verity.batch import Batch
from verity.batch.transport import DRIVER_TRANSFERS, resident_row_tokens
from verity.config.schema import VerityConfig
from verity.evaluation.validation import run_validation
from verity.testing.slow_stage import SLOWED, slow_down
from verity.trainer.role_handles import StepEndHook
from verity.trainer.stage_guard import StageGuard
from verity.trainer.stages import Stage, StepContext

# ---------------------------------------------------------------- a step's metrics
# Names follow verity.tracking.names: reward/*, acc/*, response_length/* (tokens), actor/*,
# timing/* (seconds), perf/*.


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` where ``mask`` is 1 (0.0 when the mask is empty)."""
    total = mask.sum()
    return float((values * mask).sum() / total) if total > 0 else 0.0


def real_tokens(batch: Batch) -> torch.Tensor:
    """``[B]`` real (attended) tokens of each row, prompt and response, whether or not its rows are resident."""
    if "attention_mask" in batch.tensor_keys():
        return batch["attention_mask"].sum(-1)
    tokens = resident_row_tokens(batch)
    if tokens is None:
        raise KeyError("the batch has no attention_mask and its resident rows do not record their token counts")
    return tokens


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Reward, accuracy, length, entropy and KL statistics of one RL batch.

    Uses ``scores [B]``, ``response_mask [B, R]`` and, when present, ``acc [B]``,
    ``entropy``, ``old_logprobs``, ``ref_logprobs``, ``advantages`` ``[B, R]``.
    """
    mask = batch["response_mask"].float()
    lengths = mask.sum(-1)
    width = mask.shape[1]
    scores = batch["scores"].float()
    out = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "reward/max": float(scores.max()),
        "reward/min": float(scores.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= width).float().mean()),
    }
    if "acc" in batch:
        out["acc/mean"] = float(batch["acc"].float().mean())
    if "entropy" in batch:
        out["actor/entropy"] = masked_mean(batch["entropy"], mask)
    if "ref_logprobs" in batch and "old_logprobs" in batch:
        out["actor/kl"] = masked_mean(batch["old_logprobs"] - batch["ref_logprobs"], mask)
    if "advantages" in batch:
        out["critic/advantages_mean"] = masked_mean(batch["advantages"], mask)
    if "group" in batch:
        out["reward/groups_all_equal"] = _fraction_of_constant_groups(batch["group"], scores)
    return out


def _fraction_of_constant_groups(group: torch.Tensor, scores: torch.Tensor) -> float:
    """Fraction of prompt groups whose samples all got the same score (no learning signal)."""
    _, inverse = torch.unique(group, return_inverse=True)
    n = int(inverse.max()) + 1
    hi = torch.full((n,), -torch.inf).scatter_reduce(0, inverse, scores, "amax")
    lo = torch.full((n,), torch.inf).scatter_reduce(0, inverse, scores, "amin")
    return float((hi == lo).float().mean())


class StageTimer:
    """Wall-clock seconds per named stage of one step: ``timing/<stage>_s``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if SLOWED:  # a planted slowdown (tests, the nightly's --plant-slowdown); empty otherwise
                slow_down(name, time.perf_counter() - start)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out = {f"timing/{name}_s": value for name, value in self.seconds.items()}
        out["timing/step_s"] = sum(self.seconds.values())
        return out


GIB = float(1024**3)


def memory_metrics(groups: Sequence[Any]) -> dict[str, float]:
    """Every worker group's memory peak per role and method since the last call, in GiB.

    ``memory/<role>/<method>_gb``: device memory on an accelerator, the process's resident set on
    a CPU, the largest over the group's ranks; on an accelerator also
    ``memory/<role>/<method>_host_gb``; ``perf/max_memory_gb``: the largest ``_gb`` figure.
    ``groups``: :class:`~verity.controller.WorkerGroup` s (``memory_peaks()``, :mod:`verity.hardware.memory`).
    """
    out: dict[str, float] = {}
    for group in groups:
        for name, (device, host) in group.memory_peaks().items():
            if device is None:
                out[f"memory/{name}_gb"] = host / GIB
            else:
                out[f"memory/{name}_gb"] = device / GIB
                out[f"memory/{name}_host_gb"] = host / GIB
    figures = [value for key, value in out.items() if not key.endswith("_host_gb")]
    if figures:
        out["perf/max_memory_gb"] = max(figures)
    return out


# ---------------------------------------------------------------- the loop


@dataclass
class TrainResult:
    """What a finished run reports (also written to ``summary.json``)."""

    history: list[dict[str, float]] = field(default_factory=list)  # per-step metrics
    validation: list[dict[str, float]] = field(default_factory=list)  # with a "step" key
    wall_seconds: float = 0.0


@dataclass
class RunStart:
    """Where the loop starts: ``step`` RL steps already done and their metrics (0 and empty when fresh)."""

    step: int = 0
    result: TrainResult = field(default_factory=TrainResult)


@dataclass
class RunHooks:
    """What a run hangs around the loop; each is optional.

    Attributes:
        tracker: a :class:`verity.tracking.Tracker`: every step's metrics and every evaluation.
        progress: ``progress(step, metrics)`` after each step (the console line).
        note: ``note(message)``: a line between steps (validation).
        step_end: called in this order as ``hook(step, result)`` after each step
            (``metrics.jsonl``: :mod:`verity.tracking.metrics_file`; checkpoints and SIGTERM:
            :mod:`verity.checkpoint.hooks`).
        stage_guard: the time limit on every stage (:mod:`verity.trainer.stage_guard`).
        step_probes: figures read from the workers once a step: each is called before the step's
            stages (what it answers then is dropped: it ran between steps, in validation or a
            checkpoint) and after them (merged into the step's metrics); a run's: its worker
            groups' memory peaks (:func:`memory_metrics`).
    """

    tracker: Any | None = None
    progress: Callable[[int, dict[str, float]], None] | None = None
    note: Callable[[str], None] | None = None
    step_end: Sequence[StepEndHook] = ()
    stage_guard: StageGuard | None = None
    step_probes: Sequence[Callable[[], dict[str, float]]] = ()


class RLTrainer:
    """Drives the worker groups through ``trainer.total_steps`` RL steps.

    Args:
        cfg: the validated run config.
        stages: the stages of one step, in order (a run's: ``build_stage_plan(cfg).stages``).
        roles: every role's handle by name; ``actor`` is required, ``critic`` when the run has one.
        rewards: a :class:`verity.rewards.RewardManager` (the driver's).
        train_batches: a loader with ``next_batch()`` giving prompt batches (``input_ids``/``attention_mask``/
            ``position_ids`` ``[B, P]`` left-padded, non-tensors ``data_source``,
            ``ground_truth``), ``data.train_batch_size`` prompts each.
        val_batches: a callable returning an iterable of held-out prompt batches.
        kl_controller: for KL in the reward, or ``None``.
        hooks: what the run hangs around the loop (:class:`RunHooks`).
        start: where the loop starts (:class:`RunStart`; a run restored from a checkpoint).
    """

    def __init__(
        self,
        cfg: VerityConfig,
        stages: Sequence[Stage],
        *,
        roles: Mapping[str, Any],
        rewards: Any,
        train_batches: Any,
        val_batches: Any,
        kl_controller: Any | None = None,
        hooks: RunHooks | None = None,
        start: RunStart | None = None,
    ) -> None:
        if "actor" not in roles:
            raise KeyError(f"RLTrainer needs the actor's handle in roles; got {sorted(roles)}")
        self.cfg = cfg
        self.stages = list(stages)
        self.roles = dict(roles)
        self.actor = self.roles["actor"]
        self.rewards = rewards
        self.train_batches = train_batches
        self.val_batches = val_batches
        self.kl_controller = kl_controller
        self.hooks = hooks if hooks is not None else RunHooks()
        self.start = start if start is not None else RunStart()

    def _guard(self, name: str, step: int) -> contextlib.AbstractContextManager:
        guard = self.hooks.stage_guard
        return guard.stage(name, step) if guard is not None else contextlib.nullcontext()

    # ---------------------------------------------------------------- validation
    def validate(self, step: int) -> dict[str, float]:
        """Held-out metrics at ``step`` (:func:`verity.evaluation.validation.run_validation`).

        One response per prompt (``val/acc``, ``val/reward``, ...): greedy, or sampled at
        ``rollout.val_temperature`` when it is > 0 and ``rollout.val_n`` is 1. With
        ``rollout.val_n = k > 1`` also ``k`` samples per prompt: ``val/avg_at_k``,
        ``val/pass_at_k``, ``val/maj_at_k`` (:mod:`verity.evaluation.validation`).
        """
        started = time.perf_counter()
        note, tracker = self.hooks.note, self.hooks.tracker
        if note is not None:
            note(f"validating at step {step}")
        metrics = run_validation(self.cfg, self.actor, self.rewards, self.val_batches, step)
        total = metrics["val/samples"]
        if note is not None:
            seconds = time.perf_counter() - started
            note(f"validation at step {step}: accuracy {metrics['val/acc']:.3f} on {int(total)} prompts ({seconds:.0f}s)")
        if tracker is not None:
            tracker.log_metrics(metrics, step=step)
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
            critic=self.roles.get("critic"),
            roles=dict(self.roles),
            loader=self.train_batches,
        )
        timer = StageTimer()
        DRIVER_TRANSFERS.take()  # what validation or start-up moved is not this step's
        for probe in self.hooks.step_probes:
            probe()  # likewise what the workers measured since the last step
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
        for probe in self.hooks.step_probes:
            metrics.update(probe())
        return metrics

    def fit(self) -> TrainResult:
        """Validate, train ``trainer.total_steps`` steps (validating every ``val_every``), validate."""
        cfg, hooks = self.cfg.trainer, self.hooks
        result = self.start.result
        start = time.perf_counter()
        if cfg.val_before_train and self.start.step == 0:
            with self._guard("validate", 0):
                result.validation.append({"step": 0, **self.validate(0)})
        for step in range(self.start.step + 1, cfg.total_steps + 1):
            prompts = self.train_batches.next_batch()
            metrics = self.step(step, prompts)
            metrics["train/step"] = float(step)
            result.history.append(metrics)
            if hooks.tracker is not None:
                hooks.tracker.log_metrics(metrics, step=step)
            if hooks.progress is not None:
                hooks.progress(step, metrics)
            last = step == cfg.total_steps
            if (cfg.val_every and step % cfg.val_every == 0) or last:
                with self._guard("validate", step):
                    result.validation.append({"step": step, **self.validate(step)})
            for hook in hooks.step_end:
                hook(step, result)
        result.wall_seconds += time.perf_counter() - start
        return result
