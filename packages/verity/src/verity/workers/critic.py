r"""The critic role: a value model trained by the same FSDP2 engine as the actor.

**Model.** The actor's backbone type with a scalar head: the checkpoint is loaded
as ``AutoModelForTokenClassification`` with ``num_labels=1`` — the decoder
(embeddings, layers, final norm) comes from the actor checkpoint, its LM head is
dropped, and a new linear head ``hidden -> 1`` is added. The head starts at zero
(weight and bias), so every value starts at 0, the neutral guess for a 0/1 reward,
and the first updates move the head before the backbone; the head has no dropout.

**Values** (the verl convention, :mod:`verity.engines.values`): the value of
response token :math:`j` is the head's output at position :math:`P-1+j` — the state
that has seen the prompt and the response tokens before :math:`j`. So values for
the response come from positions :math:`P-1 .. P+R-2`, the same positions whose
logits predict the response tokens.

**Loss** (:func:`verity.algorithms.value_loss`): with old values :math:`V^{old}`
(from :meth:`CriticWorker.compute_values` before the update) and returns :math:`G`
(from the advantage estimator, GAE: :math:`G_t = A_t + V^{old}_t`),

.. math::
    \ell_t = \tfrac12 \max\big((V_t - G_t)^2,\ (V^{old}_t + \operatorname{clip}(V_t - V^{old}_t, -c, c) - G_t)^2\big)

aggregated with ``critic.loss_agg_mode`` and the global aggregation context (counts
over the whole mini-batch across ranks), so the critic's gradient, like the actor's,
does not depend on the micro-batch size or the number of workers.

**Placement.** By default (``critic.placement: colocated``) the trainer colocates the
critic with the actor (``verity.controller.colocate``): each rank's process holds the
actor, rollout, reference and critic, and the critic reuses the process group the
actor formed. On a small machine this costs no extra processes or CPU reservations;
the critic's parameters, gradients and optimizer state are sharded over the same
ranks. ``critic.placement: separate`` gives it a worker group of its own
(``critic.n_workers`` ranks, its own process group).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from verity.algorithms.configs import ValueLossConfig
from verity.algorithms.value_loss import value_loss
from verity.batch import Batch
from verity.checkpoint.sharded import load_engine, save_engine
from verity.config.schema import VerityConfig
from verity.controller import Collect, Dispatch, Worker, register
from verity.engines import TrainingEngine
from verity.engines.model_source import ModelSource
from verity.hardware import get_backend
from verity.workers.report import TrainingFacts, WorkerReport
from verity.workers.role_training import (
    UpdateSchedule,
    build_role_engine,
    process_group_backend,
    role_device,
    role_model_dtype,
    update_epochs,
)

ValueLossFn = Callable[[Any, torch.Tensor, Any], tuple[torch.Tensor, dict[str, float]]]

#: what :meth:`CriticWorker.update_critic` reads from its batch
CRITIC_UPDATE_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "responses",
    "response_mask",
    "values",
    "returns",
)


def load_value_model(
    model_path: str, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
) -> torch.nn.Module:
    """The checkpoint at ``model_path`` as a value model: its backbone plus a zero-initialised scalar head.

    Returns an HF ``*ForTokenClassification`` module (``num_labels=1``, no head
    dropout) whose forward gives ``logits [B, T, 1]``.
    """
    return value_model_source(model_path, dtype, attn_implementation).load_whole()


def value_model_source(
    model_path: str, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
) -> ModelSource:
    """The critic's model: the checkpoint's backbone with a scalar ``score`` head that starts at zero."""
    return ModelSource(model_path, "value_model", dtype, attn_implementation)


def make_value_loss(config: ValueLossConfig) -> ValueLossFn:
    """Build ``loss_fn(micro_batch, values [b, R], agg) -> (loss, metrics)`` for the engine.

    ``micro_batch`` must hold ``values`` (the old values, ``[b, R]``), ``returns`` and
    ``response_mask`` ``[b, R]``. Metrics (``critic/*``) are micro-batch values that the
    engine averages over micro-batches and ranks (the loss itself the engine sums
    exactly: its ``loss``).
    """
    config.validate()

    def loss_fn(micro: Any, values: torch.Tensor, agg: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = value_loss(
            values=values,
            old_values=micro["values"].to(values.dtype),
            returns=micro["returns"].to(values.dtype),
            response_mask=micro["response_mask"].to(values.dtype),
            agg=agg,
            config=config,
        )
        out = {
            "critic/vf_clip_frac": metrics["vf_clipfrac"],
            "critic/vpred_mean": metrics["vpred_mean"],
            "critic/vf_explained_var": metrics["vf_explained_var"],
        }
        return loss, out

    return loss_fn


class CriticWorker(Worker):
    """One data-parallel rank of the critic (see the module docstring).

    Args:
        cfg: the run config (``critic.*``, ``rollout.n``, ``trainer.*``).
        model_path: the actor checkpoint whose backbone initialises the critic
            (``critic.model_path`` overrides it).
    """

    def __init__(self, cfg: VerityConfig, model_path: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.model_path = cfg.critic.model_path or model_path
        self.engine: TrainingEngine | None = None
        self.loss_fn: ValueLossFn | None = None

    @register(Dispatch.BROADCAST)
    def init_model(self) -> WorkerReport:
        """Join (or reuse) the process group and build the sharded value model; returns this rank's report."""
        cfg = self.cfg
        backend = get_backend(None if cfg.trainer.device == "auto" else cfg.trainer.device)
        # no-op when colocated with the actor
        self.init_process_group(backend=process_group_backend(cfg, backend))
        # The head's Linear on [B, T, H] returns a view; FSDP2 warns in case the caller edits it in
        # place. verity.engines.values only slices and converts it (out of place), so this is noise.
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module .*ForTokenClassification\) returned a view"
        )
        device = role_device(backend, self.local_rank)  # the actor's rule: see role_device
        source = value_model_source(
            self.model_path, dtype=role_model_dtype(cfg), attn_implementation=cfg.model.attn_implementation
        )
        n_params = source.parameter_count()
        self.engine = build_role_engine("critic", source, cfg, cfg.critic, device)
        # with sequence parallelism the ranks of an SP group share rows (its first answers)
        self.set_dp_layout(*self.engine.dp_layout)
        c = cfg.critic
        self.loss_fn = make_value_loss(
            ValueLossConfig(cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode)
        )
        return WorkerReport(
            rank=self.rank,
            device=str(device),
            device_name=backend.device_name(device.index or 0),
            n_params=n_params,
            training=TrainingFacts.of(self.engine),
        )

    @register(Dispatch.DP_SPLIT)
    def compute_values(self, batch: Batch) -> Batch:
        """Critic values of the response tokens: ``values`` ``[b, R]`` float32 (0 is not forced on padding)."""
        if self.engine is None:
            raise RuntimeError("CriticWorker.compute_values: init_model() must run first")
        values = self.engine.compute_values(batch, self.cfg.critic.micro_batch_size)
        return Batch.from_dict({"values": values})

    @register(Dispatch.DP_SPLIT, collect=Collect.RANK_ZERO)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Epochs over mini-batches of this rank's rows, one optimizer step each.

        ``batch`` holds :data:`CRITIC_UPDATE_KEYS` (``values`` = the old values,
        ``returns`` = the regression targets). A mini-batch is
        ``critic.ppo_mini_batch_size x rollout.n / dp_size`` rows here (``dp_size``: the workers, or
        the SP groups under sequence parallelism, whose ranks share rows). Returns the
        means over all steps of the engine's metrics (reduced over ranks), prefixed
        ``critic/`` (``critic/value_loss`` is the mini-batch value loss), plus
        ``critic/optimizer_steps``.
        """
        if self.engine is None or self.loss_fn is None:
            raise RuntimeError("CriticWorker.update_critic: init_model() must run first")
        missing = [k for k in CRITIC_UPDATE_KEYS if k not in batch]
        if missing:
            raise KeyError(f"CriticWorker.update_critic: batch is missing {missing}; it has {batch.keys()}")
        c = self.cfg.critic
        schedule = UpdateSchedule(
            epochs=c.ppo_epochs,
            rows_per_mini_batch=max(1, c.ppo_mini_batch_size * self.cfg.rollout.n // self.dp_size),
            micro_batch_size=c.micro_batch_size,
        )
        steps = update_epochs(self.engine, batch, self.loss_fn, schedule, values=True)
        return steps.means("critic", renamed={"loss": "value_loss"})  # the engine's exact mini-batch loss

    @register(Dispatch.BROADCAST)
    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Write this rank's shards of the critic (model, optimizer, LR schedule) and RNG states under ``path``."""
        if self.engine is None:
            raise RuntimeError("CriticWorker.save_checkpoint: init_model() must run first")
        return save_engine(path, self.engine, rank=self.rank, world_size=self.world_size)

    @register(Dispatch.BROADCAST)
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Load the critic's state from ``path`` (written by any number of ranks)."""
        if self.engine is None:
            raise RuntimeError("CriticWorker.load_checkpoint: init_model() must run first")
        return load_engine(path, self.engine, rank=self.rank, world_size=self.world_size)
