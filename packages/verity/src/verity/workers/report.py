"""What a worker built, as one rank reports it from ``init_model``: the facts a run records as what ran.

A role's ``init_model`` answers a :class:`WorkerReport` (a plug-in role may answer a plain
dict with the same field names). The driver keeps rank 0's (:class:`verity.launch.roles.RoleGroups`)
and turns it into ``summary.json``'s ``ran`` entries and the MLflow tags ``ran.*``
(:meth:`WorkerReport.ran`) — read from the built engines, never from the config's strings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from verity.engines.base import TrainingEngine
from verity.engines.shared_prompt import attention_implementation
from verity.rollout.base import RolloutEngine

__all__ = ["RolloutFacts", "TrainingFacts", "WorkerReport"]


@dataclass(frozen=True)
class TrainingFacts:
    """A built training engine, as it describes itself (:class:`~verity.engines.base.TrainingEngine`)."""

    engine: str  # the engine's registered name: fsdp2, megatron, ...
    compute_dtype: str  # float32 | bfloat16: what its matmuls run in
    attention: str | None = None  # the HF attention kernel its model runs
    sharding: str | None = None  # fsdp2: full | replicate
    model_parallel_nodes: int | None = None  # megatron: nodes one model-parallel group spans
    compiled_layers: int = 0
    compiled_head: bool = False
    cuda_graphs: bool = False
    # streamed: built empty, each rank given its shard of the checkpoint by one reader | whole
    weights_loaded: str = "whole"
    # fsdp2.shard_vocab in effect: the embedding and output layer kept in row shards on several ranks
    vocab_sharded: bool = False
    # fsdp2.packed in effect: its passes run on the packed (padding-free) layout where a micro-batch packs
    packed: bool = False
    # fsdp2.ulysses_sequence_parallel_size in effect: ranks each packed micro-batch is split over
    sequence_parallel_size: int = 1
    # a mixture-of-experts model: its sparse layers (routers found), and whether its passes replay routes
    moe_layers: int = 0
    routing_replay: bool = False

    @classmethod
    def of(cls, engine: TrainingEngine) -> TrainingFacts:
        """The facts of ``engine``."""
        router = getattr(engine, "router_terms", None)
        return cls(
            engine=engine.name,
            compute_dtype=str(engine.compute_dtype).removeprefix("torch."),
            attention=attention_implementation(engine.model),
            sharding=engine.sharding,
            model_parallel_nodes=engine.model_parallel_nodes,
            compiled_layers=int(engine.compiled_layers),
            compiled_head=bool(engine.compiled_head),
            cuda_graphs=bool(engine.cuda_graphs),
            weights_loaded="streamed" if getattr(engine, "streamed", False) else "whole",
            vocab_sharded=bool(getattr(engine, "vocab_sharded", False)),
            packed=bool(getattr(engine, "packed", False)),
            sequence_parallel_size=int(getattr(getattr(engine, "sp", None), "size", 1)),
            moe_layers=0 if router is None else int(router.tap.num_layers),
            routing_replay=router is not None and bool(router.settings.routing_replay),
        )


@dataclass(frozen=True)
class RolloutFacts:
    """A built rollout engine, as it describes itself (:class:`~verity.rollout.base.RolloutEngine`)."""

    engine: str  # hf, vllm, sglang, ...
    dtype: str | None  # the dtype it serves the policy in
    attention: str | None
    wrappers: tuple[str, ...] = ()  # what wraps it, innermost first: ("agent",)
    tensor_parallel_size: int = 1  # ranks the built engine splits the policy over
    records_routes: bool = False  # it returns a mixture-of-experts model's routes (routing replay)

    @classmethod
    def of(cls, rollout: RolloutEngine) -> RolloutFacts:
        """The facts of ``rollout``."""
        return cls(
            rollout.name,
            rollout.serving_dtype,
            rollout.serving_attention,
            tuple(rollout.wrappers),
            int(rollout.tensor_parallel_size),
            bool(getattr(rollout, "record_routes", False)),
        )


@dataclass
class WorkerReport:
    """One rank of a role: where it computes and what it built.

    Attributes:
        rank: the rank in its worker group.
        device: the torch device string (``cpu``, ``cuda:0``).
        device_name: the runtime's name for the device: a GPU's model, or the CPU's.
        n_params: parameters of the role's model (whole, unsharded).
        n_trainable_params: parameters it trains (fewer with LoRA adapters).
        n_active_params: parameters one token computes with (fewer than ``n_params`` for a
            mixture-of-experts model: the routed experts it does not visit are left out); what
            MFU counts (:func:`verity.hardware.flops.active_parameters`).
        training: the training engine, for a trained role.
        rollout: the rollout engine, for a role that generates.
        reference_engine: what computes the reference log-probs (an engine's name, ``adapters-disabled``).
        skip_zero_advantage: whether the actor's update skips rows whose advantage is 0.
        adapter: the LoRA adapters' settings, described.
        weights_loaded: for a role without a training engine (the reward model): ``streamed``
            (built empty, each rank given its shard by one reader) or ``whole``; None: not told.
        extra: what a plug-in role reported beyond these fields.
    """

    rank: int
    device: str = ""
    device_name: str | None = None
    n_params: int | None = None
    n_trainable_params: int | None = None
    n_active_params: int | None = None
    training: TrainingFacts | None = None
    rollout: RolloutFacts | None = None
    reference_engine: str | None = None
    skip_zero_advantage: bool | None = None
    adapter: str | None = None
    weights_loaded: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_answer(cls, answer: Any) -> WorkerReport:
        """A report from what ``init_model`` answered: a report, or a plug-in's dict (unknown keys into ``extra``)."""
        if isinstance(answer, WorkerReport):
            return answer
        values = dict(answer or {})
        names = {f.name for f in dataclasses.fields(cls)} - {"training", "rollout", "extra"}
        known = {k: values.pop(k) for k in list(values) if k in names}
        known.setdefault("rank", 0)
        return cls(**known, extra=values)

    def ran(self, role: str) -> dict[str, str]:
        """This role's entries of ``summary.json``'s ``ran``: ``{role: engine, f"{role}_compute_dtype": ..., ...}``.

        Only what is there and switched on is named (a run that compiled nothing has no
        ``<role>_compiled_layers``); the rollout's entries are ``rollout``, ``rollout_dtype``, ...
        """
        out: dict[str, str] = {}
        t = self.training
        if t is not None:
            out[role] = t.engine
            if t.sharding:
                out[f"{role}_sharding"] = t.sharding
            if t.model_parallel_nodes:
                out[f"{role}_model_parallel_nodes"] = str(t.model_parallel_nodes)
            out[f"{role}_compute_dtype"] = t.compute_dtype
            if t.attention:
                out[f"{role}_attention"] = t.attention
            if t.compiled_layers:
                out[f"{role}_compiled_layers"] = str(t.compiled_layers)
            if t.compiled_head:
                out[f"{role}_compiled_head"] = "true"
            if t.cuda_graphs:
                out[f"{role}_cuda_graphs"] = "true"
            if t.weights_loaded == "streamed":
                out[f"{role}_weights_loaded"] = "streamed"
            if t.vocab_sharded:
                out[f"{role}_vocab_sharded"] = "true"
            if t.packed:
                out[f"{role}_packed"] = "true"
            if t.sequence_parallel_size > 1:
                out[f"{role}_sequence_parallel_size"] = str(t.sequence_parallel_size)
            if t.moe_layers:
                out[f"{role}_moe_layers"] = str(t.moe_layers)
            if t.routing_replay:
                out[f"{role}_routing_replay"] = "true"
        r = self.rollout
        if r is not None:
            out["rollout"] = r.engine
            if r.dtype:
                out["rollout_dtype"] = r.dtype
            if r.attention:
                out["rollout_attention"] = r.attention
            if r.wrappers:
                out["rollout_wrappers"] = "+".join(r.wrappers)
            if r.tensor_parallel_size > 1:
                out["rollout_tensor_parallel_size"] = str(r.tensor_parallel_size)
            if r.records_routes:
                out["rollout_records_routes"] = "true"
        if self.adapter:
            out[f"{role}_adapter"] = self.adapter
        if self.weights_loaded == "streamed":
            out.setdefault(f"{role}_weights_loaded", "streamed")
        return out
