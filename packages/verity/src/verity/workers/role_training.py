"""What the trained roles (actor, critic, a plug-in's) share: their engine, optimizer and update loop.

A trained role's config section (``actor``, ``critic``, ...) names its ``engine``
(built through :mod:`verity.engines.registry`) and has its own ``optim``
(:class:`~verity.engines.optim.OptimConfig`), ``ppo_mini_batch_size`` (prompts per
optimizer step) and ``ppo_epochs``. :func:`update_epochs` is every trained role's update
of one RL step: epochs, mini-batches, and in each the engine's micro-batch loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from verity.batch import Batch
from verity.config.derived import rollout_dtype_name
from verity.config.schema import VerityConfig
from verity.engines import EngineBuildContext, OptimConfig, TrainingEngine, build_training_engine
from verity.engines.base import with_step_time
from verity.engines.model_source import ModelSource


class TrainedRole(Protocol):
    """The config fields of a role trained by mini-batch epochs (``cfg.actor``, ``cfg.critic``)."""

    engine: str
    optim: OptimConfig
    ppo_mini_batch_size: int
    ppo_epochs: int


def role_device(backend: Any, local_rank: int) -> torch.device:
    """The device a role's worker computes on.

    Ray gives each GPU worker only its own device, visible as index 0; without that
    isolation (several devices visible to one process) the worker's local rank picks
    its device. ``backend`` is a :mod:`verity.hardware` backend.
    """
    return backend.device(0 if backend.device_count() <= 1 else local_rank)


def process_group_backend(cfg: VerityConfig, backend: Any) -> str:
    """The ``torch.distributed`` backend a role's workers form their group with.

    ``backend.dist_backend`` (``nccl`` on CUDA), plus gloo for host tensors
    (``cpu:gloo,cuda:nccl``) when an FSDP2 role of the run offloads its parameters: their
    shards are then host tensors, and the gradient norm, weight gathers and checkpoint
    reads issue collectives on them (:func:`verity.engines.offload.host_collectives_backend`).
    ``backend`` is a :mod:`verity.hardware` backend.
    """
    from verity.engines.offload import host_collectives_backend

    offloads = (
        cfg.actor.fsdp2.offload_params or cfg.actor.reference.offload_params or cfg.critic.fsdp2.offload_params
    )
    if not offloads:
        return backend.dist_backend
    return host_collectives_backend(backend.dist_backend, backend.device_type)


def optimizer_steps_per_rl_step(cfg: VerityConfig, role: TrainedRole) -> int:
    """Optimizer steps ``role`` takes per RL step: mini-batches (prompts) x epochs."""
    return (cfg.data.train_batch_size // role.ppo_mini_batch_size) * role.ppo_epochs


def role_model_dtype(cfg: VerityConfig) -> torch.dtype:
    """The dtype roles load their weights in (``model.dtype``)."""
    return torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32


def rollout_dtype(cfg: VerityConfig, device: torch.device) -> torch.dtype:
    """The dtype the rollout serves the policy in on ``device``: ``rollout.dtype``; when null, bfloat16
    on an accelerator and ``model.dtype`` on a CPU (:func:`verity.config.derived.rollout_dtype_name`)."""
    name = rollout_dtype_name(cfg, on_accelerator=device.type != "cpu")
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def build_role_engine(
    role_name: str,
    source: ModelSource,
    cfg: VerityConfig,
    role: TrainedRole,
    device: torch.device,
) -> TrainingEngine:
    """The engine named ``role.engine`` training the model ``source`` names on ``device`` with ``role.optim``.

    The engine builds the model from ``source``: whole (``load_whole``), or empty and
    filled with this rank's shard when it shards it (:mod:`verity.engines.streamed_loading`).
    The LR schedule spans ``optimizer_steps_per_rl_step x trainer.total_steps``
    optimizer steps; ``model.gradient_checkpointing`` applies; the engine's own
    settings are the role section's field named after it (``actor.fsdp2``), if any;
    LoRA adapters are the section's ``lora`` (``actor.lora``), if it has one.
    """
    total = optimizer_steps_per_rl_step(cfg, role) * max(1, cfg.trainer.total_steps)
    ctx = EngineBuildContext(
        role=role_name,
        load_model=source.load_whole,
        model_path=source.path,
        device=device,
        source=source,
        optim=role.optim,
        total_steps=total,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        options=getattr(role, role.engine, None),
        lora=getattr(role, "lora", None),
        seed=cfg.trainer.seed,
        cfg=cfg,
    )
    return build_training_engine(role.engine, ctx)


@dataclass(frozen=True)
class UpdateSchedule:
    """How one RL step's update walks a rank's rows: ``epochs`` passes, one optimizer step per
    ``rows_per_mini_batch`` consecutive rows, ``micro_batch_size`` rows per forward + backward."""

    epochs: int
    rows_per_mini_batch: int
    micro_batch_size: int


@dataclass
class StepSums:
    """The metrics of an update's optimizer steps, summed, and how many steps there were."""

    sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0

    def add(self, metrics: dict[str, Any]) -> None:
        """Add one optimizer step's metrics (floats)."""
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.steps += 1

    def means(self, prefix: str, renamed: dict[str, str] | None = None) -> dict[str, float]:
        """Each metric's mean over the steps, as ``<prefix>/<name>`` (a name already under ``prefix`` or
        under ``moe/``, the router's own section, kept), plus ``<prefix>/optimizer_steps``; ``renamed`` maps
        an engine metric to the name reported."""
        renamed = renamed or {}
        out = {
            key if key.startswith((f"{prefix}/", "moe/")) else f"{prefix}/{renamed.get(key, key)}": value / self.steps
            for key, value in self.sums.items()
        }
        out[f"{prefix}/optimizer_steps"] = float(self.steps)
        return out


def mini_batches(batch: Batch, rows_per_mini: int) -> Iterator[tuple[slice, Batch]]:
    """Consecutive mini-batches of ``rows_per_mini`` rows of ``batch`` (the last may be shorter), with their rows.

    The trailing ``batch.pad_rows`` rows (padding that ``Batch.split`` added so that the
    rows divide over the ranks) stay marked as padding in the mini-batches that hold
    them, so the engine leaves them out of the loss and its counts.
    """
    size = len(batch)
    real = size - int(getattr(batch, "pad_rows", 0) or 0)
    for start in range(0, size, rows_per_mini):
        stop = min(start + rows_per_mini, size)
        mini = batch.index(slice(start, stop))
        mini.pad_rows = max(0, stop - max(start, real))
        yield slice(start, stop), mini


def update_epochs(
    engine: TrainingEngine,
    batch: Batch,
    loss_fn: Any,
    schedule: UpdateSchedule,
    *,
    values: bool = False,
    train_rows: torch.Tensor | None = None,
    **pass_options: Any,
) -> StepSums:
    """One RL step's update of a trained role on this rank's rows, top to bottom::

        for each of schedule.epochs passes over the rows:
            for each mini-batch of schedule.rows_per_mini_batch rows:      one optimizer step
                engine.forward_backward(mini, loss_fn, micro_batch_size)   micro-batches: forward,
                                                                           loss, backward
                engine.optimizer_step()                                    clip, AdamW, LR schedule
        engine.update_finished()                                           the phase is over (offload)

    ``loss_fn`` follows the engine's gradient contract (:mod:`verity.engines.base`): a policy's
    ``(micro, logprobs, entropy, agg)``, or with ``values`` a value model's ``(micro, values, agg)``
    (``engine.forward_backward_values``). ``train_rows`` (``[B]`` bool over ``batch``, optional):
    each mini-batch runs forward + backward over its share of these rows only
    (:mod:`verity.engines.train_rows`). ``pass_options`` go to every ``forward_backward``
    (``temperature``, ``entropy_requires_grad``). Every step's metrics gain ``step_seconds``
    and ``tokens_per_s``; returns their sums over the steps.
    """
    steps = StepSums()
    for _epoch in range(schedule.epochs):
        for rows, mini in mini_batches(batch, schedule.rows_per_mini_batch):
            started = time.perf_counter()
            if values:
                metrics = engine.forward_backward_values(mini, loss_fn, schedule.micro_batch_size)
            else:
                rows_run = {} if train_rows is None else {"train_rows": train_rows[rows]}
                metrics = engine.forward_backward(
                    mini, loss_fn, schedule.micro_batch_size, **pass_options, **rows_run
                )
            metrics.update(engine.optimizer_step())
            steps.add(with_step_time(metrics, time.perf_counter() - started))
    engine.update_finished()  # e.g. the optimizer state to host memory until the next update
    return steps
