"""The memory plan: each worker's estimated peak for its roles, checked against its memory before any worker starts.

    plan = plan_memory(cfg, shapes, backend_name="cuda", capacity=MemoryCapacity.declared(80 * GIB))
    print(plan.describe())      # per pool: the terms in GiB, the peak and the stage it falls in
    plan.check()                # ConfigError (exit 2), one sentence, when a worker cannot fit

A worker is one process of a pool (:mod:`verity.launch.pools`): the actor's holds the actor, its
rollout (``trainer.mode=sync``) and the reference (a KL term, no LoRA), plus any role colocated
with it (the critic, the reward model); a ``separate`` role's holds that role alone. Its memory is
a list of :class:`Term` s in bytes (:mod:`verity.launch.memory_terms` has the formulas), each
held ``resident`` (from start to end) or only during one stage (``generate``, ``update_actor``,
...). The peak is the resident terms plus the largest stage's; on an accelerator it is counted on
the device, with what offload or a sleeping rollout moves to the host reported beside it.

Memory per worker: an accelerator's total memory (detected on this machine, or
``trainer.device_memory_gb`` for a cluster being planned); on a CPU the host's memory (the
smaller of RAM and the cgroup limit) divided by the workers of a node. A plan fits when every
worker's peak is at most :data:`USABLE_FRACTION` of it: the rest is the margin for what the
estimate leaves out (an accelerator's context and communication buffers, allocator
fragmentation; on a CPU the driver, Ray's own processes and the page cache).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verity.config.derived import rollout_dtype_name
from verity.config.errors import ConfigError
from verity.launch.memory_role_terms import (
    CPU_WORKER_BASELINE_BYTES,
    RESIDENT,
    USABLE_FRACTION,
    RunFacts,
    Term,
    on_cpu,
    reference_terms,
    rollout_terms,
    run_facts,
    trained_terms,
)
from verity.launch.memory_terms import (
    GIB,
    ModelShape,
    ceil_div,
    gib,
    prefill_bytes,
)

__all__ = [
    "CPU_WORKER_BASELINE_BYTES",
    "USABLE_FRACTION",
    "MemoryCapacity",
    "MemoryPlan",
    "Term",
    "WorkerPlan",
    "host_memory_bytes",
    "model_shapes",
    "plan_memory",
]


@dataclass
class WorkerPlan:
    """The estimate for every worker of one pool (they hold the same): its terms in bytes."""

    pool: str
    roles: tuple[str, ...]
    n_workers: int
    terms: list[Term] = field(default_factory=list)

    def peak(self, where: str = "device") -> tuple[int, str]:
        """``(bytes, stage)``: the resident terms plus the largest stage's, on ``where``."""
        resident = sum(t.bytes for t in self.terms if t.where == where and t.stage == RESIDENT)
        stages: dict[str, int] = {}
        for t in self.terms:
            if t.where == where and t.stage != RESIDENT:
                stages[t.stage] = stages.get(t.stage, 0) + t.bytes
        if not stages:
            return resident, RESIDENT
        stage = max(stages, key=lambda s: stages[s])
        return resident + stages[stage], stage

    def largest(self, where: str = "device") -> Term | None:
        """The largest term counted in the peak on ``where`` (resident, or in the peak's stage)."""
        _, stage = self.peak(where)
        counted = [t for t in self.terms if t.where == where and t.stage in (RESIDENT, stage)]
        return max(counted, key=lambda t: t.bytes, default=None)


@dataclass(frozen=True)
class MemoryCapacity:
    """The memory one worker has, in bytes (None: unknown), and where the figure comes from."""

    per_worker: int | None
    source: str

    @classmethod
    def declared(cls, total: int, on_cpu: bool = False) -> MemoryCapacity:
        """``trainer.device_memory_gb``: an accelerator's memory, or on a CPU each worker's share."""
        what = "each worker's share of the host" if on_cpu else "per device"
        return cls(total, f"trainer.device_memory_gb = {total / GIB:g} GiB {what}")


def host_memory_bytes() -> int:
    """This machine's memory a process may use: physical RAM, or the cgroup's limit when smaller (0: unknown)."""
    try:
        total = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        total = 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (total or math.inf):
            total = int(text)
    return total


def detect_capacity(cfg: Any, backend: Any, workers_per_node: int) -> MemoryCapacity:
    """The memory of one worker: ``trainer.device_memory_gb`` when set, else measured here.

    ``backend``: the run's :mod:`verity.hardware` backend (its device 0 is measured; a backend
    absent here gives an unknown capacity). On a CPU: host memory / ``workers_per_node``.
    """
    declared = getattr(cfg.trainer, "device_memory_gb", None)
    on_cpu = backend.name == "cpu"
    if declared is not None:
        return MemoryCapacity.declared(int(float(declared) * GIB), on_cpu)
    if on_cpu:
        total = host_memory_bytes()
        if not total:
            return MemoryCapacity(None, "host memory unknown (set trainer.device_memory_gb)")
        share = total // max(1, workers_per_node)
        return MemoryCapacity(
            share, f"host memory {gib(total):g} GiB / {workers_per_node} worker(s) on a node"
        )
    try:
        total = int(backend.memory_stats(0)["total"])
    except Exception:  # a device this machine lacks (planning a cluster from a laptop)
        total = 0
    if not total:
        return MemoryCapacity(None, f"{backend.name} memory unknown here (set trainer.device_memory_gb)")
    return MemoryCapacity(total, f"{backend.device_name(0)}: {gib(total):g} GiB detected")


# ------------------------------------------------------------------ the run's settings, read once


@dataclass
class MemoryPlan:
    """Every pool's :class:`WorkerPlan` and the memory each worker has (``capacity``)."""

    backend: str
    workers: list[WorkerPlan]
    capacity: MemoryCapacity
    cfg: Any = None  # the run config the plan was made for (the refusal names settings it has not tried)
    notes: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        """Where the peak that must fit is counted: ``device`` on an accelerator, ``host`` on a CPU."""
        return "host" if self.backend == "cpu" else "device"

    @property
    def usable(self) -> int | None:
        """Bytes a worker's peak may reach: :data:`USABLE_FRACTION` of its capacity."""
        per = self.capacity.per_worker
        return None if per is None else int(per * USABLE_FRACTION)

    def overflowing(self) -> list[WorkerPlan]:
        """The pools whose peak exceeds the usable memory (none when the capacity is unknown)."""
        if self.usable is None:
            return []
        return [w for w in self.workers if w.peak(self.where)[0] > self.usable]

    def fits(self) -> bool | None:
        """True / False; None when the memory per worker is unknown."""
        return None if self.usable is None else not self.overflowing()

    def refusal(self) -> str | None:
        """One sentence naming the first worker that cannot fit, its largest term and what would make it fit."""
        over = self.overflowing()
        if not over:
            return None
        worker = max(over, key=lambda w: w.peak(self.where)[0])
        peak, stage = worker.peak(self.where)
        largest = worker.largest(self.where)
        assert largest is not None and self.usable is not None and self.capacity.per_worker is not None
        return (
            f"the memory plan does not fit: each {'+'.join(worker.roles)} worker needs about {gib(peak):g} GiB "
            f"of {self.where} memory at its peak ({stage}) but has {gib(self.usable):g} GiB usable "
            f"({USABLE_FRACTION:.0%} of {self.capacity.source}); its largest term is {largest.name} "
            f"({gib(largest.bytes):g} GiB), so {_remedy(largest.name, self.cfg)}"
        )

    def check(self) -> None:
        """Raise :class:`ConfigError` with :meth:`refusal`'s sentence when a worker cannot fit."""
        sentence = self.refusal()
        if sentence is not None:
            raise ConfigError(sentence)

    def describe(self) -> str:
        """The plan as lines: per pool its peak, then every term in GiB with its stage."""
        usable = "unknown" if self.usable is None else f"{gib(self.usable):g} GiB usable"
        lines = [f"memory per worker: {self.capacity.source}; {usable} ({USABLE_FRACTION:.0%})"]
        for w in self.workers:
            peak, stage = w.peak(self.where)
            host, _ = w.peak("host")
            verdict = ""
            if self.usable is not None:
                verdict = "  fits" if peak <= self.usable else "  DOES NOT FIT"
            extra = f", host {gib(host):g} GiB" if self.where == "device" else ""
            lines.append(
                f"{w.pool} ({'+'.join(w.roles)}) x {w.n_workers}: peak {gib(peak):g} GiB {self.where} "
                f"in {stage}{extra}{verdict}"
            )
            for t in sorted(w.terms, key=lambda t: -t.bytes):
                lines.append(f"  {t.name:<28} {_size(t.bytes):>7} GiB  {t.where:<6} {t.stage}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def record(self) -> dict[str, float]:
        """``plan/<pool>/<term>_gb`` (terms of one stage summed by name), ``plan/<pool>/peak_gb``,
        ``plan/<pool>/host_gb`` and ``plan/capacity_gb``: to compare with the measured ``memory/*_gb``."""
        out: dict[str, float] = {}
        for w in self.workers:
            for t in w.terms:
                key = f"plan/{w.pool}/{t.name}_gb" + (
                    "_host" if t.where == "host" and self.where == "device" else ""
                )
                out[key] = round(out.get(key, 0.0) + t.bytes / GIB, 3)
            out[f"plan/{w.pool}/peak_gb"] = round(w.peak(self.where)[0] / GIB, 3)
            if self.where == "device":
                out[f"plan/{w.pool}/host_gb"] = round(w.peak("host")[0] / GIB, 3)
        if self.capacity.per_worker is not None:
            out["plan/capacity_gb"] = round(self.capacity.per_worker / GIB, 3)
        return out


_REMEDIES = {
    "params": "more workers to shard it over (trainer.nnodes / trainer.n_workers_per_node){offload}, "
    "or tensor parallelism (actor.engine=megatron, actor.megatron.tensor_parallel_size)",
    "activations": "fewer tokens per micro-batch (actor.fsdp2.micro_batch_tokens, actor.micro_batch_size){ckpt}, "
    "or shorter data.max_prompt_length / max_response_length",
    "logprob_head": "fewer tokens per micro-batch (actor.fsdp2.micro_batch_tokens, actor.micro_batch_size)",
    "kv_cache": "fewer rows per generate call (rollout.micro_batch_size) or a shorter data.max_response_length",
    "reserved": "a smaller rollout.vllm.gpu_memory_utilization (or rollout.sglang.mem_fraction_static)",
    "baseline": "fewer workers per node (trainer.n_workers_per_node) or a larger trainer.device_memory_gb",
    "vocab": "the vocabulary sharded by rows (actor.fsdp2.shard_vocab=true, several workers), "
    "or more workers to shard the rest over (trainer.nnodes / trainer.n_workers_per_node)",
}


def _shards_vocab(cfg: Any, role: str) -> bool:
    """Whether ``role``'s FSDP2 settings already shard the vocabulary (``fsdp2.shard_vocab``)."""
    section = getattr(cfg, "actor" if role == "reference" else role, None)
    setting = getattr(getattr(section, "fsdp2", None), "shard_vocab", True)
    return cfg.trainer.device == "cpu" if setting is None else bool(setting)


def _remedy(term: str, cfg: Any) -> str:
    """What would make a worker whose largest term is ``term`` fit, among the settings ``cfg`` has not tried."""
    from verity.engines.options import FSDP2Options

    role, _, what = term.partition(".")
    if role == "rollout" and what in ("weights", "prefill"):
        tries = (
            []
            if rollout_dtype_name(cfg, cfg.trainer.device != "cpu") == "bfloat16"
            else ["rollout.dtype=bfloat16"]
        )
        tp = int(cfg.rollout.tensor_parallel_size)
        tries.append(f"a larger rollout.tensor_parallel_size (now {tp}; each rank holds 1/size of the policy)")
        tries.append("trainer.mode=async (the rollout on devices of its own, rollout.n_workers)")
        held = "a full copy of the policy" if tp == 1 else f"1/{tp} of the policy"
        return f"the rollout holds {held} on every device: try {' or '.join(tries)}, or devices with more memory"
    if role == "reward_model":  # no engine settings of its own: it shards over its group's ranks
        return (
            "it would fit with more ranks to shard the reward model over (reward_model.placement=separate "
            "with reward_model.n_workers / reward_model.nnodes, safetensors weights) or a smaller "
            "reward_model.micro_batch_size / reward_model.max_length"
        )
    if role == "rollout":
        key = "kv_cache" if what == "kv_cache" else "reserved"
    elif what in ("activations", "logprob_head"):
        key = what
    elif role == "process":
        key = "baseline"
    elif what in ("embedding_grads", "gathered_weights") and not _shards_vocab(cfg, role):
        key = "vocab"
    else:
        key = "params"
    fields = getattr(FSDP2Options, "__dataclass_fields__", {})
    offload = (
        ", offload to the host (actor.fsdp2.offload_params / offload_optimizer)"
        if "offload_params" in fields or "offload_optimizer" in fields
        else ""
    )
    ckpt = "" if cfg.model.gradient_checkpointing else ", model.gradient_checkpointing=true"
    fix = _REMEDIES[key].format(offload=offload, ckpt=ckpt)
    if role == "critic":
        fix = fix.replace("actor.fsdp2", f"{role}.fsdp2").replace(
            "actor.micro_batch_size", f"{role}.micro_batch_size"
        )
    return f"it would fit with {fix}"


def plan_memory(
    cfg: Any,
    shapes: Mapping[str, ModelShape],
    pools: Mapping[str, tuple[tuple[str, ...], int]],
    backend_name: str,
    capacity: MemoryCapacity,
) -> MemoryPlan:
    """Estimate every pool's worker memory for ``cfg``.

    ``shapes``: the model shapes by role (``actor``; ``critic`` and ``reward_model`` when they
    run); ``pools``: ``{pool: (roles in it, n_workers)}``, the actor's pool first
    (:func:`verity.launch.pools.role_shapes`); ``backend_name``: ``cpu``, ``cuda``, ``rocm``,
    ``npu``. Roles the estimator does not know (a plug-in's) are named in ``notes``.
    """
    run = run_facts(cfg, backend_name)
    plan = MemoryPlan(backend_name, [], capacity, cfg)
    kl = cfg.algorithm.kl
    for pool, (roles, n_workers) in pools.items():
        worker = WorkerPlan(pool, tuple(roles), n_workers)
        for role in roles:
            worker.terms += _role_terms(role, cfg, run, shapes, n_workers, backend_name, capacity, plan)
        if "actor" in roles and (kl.use_kl_loss or kl.use_kl_in_reward) and not cfg.actor.lora.enabled:
            worker.terms += reference_terms(cfg, run, shapes["actor"], n_workers, backend_name)
        worker.terms.append(Term("process.baseline", CPU_WORKER_BASELINE_BYTES, RESIDENT, "host"))
        plan.workers.append(worker)
    return plan


def _role_terms(
    role: str,
    cfg: Any,
    run: RunFacts,
    shapes: Mapping[str, ModelShape],
    n_workers: int,
    backend_name: str,
    capacity: MemoryCapacity,
    plan: MemoryPlan,
) -> list[Term]:
    if role == "actor":
        options = getattr(cfg.actor, cfg.actor.engine, None)
        terms = trained_terms(
            "actor",
            "update_actor",
            cfg,
            run,
            shapes["actor"],
            engine=cfg.actor.engine,
            options=options,
            pool_size=n_workers,
            micro_batch_size=cfg.actor.micro_batch_size,
            trainable=True,
            vocab_head=True,
            backend_name=backend_name,
        )
        if cfg.trainer.mode != "async":
            dp = n_workers
            if cfg.actor.engine == "megatron":
                dp = max(
                    1,
                    n_workers
                    // max(1, int(options.tensor_parallel_size) * int(options.pipeline_parallel_size)),
                )
            terms += rollout_terms(cfg, run, shapes["actor"], dp, capacity.per_worker, own_pool=False)
        return on_cpu(terms, run)
    if role == "rollout":
        return on_cpu(
            rollout_terms(cfg, run, shapes["actor"], n_workers, capacity.per_worker, own_pool=True), run
        )
    if role == "critic":
        c = cfg.critic
        terms = trained_terms(
            "critic",
            "update_critic",
            cfg,
            run,
            shapes["critic"],
            engine=c.engine,
            options=getattr(c, c.engine, None),
            pool_size=n_workers,
            micro_batch_size=c.micro_batch_size,
            trainable=True,
            vocab_head=False,
            backend_name=backend_name,
        )
        return on_cpu(terms, run)
    if role == "reward_model":
        rm, shape = cfg.reward_model, shapes["reward_model"]
        # several ranks and a safetensors folder: FSDP2-sharded over them (verity.workers.reward_model)
        split = n_workers if n_workers > 1 and _streams(rm.model_path) else 1
        params = ceil_div((shape.n_params - shape.lm_head_params) * run.master_bytes, split)
        terms = [Term("reward_model.params", params)]
        if split > 1:  # each pass gathers the backbone's root (embedding, final norm) and two layers
            gathered = (shape.root_params - shape.lm_head_params + 2 * shape.layer_params) * run.master_bytes
            terms.append(Term("reward_model.gathered_weights", gathered, "compute_rm_score"))
        forward = prefill_bytes(shape, int(rm.micro_batch_size), int(rm.max_length), run.master_bytes)
        terms.append(Term("reward_model.forward", forward, "compute_rm_score"))
        return on_cpu(terms, run)
    plan.notes.append(
        f"role {role!r} is not estimated (the memory plan knows actor, rollout, critic, reward_model)"
    )
    return []


def _streams(path: str | None) -> bool:
    """Whether a sharded role builds the model at ``path`` empty and fills it shard by shard (safetensors)."""
    from verity.engines.model_source import ModelSource

    return bool(path) and ModelSource(os.path.expanduser(str(path))).streams


def model_shapes(cfg: Any, model: Any) -> dict[str, ModelShape]:
    """The shapes of the models a run loads (the policy; the critic's and reward model's when they run),
    counted on the meta device from their ``config.json``. ``model``: the resolved policy folder, or
    its HF config object (an embedded preset not built yet)."""
    from transformers import AutoConfig

    from verity.config.derived import needs_critic

    def shape(path: Any) -> ModelShape:
        config = AutoConfig.from_pretrained(path, local_files_only=True) if isinstance(path, str) else path
        return ModelShape.from_hf_config(config)

    shapes = {"actor": shape(model)}
    if needs_critic(cfg):
        critic = cfg.critic.model_path
        shapes["critic"] = shapes["actor"] if critic is None else shape(os.path.expanduser(critic))
    if cfg.reward_model.enabled and cfg.reward_model.model_path:
        shapes["reward_model"] = shape(os.path.expanduser(cfg.reward_model.model_path))
    return shapes


def run_pools(cfg: Any) -> dict[str, tuple[tuple[str, ...], int]]:
    """``{pool: (roles, n_workers)}`` of this run: the actor's pool with its colocated roles, then each
    separate role's (:func:`verity.launch.pools.role_shapes`)."""
    from verity.launch.pools import ACTOR_POOL, role_shapes

    shapes = role_shapes(cfg)
    colocated = tuple(name for name, shape in shapes.items() if shape.placement == "colocated")
    pools = {ACTOR_POOL: (colocated, shapes["actor"].n_workers)}
    for name, shape in shapes.items():
        if shape.placement == "separate":
            pools[name] = ((name,), shape.n_workers)
    return pools


def workers_per_node(cfg: Any) -> int:
    """Worker processes of every pool on one node, at most: each pool's workers over its nodes
    (``nnodes`` unset: all on one node, the most a node may get)."""
    from verity.config.cluster_checks import actor_workers_per_node
    from verity.launch.pools import role_shapes

    total = actor_workers_per_node(cfg) or cfg.trainer.n_workers
    for shape in role_shapes(cfg).values():
        if shape.placement == "separate":
            total += ceil_div(shape.n_workers, shape.nnodes or 1)
    return max(1, total)


def plan_for_run(cfg: Any, model: Any, backend: Any) -> MemoryPlan:
    """The memory plan of the run ``cfg`` on ``backend`` (a :mod:`verity.hardware` backend), its model
    at ``model`` (a resolved local folder, or an HF config); memory per worker from :func:`detect_capacity`."""
    capacity = detect_capacity(cfg, backend, workers_per_node(cfg))
    return plan_memory(cfg, model_shapes(cfg, model), run_pools(cfg), backend.name, capacity)


def policy_model(cfg: Any) -> Any:
    """What :func:`plan_for_run` reads the policy from without building anything: ``model.path``, or for
    ``model.path=embedded`` the preset's HF config (a fresh model of its shape, built in memory)."""
    if cfg.model.path != "embedded":
        return os.path.expanduser(cfg.model.path)
    from verity.data.embedded import embedded_preset

    model, _ = embedded_preset(cfg.model.embedded_preset).fresh_model(cfg.trainer.seed)
    return model.config


def _size(n: int) -> str:
    """Bytes as GiB: two decimals below 10 GiB, one above."""
    value = n / GIB
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"
