"""The rollout as its own worker group (``trainer.mode=async``): generation in processes of its own.

In the default ``sync`` mode the rollout lives inside each actor process
(:class:`~verity.workers.actor_rollout.ActorRolloutRefWorker`). In ``async`` mode the
``rollout`` role (``rollout.n_workers`` Ray actors on a resource pool of their own)
generates the next step's batch while the actor group trains on this step's, and
receives the trainer's weights after each update through Ray's object store
(:mod:`verity.resharding.object_store`). Each rank holds a full copy of the policy;
batches are split over the ranks (``DP_SPLIT``) like the actor's.
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
from verity.workers.role_training import role_device, rollout_dtype
from verity.workers.rollout_side import build_role_rollout, generate_batch, pad_id, rows_for_driver


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
        self.rollout = build_role_rollout(
            cfg,
            model_path=self.model_path,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            rank=self.rank,
            world_size=self.world_size,
            load_policy=lambda: load_causal_lm(
                self.model_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation
            ).to(device),
        )
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

        Returns ``{"bytes": ..., "seconds": ..., "version": ...}`` for this rank.
        """
        assert self.rollout is not None, "init_model() must run first"
        self.rollout.wake()
        num_bytes, seconds = load_weight_buckets(refs, self.rollout)
        self.policy_version = int(version)
        return {"bytes": float(num_bytes), "seconds": seconds, "version": float(version)}

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
