"""The ``prm`` role: the implicit process reward model and its frozen reference, one rank per worker.

Each rank holds two engines of the kind ``prm.engine`` names (FSDP2 by default), both
loaded from ``prm.model_path`` (default: the policy's starting checkpoint, as in the
paper), sharded over the role's data-parallel ranks:

- the **PRM** :math:`\\pi_\\phi`, trained with :func:`~verity_recipe_prime.implicit_prm.make_prm_loss`
  and AdamW (``prm.optim``); checkpointed, resumed and exportable like the actor;
- its **reference** :math:`\\pi_{\\text{ref}}`, frozen (inference only, never saved:
  it is reloaded from the model path).

Why the PRM keeps its own reference instead of asking the actor's: the implicit
reward is defined against the PRM's own starting point, which is ``prm.model_path``
and need not be the policy's checkpoint; both log-probs are taken at temperature 1,
whatever ``rollout.temperature`` the actor's reference uses; the actor builds a
reference only when a KL term asks for one; and with ``prm.placement: separate`` the
whole PRM computation moves to its own workers instead of adding a forward pass to
the actor's. The cost is one more frozen copy of the model per rank.

Placement: colocated with the actor by default (the same processes and process
group; its parameters and optimizer state sharded over the same ranks), or its own
worker group with ``prm.placement: separate`` (``prm.n_workers`` ranks).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from verity.batch import Batch
from verity.checkpoint.sharded import load_engine, save_engine
from verity.controller import Collect, Dispatch, Worker, register
from verity.engines import EngineBuildContext, TrainingEngine, build_training_engine
from verity.engines.model_source import ModelSource
from verity.hardware import get_backend
from verity.workers.report import TrainingFacts, WorkerReport
from verity.workers.role_training import (
    UpdateSchedule,
    build_role_engine,
    role_device,
    role_model_dtype,
    update_epochs,
)

from verity_recipe_prime.implicit_prm import PRMLossFn, make_prm_loss, process_rewards

#: what :meth:`PRMWorker.update_prm` reads from its batch
PRM_UPDATE_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "responses",
    "response_mask",
    "prm_ref_logprobs",
    "acc",
)
#: the PRM's log-probs are the model's own distribution, whatever the rollout's temperature
PRM_TEMPERATURE = 1.0


def trained_role_view(prm: Any) -> SimpleNamespace:
    """``cfg.prm`` under the field names :func:`verity.workers.role_training.build_role_engine` reads."""
    return SimpleNamespace(
        engine=prm.engine,
        optim=prm.optim,
        ppo_mini_batch_size=prm.mini_batch_size,
        ppo_epochs=prm.epochs,
        **{prm.engine: getattr(prm, prm.engine, None)},
    )


def update_prm_epochs(
    engine: TrainingEngine,
    batch: Batch,
    loss_fn: PRMLossFn,
    *,
    rows_per_mini: int,
    epochs: int,
    micro_batch_size: int,
) -> dict[str, float]:
    """``epochs`` passes of one optimizer step per mini-batch of ``rows_per_mini`` local rows.

    Returns the means over the steps of the engine's metrics, named ``prm/<metric>``
    (``prm/loss`` is the exact mini-batch cross-entropy), plus ``prm/optimizer_steps``.
    """
    schedule = UpdateSchedule(
        epochs=epochs, rows_per_mini_batch=rows_per_mini, micro_batch_size=micro_batch_size
    )
    return update_epochs(engine, batch, loss_fn, schedule, temperature=PRM_TEMPERATURE).means("prm")


class PRMWorker(Worker):
    """One data-parallel rank of the implicit PRM (see the module docstring).

    Args:
        cfg: the run config (``prm.*``, ``rollout.n``, ``trainer.*``, ``model.*``).
        model_path: the policy's starting checkpoint (used when ``prm.model_path`` is unset).
    """

    def __init__(self, cfg: Any, model_path: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.model_path = cfg.prm.model_path or model_path
        self.engine: TrainingEngine | None = None
        self.ref: TrainingEngine | None = None
        self.loss_fn: PRMLossFn | None = None

    @register(Dispatch.BROADCAST)
    def init_model(self) -> WorkerReport:
        """Join (or reuse) the process group; build the PRM and its frozen reference; this rank's report."""
        cfg, prm = self.cfg, self.cfg.prm
        backend = get_backend(None if cfg.trainer.device == "auto" else cfg.trainer.device)
        torch.set_num_threads(max(1, int(cfg.trainer.cpus_per_worker)))
        self.init_process_group(backend=backend.dist_backend)  # no-op when colocated with the actor
        device = role_device(backend, self.local_rank)
        dtype, attn = role_model_dtype(cfg), cfg.model.attn_implementation

        source = ModelSource(self.model_path, dtype=dtype, attn_implementation=attn)
        n_params = source.parameter_count()
        self.engine = build_role_engine("prm", source, cfg, trained_role_view(prm), device)
        self.ref = build_training_engine(
            prm.engine,
            EngineBuildContext(
                role="prm_reference",
                load_model=source.load_whole,
                model_path=self.model_path,
                device=device,
                source=source,
                options=getattr(prm, prm.engine, None),
                cfg=cfg,
            ),
        )
        self.loss_fn = make_prm_loss(prm.beta)
        return WorkerReport(
            rank=self.rank,
            device=str(device),
            n_params=n_params,
            training=TrainingFacts.of(self.engine),
            extra={"model_path": self.model_path},
        )

    def _engines(self) -> tuple[TrainingEngine, TrainingEngine]:
        if self.engine is None or self.ref is None:
            raise RuntimeError("PRMWorker: init_model() must run first")
        return self.engine, self.ref

    @register(Dispatch.DP_SPLIT)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Log-probs of the responses under the PRM's frozen reference: ``prm_ref_logprobs [b, R]``."""
        _, ref = self._engines()
        logprobs, _ = ref.compute_logprobs(
            batch, self.cfg.prm.micro_batch_size, temperature=PRM_TEMPERATURE, compute_entropy=False
        )
        return Batch.from_dict({"prm_ref_logprobs": logprobs})

    @register(Dispatch.DP_SPLIT)
    def compute_process_rewards(self, batch: Batch) -> Batch:
        """The PRM's current process rewards ``prm_process_rewards [b, R]`` (0 off the response tokens).

        ``batch``: the sequence keys, ``response_mask`` and ``prm_ref_logprobs``.
        """
        engine, _ = self._engines()
        logprobs, _ = engine.compute_logprobs(
            batch, self.cfg.prm.micro_batch_size, temperature=PRM_TEMPERATURE, compute_entropy=False
        )
        rewards = process_rewards(
            logprobs, batch["prm_ref_logprobs"], batch["response_mask"], self.cfg.prm.beta
        )
        return Batch.from_dict({"prm_process_rewards": rewards})

    @register(Dispatch.DP_SPLIT, collect=Collect.RANK_ZERO)
    def update_prm(self, batch: Batch) -> dict[str, float]:
        """Train the PRM on this step's rollouts (:data:`PRM_UPDATE_KEYS`; ``acc`` = the labels).

        A mini-batch is ``prm.mini_batch_size x rollout.n / ranks`` rows here; see
        :func:`update_prm_epochs` for the metrics.
        """
        engine, _ = self._engines()
        assert self.loss_fn is not None
        missing = [k for k in PRM_UPDATE_KEYS if k not in batch]
        if missing:
            raise KeyError(f"PRMWorker.update_prm: batch is missing {missing}; it has {batch.keys()}")
        prm = self.cfg.prm
        return update_prm_epochs(
            engine,
            batch,
            self.loss_fn,
            rows_per_mini=max(1, prm.mini_batch_size * self.cfg.rollout.n // self.world_size),
            epochs=prm.epochs,
            micro_batch_size=prm.micro_batch_size,
        )

    @register(Dispatch.BROADCAST)
    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Write this rank's shards of the PRM (model, optimizer, LR schedule) and RNG states under ``path``."""
        engine, _ = self._engines()
        return save_engine(path, engine, rank=self.rank, world_size=self.world_size)

    @register(Dispatch.BROADCAST)
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Load the PRM's state from ``path`` (written by any number of ranks)."""
        engine, _ = self._engines()
        return load_engine(path, engine, rank=self.rank, world_size=self.world_size)
