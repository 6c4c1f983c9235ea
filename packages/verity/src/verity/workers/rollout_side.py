"""What both homes of the rollout share: building its engine and generating a batch in chunks.

The rollout runs inside each actor process (``trainer.mode=sync``,
:class:`~verity.workers.actor_rollout.ActorRolloutRefWorker`) or as a worker group
of its own (``async``, :class:`~verity.workers.rollout_worker.RolloutWorker`); the
engine it builds and the way it walks a batch are the same in both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verity.batch import Batch, keep_resident
from verity.config.derived import old_logprobs_source, scores_on_workers
from verity.config.schema import VerityConfig
from verity.controller.load_balance import CHUNK_INDEX_META, CHUNK_SEED_META
from verity.rewards.on_workers import check_reward_files_here, score_on_worker, worker_reward_manager
from verity.rollout import RolloutBuildContext, RolloutEngine, SamplingParams, build_rollout_engine


def build_role_rollout(
    cfg: VerityConfig,
    *,
    model_path: str,
    tokenizer: Any,
    device: torch.device,
    dtype: torch.dtype | None,
    rank: int,
    world_size: int,
    load_policy: Callable[[], nn.Module],
    tp_mesh: Any = None,
) -> RolloutEngine:
    """The rollout engine ``rollout.engine`` names, for one rank (seeded ``trainer.seed + rank``).

    ``load_policy()`` returns the policy module for engines that generate from one in
    this process (the HF engine); engines that load the checkpoint themselves (vLLM,
    SGLang) read ``model_path`` instead. Sequences are at most
    ``data.max_prompt_length + data.max_response_length`` tokens. ``tp_mesh``: this rank's
    tensor-parallel replica (:func:`rollout_replica_mesh`); ``rank`` / ``world_size`` then
    count replicas.
    """
    return build_rollout_engine(
        cfg.rollout.engine,
        RolloutBuildContext(
            model_path=model_path,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            seed=cfg.trainer.seed + rank,
            rank=rank,
            world_size=world_size,
            max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
            load_policy=load_policy,
            options=getattr(cfg.rollout, cfg.rollout.engine, None),
            cfg=cfg,
            tp_mesh=tp_mesh,
        ),
    )


@dataclass(frozen=True)
class ReplicaPlace:
    """A rank's place among tensor-parallel rollout replicas of ``tp`` consecutive ranks."""

    index: int  # the replica (its data-parallel rank for generation)
    count: int  # replicas in the group
    tp_rank: int  # the rank's place inside its replica

    @classmethod
    def of(cls, rank: int, world_size: int, tp: int) -> ReplicaPlace:
        """Rank ``rank`` of ``world_size`` with ``tp`` ranks per replica (``tp`` divides ``world_size``)."""
        if tp < 1 or world_size % tp:
            raise ValueError(f"rollout.tensor_parallel_size = {tp} does not divide the {world_size} ranks")
        return cls(rank // tp, world_size // tp, rank % tp)


def rollout_replica_mesh(device: torch.device, world_size: int, tp: int) -> Any:
    """The 1-D ``DeviceMesh`` of this rank's replica: ranks ``tp * (rank // tp) .. + tp`` (collective:
    every rank of the default process group calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("replica", "tp"))
    return mesh["tp"]


def is_balanced_chunk(batch: Batch) -> bool:
    """Whether ``batch`` is one chunk of a load-balanced call (its engine was prepared for the whole call)."""
    return CHUNK_INDEX_META in batch.meta


def generate_batch(rollout: RolloutEngine, batch: Batch, chunk_rows: int, dp_rank: int) -> Batch:
    """One sampled response per row of ``batch``, ``chunk_rows`` rows per engine call, in order.

    ``batch.meta`` may carry ``sampling`` (a dict of :class:`SamplingParams` fields) and
    ``seed`` (the call's seed; the engine is seeded ``seed * 1009 + dp_rank`` so the same
    step draws the same tokens on every rerun and ranks sharing a data-parallel shard
    draw the same). A chunk of a load-balanced call (:mod:`verity.controller.load_balance`)
    carries its own seed instead, so its rows do not depend on the replica that ran it.
    """
    params = SamplingParams(**batch.meta.get("sampling", {}))
    if CHUNK_SEED_META in batch.meta:
        rollout.set_seed(int(batch.meta[CHUNK_SEED_META]))
    elif "seed" in batch.meta:
        rollout.set_seed(int(batch.meta["seed"]) * 1009 + dp_rank)
    parts = [
        rollout.generate(batch.index(slice(i, i + chunk_rows)), params)
        for i in range(0, len(batch), chunk_rows)
    ]
    return parts[0] if len(parts) == 1 else Batch.concat(parts)


class RowScorer:
    """Scores rows on this rank for the ``reward`` stage's group call (``reward.placement=workers``).

    The :class:`~verity.rewards.RewardManager` (and its process pool) is built on the first call,
    so a run that scores on the driver never starts one here.
    """

    def __init__(self, cfg: VerityConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._manager: Any = None
        if scores_on_workers(cfg):  # a user function's file must be on this node too
            check_reward_files_here(cfg.reward)

    def score(self, rows: Batch) -> Batch:
        """``scores [b]``, ``acc [b]``, ``reward_status [b]`` of ``rows`` (:func:`~verity.rewards.on_workers.score_on_worker`)."""
        if self._manager is None:
            self._manager = worker_reward_manager(self.cfg.reward, self.tokenizer)
        return score_on_worker(self._manager, rows.to("cpu"))

    def close(self) -> None:
        """Stop the reward processes, if any were started."""
        if self._manager is not None:
            self._manager.close()


def rows_for_driver(cfg: VerityConfig, rows: Batch, pad_token_id: int) -> Batch:
    """What a generate call answers: the rows in host memory, their prompt-aligned tensors kept here.

    The answer carries per-row handles in their place (:mod:`verity.batch.transport`); the
    worker that later receives the rows fetches them from this process's object store. The
    rows are moved to host memory first: an engine on an accelerator returns them on its
    device, and a CUDA tensor handed to Ray reaches the driver (and the advantage stage, which
    computes on the CPU) as a CUDA tensor again.
    """
    return keep_resident(rows.to("cpu"), pad_token_id, also=resident_response_keys(cfg))


def resident_response_keys(cfg: VerityConfig) -> tuple[str, ...]:
    """The ``[B, R]`` keys that stay with the rows because no driver stage of this run reads them.

    ``rollout_logprobs`` go to workers only (the update's importance weights with
    ``actor.off_policy.is_cap``), except when they are the run's old log-probs
    (``actor.old_logprobs=rollout``), which the driver's old-log-prob stage copies. The
    response ids (and a multi-turn rollout's ``response_attention``, read only to decode
    them) stay when the workers score the rows (``reward.placement=workers``); a driver stage
    that decodes them anyway (a reward model's, a held-out evaluation's) fetches them by reading them.
    """
    keys = () if old_logprobs_source(cfg) == "rollout" else ("rollout_logprobs",)
    if scores_on_workers(cfg):
        keys += ("responses", "response_attention")
    return keys


def pad_id(tokenizer: Any) -> int:
    """The id that left-pads prompts: the tokenizer's pad token, else its EOS, else 0."""
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            return value
    return 0


def rollout_weight_bytes(rollout: RolloutEngine) -> int | None:
    """Bytes of weights the rollout holds on its device now, for engines that count them (the HF
    engine's ``weight_bytes()``); ``None`` for the others."""
    count = getattr(rollout, "weight_bytes", None)
    held = count() if callable(count) else None
    return None if held is None else int(held)


def iter_folder_weights(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every weight in an HF model folder: read one at a time from its safetensors
    files, so host memory holds one tensor; a folder without them is loaded whole on CPU first."""
    from verity.engines.safetensors_files import CheckpointFiles, has_safetensors

    if has_safetensors(model_path):
        files = CheckpointFiles(model_path)
        for name in files.names():
            yield name, files.read(name)
        return
    from verity.engines.hf_loading import load_causal_lm

    yield from load_causal_lm(model_path).state_dict().items()
