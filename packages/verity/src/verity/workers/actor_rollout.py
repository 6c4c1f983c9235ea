"""The actor role with its rollout and reference colocated in one process per device.

Each worker of the group holds, on its device:

- the **actor**: the policy trained by the engine ``actor.engine`` names (built
  through :mod:`verity.engines.registry`; FSDP2 by default, its parameters sharded
  over the group's data-parallel ranks);
- the **rollout**: the engine ``rollout.engine`` names (:mod:`verity.rollout.registry`;
  HF transformers by default, over a full copy of the policy), refreshed from the
  actor's shards after every update (:func:`~verity.resharding.sync_weights`, gathered
  in bounded buckets and handed over in this process). With ``rollout.tensor_parallel_size
  = tp > 1`` the group's ranks form ``world / tp`` replicas of ``tp`` consecutive ranks:
  each rank holds and receives only its slice of the policy, and ``generate`` splits the
  prompts over replicas (the ``"rollout"`` data-parallel layout), not over ranks;
- the **reference** policy (only when a KL term needs it): a frozen engine of the same kind;
  with LoRA adapters (``actor.lora.rank > 0``) the actor's own model with its adapters
  disabled instead — the base model's log-probs with no second copy of the weights.

The driver calls the methods as group calls; every data method splits its batch
across the data-parallel ranks (``DP_SPLIT``) and the results come back in order.

**The actor's loss** (:func:`make_actor_loss`): policy loss + optional KL loss against the
reference − entropy bonus. For a micro-batch with response mask :math:`m`, the loss the engine back-propagates is

.. math::
    \\mathcal{L} = \\mathcal{L}_{\\text{policy}}(\\log\\pi, \\log\\pi_{\\text{old}}, A)
        + \\beta_{\\text{KL}}\\,\\operatorname{agg}\\big(\\mathrm{KL}(\\log\\pi, \\log\\pi_{\\text{ref}})\\big)
        - c_H\\,\\operatorname{agg}(H)

where every term is aggregated with the same mode and the same global
:class:`~verity.algorithms.aggregation.AggregationContext` (counts over the whole
mini-batch across ranks), so the sum over micro-batches and ranks is the
mini-batch loss whatever the micro-batch size and number of workers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from verity.algorithms.aggregation import aggregate_loss
from verity.algorithms.configs import KLConfig, PolicyLossConfig
from verity.algorithms.kl import kl_loss
from verity.algorithms.logprob_gap import row_gaps
from verity.algorithms.off_policy import truncated_importance_weights
from verity.algorithms.policy_losses import get_policy_loss
from verity.batch import Batch
from verity.checkpoint.sharded import load_engine, save_engine
from verity.config.derived import skips_zero_advantage_rows
from verity.config.rollout_checks import rollout_replica_size
from verity.config.schema import VerityConfig
from verity.controller import Collect, Dispatch, Worker, register
from verity.engines import EngineBuildContext, TrainingEngine, build_training_engine
from verity.engines.model_source import ModelSource
from verity.engines.options import FSDP2Options
from verity.engines.train_rows import rows_with_advantage
from verity.hardware import get_backend
from verity.hardware.flops import active_parameters
from verity.resharding import iter_engine_weights, sync_weights
from verity.resharding.object_store import publish_weight_buckets
from verity.rollout import RolloutEngine
from verity.testing.faults import maybe_stall
from verity.workers.report import RolloutFacts, TrainingFacts, WorkerReport
from verity.workers.role_training import (
    UpdateSchedule,
    build_role_engine,
    process_group_backend,
    role_device,
    role_model_dtype,
    rollout_dtype,
    update_epochs,
)
from verity.workers.rollout_side import (
    ReplicaPlace,
    RowScorer,
    build_role_rollout,
    generate_batch,
    is_balanced_chunk,
    pad_id,
    rollout_replica_mesh,
    rollout_weight_bytes,
    rows_for_driver,
)

ActorLossFn = Callable[[Any, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, dict[str, float]]]


def make_actor_loss(
    policy: PolicyLossConfig, kl: KLConfig, entropy_coeff: float, is_cap: float = 0.0
) -> ActorLossFn:
    """Build ``loss_fn(micro_batch, logprobs [b,R], entropy [b,R], agg) -> (loss, metrics)``.

    ``micro_batch`` must hold ``advantages`` and ``response_mask`` (``[b, R]``), and
    ``ref_logprobs`` when ``kl.use_kl_loss``. Its ``old_logprobs`` are the behaviour
    log-probs; without them (an on-policy run that skipped the recomputation) the
    forward's own log-probs, detached, stand in: ratio 1, and the same gradient a
    recomputation gives. ``actor/behaviour_logprob_gap`` is the token mean of
    ``|log pi - log pi_old|`` (0 without ``old_logprobs``; with ``rollout_logprobs``
    as the behaviour, the sampler-vs-trainer mismatch plus any update since). Metrics are
    micro-batch token means (the engine averages them over micro-batches and ranks).

    ``is_cap > 0`` (``actor.off_policy.is_cap``): every token's policy loss is weighted by the
    truncated importance weight ``min(pi_old / pi_rollout, is_cap)`` against the micro-batch's
    ``rollout_logprobs`` (:mod:`verity.algorithms.off_policy`), applied to the advantages.
    """
    policy_loss = get_policy_loss(policy.name)

    def loss_fn(micro: Any, logprobs: torch.Tensor, entropy: torch.Tensor, agg: Any):
        mask = micro["response_mask"].to(logprobs.dtype)
        old = micro["old_logprobs"].to(logprobs.dtype) if "old_logprobs" in micro else logprobs.detach()
        advantages = micro["advantages"].to(logprobs.dtype)
        is_metrics: dict[str, float] = {}
        if is_cap > 0:
            if "rollout_logprobs" not in micro:
                raise RuntimeError("actor.off_policy.is_cap > 0 needs rollout_logprobs in the update's batch")
            weights, is_metrics = truncated_importance_weights(old, micro["rollout_logprobs"], mask, is_cap)
            advantages = advantages * weights
        loss, metrics = policy_loss(
            logprobs=logprobs,
            old_logprobs=old,
            advantages=advantages,
            response_mask=mask,
            agg=agg,
            config=policy,
        )
        metrics = {f"actor/{k}": float(v) for k, v in {**metrics, **is_metrics}.items()}
        metrics["actor/pg_loss"] = float(loss.detach())
        gap = ((logprobs.detach() - old).abs() * mask).sum() / mask.sum().clamp(min=1.0)
        metrics["actor/behaviour_logprob_gap"] = float(gap)
        if kl.use_kl_loss:
            kl_term, kl_metrics = kl_loss(
                logprobs=logprobs,
                ref_logprobs=micro["ref_logprobs"].to(logprobs.dtype),
                response_mask=mask,
                agg=agg,
                kind=kl.kl_loss_kind,
                loss_agg_mode=policy.loss_agg_mode,
                clamp=kl.kl_clamp,
            )
            loss = loss + kl.kl_loss_coef * kl_term
            metrics["actor/kl_loss"] = kl_metrics["kl_loss"]
        if entropy_coeff:
            loss = loss - entropy_coeff * aggregate_loss(entropy, mask, policy.loss_agg_mode, agg)
        return loss, metrics

    return loss_fn


def reference_options(cfg: VerityConfig) -> Any:
    """The frozen reference engine's settings: the actor engine's, with the reference's own offload.

    Under ``actor.engine=fsdp2`` the reference keeps ``actor.fsdp2``'s layout and kernels, but offloads
    its parameters as ``actor.reference.offload_params`` says (not as the actor does) and has no
    optimizer state to offload.
    """
    options = getattr(cfg.actor, cfg.actor.engine, None)
    if not isinstance(options, FSDP2Options):
        return options
    return dataclasses.replace(
        options, offload_params=cfg.actor.reference.offload_params, offload_optimizer=False
    )


class ActorRolloutRefWorker(Worker):
    """One data-parallel rank of the actor, its rollout and (optionally) the reference."""

    def __init__(self, cfg: VerityConfig, model_path: str, tokenizer_path: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.actor: TrainingEngine | None = None
        self.ref: Any = (
            None  # anything with compute_logprobs(): a frozen engine, or the actor without adapters
        )
        self.rollout: RolloutEngine | None = None
        self.sync_bucket_bytes = int(cfg.rollout.sync_bucket_mb) * 1024 * 1024  # per gathered bucket
        self.rollout_released_bytes: int | None = None  # what the last generate's sleep gave back

    # ------------------------------------------------------------------ setup
    @register(Dispatch.BROADCAST)
    def init_model(self) -> WorkerReport:
        """Form the process group, build actor / rollout / reference; returns this rank's report.

        The report names what actually runs here, read from the built engines
        (:class:`~verity.workers.report.WorkerReport`), not the config's strings.
        """
        from transformers import AutoTokenizer

        cfg = self.cfg
        backend = get_backend(None if cfg.trainer.device == "auto" else cfg.trainer.device)
        torch.set_num_threads(max(1, int(cfg.trainer.cpus_per_worker)))
        self.init_process_group(backend=process_group_backend(cfg, backend))
        device = role_device(backend, self.local_rank)
        torch.manual_seed(cfg.trainer.seed)
        dtype = role_model_dtype(cfg)
        attn = cfg.model.attn_implementation

        source = ModelSource(self.model_path, dtype=dtype, attn_implementation=attn)
        n_params = source.parameter_count()
        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.pad_token_id = pad_id(tokenizer)
        self.scorer = RowScorer(cfg, tokenizer)  # reward.placement=workers
        tp = rollout_replica_size(cfg)
        replica = ReplicaPlace.of(self.rank, self.world_size, tp)
        if tp > 1:  # prompts go to replicas, not ranks; the first rank of each answers for it
            self.set_dp_layout(replica.index, replica.count, replica.tp_rank == 0, name="rollout")
        # the rollout's own whole copy (an in-process engine loads it; vLLM and SGLang read the folder),
        # or with tensor parallelism this rank's slice of it, built empty and filled by the first sync
        self.rollout = build_role_rollout(
            cfg,
            model_path=self.model_path,
            tokenizer=tokenizer,
            device=device,
            dtype=rollout_dtype(cfg, device),
            rank=replica.index,
            world_size=replica.count,
            load_policy=source.load_whole,
            tp_mesh=rollout_replica_mesh(device, self.world_size, tp) if tp > 1 else None,
        )
        # a sharding engine builds the actor empty and receives only its shard of the checkpoint
        self.actor = build_role_engine("actor", source, cfg, cfg.actor, device)
        # with tensor/pipeline or sequence parallelism several ranks share one data-parallel shard of every batch
        self.set_dp_layout(*self.actor.dp_layout)
        if tp == 1 and getattr(getattr(self.actor, "sp", None), "size", 1) > 1:
            # an SP group shares its training rows, but each rank still generates its own prompts
            self.set_dp_layout(self.rank, self.world_size, True, name="rollout")
        kl = cfg.algorithm.kl
        needs_reference = kl.use_kl_loss or kl.use_kl_in_reward
        if needs_reference and cfg.actor.lora.enabled:
            # the reference for free: the same weights with the adapters disabled
            self.ref = self.actor.adapter_free_reference()
            if self.ref is None:
                raise RuntimeError(
                    f"the {self.actor.name!r} engine trains adapters but offers no adapter-free reference"
                )
        elif needs_reference:
            self.ref = build_training_engine(
                cfg.actor.engine,
                EngineBuildContext(
                    role="reference",
                    load_model=source.load_whole,
                    model_path=self.model_path,
                    device=device,
                    source=source,
                    options=reference_options(cfg),
                    cfg=cfg,
                ),
            )
        self.loss_fn = make_actor_loss(
            cfg.actor.policy_loss, kl, cfg.actor.entropy_coeff, cfg.actor.off_policy.is_cap
        )
        self.skip_zero_advantage = skips_zero_advantage_rows(cfg) and self.actor.supports_train_rows
        if cfg.actor.skip_zero_advantage == "on" and not self.actor.supports_train_rows:
            raise RuntimeError(
                f"actor.skip_zero_advantage=on: the {self.actor.name!r} engine cannot train a subset of "
                "rows (TrainingEngine.supports_train_rows); use auto or off"
            )
        if self.rollout.needs_weight_sync:  # built empty (a tensor-parallel slice): the actor's weights now
            sync_weights(self.actor, self.rollout, bucket_bytes=self.sync_bucket_bytes)
        trainable = self.actor.trainable_parameters()
        return WorkerReport(
            rank=self.rank,
            device=str(device),
            device_name=backend.device_name(device.index or 0),  # "NVIDIA H200", a CPU's model
            n_params=n_params,
            n_trainable_params=n_params if trainable is None else int(trainable),
            n_active_params=active_parameters(n_params, _text_config(source.config())),
            training=TrainingFacts.of(self.actor),
            rollout=RolloutFacts.of(self.rollout),
            reference_engine=self.ref.name if self.ref is not None else None,
            skip_zero_advantage=self.skip_zero_advantage,
            adapter=cfg.actor.lora.describe() if cfg.actor.lora.enabled else None,
        )

    # ------------------------------------------------------------ generation
    @register(Dispatch.DP_SPLIT, layout="rollout")
    def generate(self, batch: Batch) -> Batch:
        """Sample one response per row of a (repeated) prompt batch.

        ``batch.meta`` may carry ``sampling`` (a dict of :class:`SamplingParams`
        fields) and ``seed`` (this call's seed; each rank offsets it by its rollout
        replica's index so the same step always draws the same tokens; the ranks of a
        tensor-parallel replica get the same prompts and draw the same).
        """
        assert self.rollout is not None, "init_model() must run first"
        maybe_stall("generate")
        chunk = is_balanced_chunk(batch)  # one chunk of a load-balanced call: prepared and released around it
        if not chunk:
            self.prepare_generate()
        elif self.rollout.needs_weight_sync:  # a weight sync is collective: only prepare_generate may run it
            raise RuntimeError(
                "generate: a load-balanced chunk arrived before prepare_generate synced the rollout"
            )
        replica = self._dp_layout().layout_for("rollout").dp_rank
        out = generate_batch(self.rollout, batch, self.cfg.rollout.micro_batch_size, replica)
        if not chunk:
            self.release_generate()
        return rows_for_driver(self.cfg, out, self.pad_token_id)

    @register(Dispatch.BROADCAST, collect=Collect.NONE)
    def prepare_generate(self) -> None:
        """Wake the rollout and give it the actor's weights where its sleep released them (a second
        round of one step); every rank at once, before the chunks of a load-balanced ``generate``."""
        assert self.rollout is not None, "init_model() must run first"
        self.rollout.wake()  # a no-op unless the last call put it to sleep
        if self.rollout.needs_weight_sync:  # released since the last sync
            sync_weights(self.actor, self.rollout, bucket_bytes=self.sync_bucket_bytes)

    @register(Dispatch.BROADCAST, collect=Collect.NONE)
    def release_generate(self) -> None:
        """Put the rollout to sleep after a ``generate`` (after the last chunk of a load-balanced one).

        Colocated, the rollout gives its memory back to the training stages until the next weight
        sync (vLLM sleep mode at rollout.vllm.sleep_level; HF: the model to host memory on an
        accelerator, its weights released on a CPU); what it gave back goes with the next update's metrics.
        """
        assert self.rollout is not None, "init_model() must run first"
        held = rollout_weight_bytes(self.rollout)
        self.rollout.sleep()
        if held is not None:
            self.rollout_released_bytes = held - (rollout_weight_bytes(self.rollout) or 0)

    @register(Dispatch.DP_SPLIT)
    def score(self, batch: Batch) -> Batch:
        """Rule rewards of this rank's rows (``reward.placement=workers``): ``scores``, ``acc``,
        ``reward_status`` ``[b]``.

        ``batch`` is :func:`verity.rewards.on_workers.scoring_request` of generated rows; rows
        this rank generated are read from its own object store.
        """
        return self.scorer.score(batch)

    # --------------------------------------------------------------- log-probs
    @register(Dispatch.DP_SPLIT)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Actor log-probs and entropy of the responses: ``old_logprobs``, ``entropy`` ``[b, R]``.

        With ``rollout_logprobs`` and ``response_mask`` in the batch, also the sampler-vs-trainer
        gap's per-row parts (``[b]``, :func:`verity.algorithms.logprob_gap.row_gaps`).
        """
        assert self.actor is not None
        logprobs, entropy = self.actor.compute_logprobs(
            batch, self.cfg.actor.micro_batch_size, temperature=self.cfg.rollout.temperature
        )
        out = {"old_logprobs": logprobs, "entropy": entropy}
        if "rollout_logprobs" in batch and "response_mask" in batch:
            out.update(row_gaps(logprobs, batch["rollout_logprobs"], batch["response_mask"]))
        return Batch.from_dict(out)

    @register(Dispatch.DP_SPLIT)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Reference-policy log-probs of the responses: ``ref_logprobs`` ``[b, R]``."""
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob: no reference model (enable a KL term in algorithm.kl)")
        logprobs, _ = self.ref.compute_logprobs(
            batch,
            self.cfg.actor.micro_batch_size,
            temperature=self.cfg.rollout.temperature,
            compute_entropy=False,
        )
        return Batch.from_dict({"ref_logprobs": logprobs})

    # ---------------------------------------------------------------- update
    @register(Dispatch.DP_SPLIT, collect=Collect.RANK_ZERO)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over mini-batches of this rank's rows, then refresh the rollout's weights.

        Each mini-batch is ``actor.ppo_mini_batch_size x rollout.n / dp_size`` rows here, one
        optimizer step (:func:`~verity.workers.role_training.update_epochs`). Returns the means
        over the steps of the engine's metrics (already reduced over ranks), ``actor/optimizer_steps``
        and the weight sync's time and bytes.
        """
        assert self.actor is not None and self.rollout is not None
        maybe_stall("update_actor")
        cfg = self.cfg
        schedule = UpdateSchedule(
            epochs=cfg.actor.ppo_epochs,
            rows_per_mini_batch=cfg.actor.ppo_mini_batch_size * cfg.rollout.n // self.dp_size,
            micro_batch_size=cfg.actor.micro_batch_size,
        )
        steps = update_epochs(
            self.actor,
            batch,
            self.loss_fn,
            schedule,
            # rows whose advantage is 0 add nothing to the gradient: only the others run (when exact)
            train_rows=rows_with_advantage(batch["advantages"], batch["response_mask"])
            if self.skip_zero_advantage
            else None,
            temperature=cfg.rollout.temperature,
            entropy_requires_grad=cfg.actor.entropy_coeff != 0,  # the bonus needs d(entropy)
        )
        trained_tokens = steps.sums.pop("trained_tokens", None)
        out = steps.means("actor")
        if trained_tokens is not None:  # tokens through forward + backward, all optimizer steps
            out["perf/actor_trained_tokens"] = trained_tokens
        state_bytes = self.actor.optimizer_state_bytes()
        if state_bytes is not None:
            out["perf/optimizer_state_bytes"] = float(state_bytes)
        start = time.perf_counter()
        self.rollout.wake()
        stats = sync_weights(self.actor, self.rollout, bucket_bytes=self.sync_bucket_bytes)
        out["timing/weight_sync_s"] = time.perf_counter() - start
        out["perf/weight_sync_bytes"] = float(stats.num_bytes)
        if stats.received_bytes is not None:  # a tensor-parallel rollout's slices: what reached this rank
            out["perf/weight_sync_received_bytes"] = float(stats.received_bytes)
        if self.rollout_released_bytes is not None:  # weights the rollout gave back after generating
            out["perf/rollout_released_bytes"] = float(self.rollout_released_bytes)
        held = rollout_weight_bytes(self.rollout)
        if held is not None:  # this rank's rollout weights, refilled (1/tp of the policy with tp ranks)
            out["perf/rollout_weight_bytes"] = float(held)
        return out

    # --------------------------------------------------- cross-process weight sync
    @register(Dispatch.BROADCAST, collect=Collect.RANK_ZERO)
    def publish_weights(self) -> dict[str, Any]:
        """Gather the actor's full weights (collective) and put them in Ray's object store in buckets.

        For a rollout in another worker group (``trainer.mode=async``,
        :mod:`verity.resharding.object_store`). Rank 0 answers ``{"refs": [one object
        reference per bucket], "bytes": ..., "tensors": ..., "seconds": ...}``.
        """
        assert self.actor is not None, "init_model() must run first"
        published = publish_weight_buckets(self.actor, publish=self.rank == 0, bucket_bytes=self.sync_bucket_bytes)
        return {
            "refs": published.refs,
            "bytes": float(published.num_bytes),
            "tensors": float(published.num_tensors),
            "seconds": published.seconds,
        }

    @register(Dispatch.BROADCAST, collect=Collect.RANK_ZERO)
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full weights under HF names, on CPU (collective; for checks on small models)."""
        assert self.actor is not None, "init_model() must run first"
        return {
            name: t.detach().to("cpu").clone() for name, t in iter_engine_weights(self.actor, device="cpu")
        }

    # ------------------------------------------------------------- checkpoint
    @register(Dispatch.BROADCAST)
    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Write this rank's shards of the actor (model, optimizer, LR schedule) and RNG states under ``path``.

        A collective: every rank of the group calls it with the same ``path`` (see
        ``verity.checkpoint.sharded``). The rollout and the frozen reference are not
        saved: the rollout is a copy of the actor, the reference is reloaded from the model path.
        With LoRA only the adapters and their optimizer state are written (the base is the model path's).
        """
        assert self.actor is not None, "init_model() must run first"
        return save_engine(path, self.actor, rank=self.rank, world_size=self.world_size)

    @register(Dispatch.BROADCAST)
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Load the actor's state from ``path`` (any number of ranks saved it) and refresh the rollout from it."""
        assert self.actor is not None and self.rollout is not None, "init_model() must run first"
        info = load_engine(path, self.actor, rank=self.rank, world_size=self.world_size)
        self.rollout.wake()
        sync_weights(self.actor, self.rollout, bucket_bytes=self.sync_bucket_bytes)
        return info


def _text_config(config: Any) -> Any:
    """A model config's language part (a vision-language config's text config; otherwise itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
