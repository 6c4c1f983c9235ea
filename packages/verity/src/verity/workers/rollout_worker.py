"""The rollout as its own worker group (``trainer.mode=async``): generation in processes of its own.

In the default ``sync`` mode the rollout lives inside each actor process
(:class:`~verity.workers.actor_rollout.ActorRolloutRefWorker`). In ``async`` mode the
``rollout`` role (``rollout.n_workers`` Ray actors on a resource pool of their own)
generates the next step's batch while the actor group trains on this step's, and
receives the trainer's weights after each update through Ray's object store
(:mod:`verity.resharding.object_store`). Each rank holds a full copy of the policy;
batches are split over the ranks (``DP_SPLIT``) like the actor's. With
``rollout.tensor_parallel_size = tp > 1`` the group's ranks form replicas of ``tp``
consecutive ranks (their own process group): each rank holds its slice of the policy, read
from the model folder one tensor at a time and cut from each published bucket, and the
batches are split over the replicas.
"""

from __future__ import annotations

from typing import Any

import torch

from verity.batch import Batch
from verity.config.schema import VerityConfig
from verity.controller import Collect, Dispatch, Worker, register
from verity.engines.hf_loading import load_causal_lm
from verity.hardware import get_backend
from verity.resharding.object_store import load_weight_buckets
from verity.rollout import RolloutEngine
from verity.testing.faults import maybe_stall
from verity.workers.report import RolloutFacts, WorkerReport
from verity.workers.role_training import process_group_backend, role_device, rollout_dtype
from verity.workers.rollout_side import (
    ReplicaPlace,
    build_role_rollout,
    generate_batch,
    iter_folder_weights,
    pad_id,
    rollout_replica_mesh,
    rollout_weight_bytes,
    rows_for_driver,
)


class RolloutWorker(Worker):
    """One rank of the standalone rollout group: a rollout engine over a full copy of the policy."""

    def __init__(self, cfg: VerityConfig, model_path: str, tokenizer_path: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.rollout: RolloutEngine | None = None
        self.policy_version = 0  # updates the weights held here have had

    @register(Dispatch.BROADCAST)
    def init_model(self) -> WorkerReport:
        """Build the rollout engine from the model path; returns this rank's report."""
        from transformers import AutoTokenizer

        cfg = self.cfg
        backend = get_backend(None if cfg.trainer.device == "auto" else cfg.trainer.device)
        torch.set_num_threads(max(1, int(cfg.trainer.cpus_per_worker)))
        device = role_device(backend, self.local_rank)
        dtype = rollout_dtype(cfg, device)
        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.pad_token_id = pad_id(tokenizer)
        tp = int(cfg.rollout.tensor_parallel_size)
        replica = ReplicaPlace.of(self.rank, self.world_size, tp)
        tp_mesh = None
        if tp > 1:  # replicas of tp ranks: a process group of this group's own, batches split by replica
            self.init_process_group(backend=process_group_backend(cfg, backend))
            self.set_dp_layout(replica.index, replica.count, replica.tp_rank == 0)
            tp_mesh = rollout_replica_mesh(device, self.world_size, tp)
        self.rollout = build_role_rollout(
            cfg,
            model_path=self.model_path,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            rank=replica.index,
            world_size=replica.count,
            load_policy=lambda: load_causal_lm(
                self.model_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation
            ).to(device),
            tp_mesh=tp_mesh,
        )
        if self.rollout.needs_weight_sync:  # built empty: each rank keeps its slice of every tensor read
            self.rollout.load_weights(iter_folder_weights(self.model_path))
        return WorkerReport(rank=self.rank, device=str(device), rollout=RolloutFacts.of(self.rollout))

    @register(Dispatch.DP_SPLIT)
    def generate(self, batch: Batch) -> Batch:
        """Sample one response per row, as :meth:`ActorRolloutRefWorker.generate` does (``sampling``, ``seed`` meta)."""
        assert self.rollout is not None, "init_model() must run first"
        maybe_stall("generate")
        out = generate_batch(self.rollout, batch, self.cfg.rollout.micro_batch_size, self.dp_rank)
        return rows_for_driver(self.cfg, out, self.pad_token_id)

    @register(Dispatch.BROADCAST, collect=Collect.ALL)
    def load_weights(self, refs: list[Any], version: int) -> dict[str, float]:
        """Fetch the published weight buckets (``refs``) into the rollout; now at policy ``version``.

        Returns ``{"bytes": ..., "seconds": ..., "version": ..., "weight_bytes": ...}`` for this rank
        (``weight_bytes``: the rollout's weights it holds now, None where the engine does not count them).
        """
        assert self.rollout is not None, "init_model() must run first"
        self.rollout.wake()
        num_bytes, seconds = load_weight_buckets(refs, self.rollout)
        self.policy_version = int(version)
        held = rollout_weight_bytes(self.rollout)  # what this rank keeps: a slice with tensor parallelism
        return {
            "bytes": float(num_bytes),
            "seconds": seconds,
            "version": float(version),
            "weight_bytes": None if held is None else float(held),
        }

    @register(Dispatch.BROADCAST, collect=Collect.RANK_ZERO)
    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every weight of this rank's rollout model, on CPU (for checks; small models only)."""
        assert self.rollout is not None, "init_model() must run first"
        model = getattr(self.rollout, "model", None)
        if model is None:
            raise RuntimeError(
                f"the {self.rollout.name!r} rollout engine exposes no model to read weights from"
            )
        return {name: t.detach().to("cpu").clone() for name, t in model.state_dict().items()}
