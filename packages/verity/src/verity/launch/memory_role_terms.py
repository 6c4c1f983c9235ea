"""A worker's memory terms per role: what each training engine and the rollout hold, in bytes.

The term builders of the memory plan (:mod:`verity.launch.memory_plan`): each turns a role's
settings and its model's shape (:class:`~verity.launch.memory_terms.ModelShape`, whose
formulas are in :mod:`verity.launch.memory_terms`) into :class:`Term` s, each held
``resident`` or during one stage, on the device or the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verity.config.derived import rollout_dtype_name
from verity.config.rollout_checks import rollout_replica_size
from verity.engines.logprobs import DEFAULT_CHUNK_TOKENS
from verity.launch.memory_terms import (
    GIB,
    ModelShape,
    activation_bytes,
    ceil_div,
    kv_cache_bytes,
    logprob_head_bytes,
    prefill_bytes,
)

__all__ = [
    "CPU_WORKER_BASELINE_BYTES",
    "RESIDENT",
    "USABLE_FRACTION",
    "RunFacts",
    "Term",
    "on_cpu",
    "reference_terms",
    "rollout_terms",
    "run_facts",
    "trained_terms",
]

#: share of a worker's memory a plan may fill; the rest is the margin (see the module docstring)
USABLE_FRACTION = 0.9
#: resident set of a worker process before it loads a model: Python, torch, transformers, Ray's
#: worker runtime and the verity modules it imports (measured: a Ray actor that imported
#: verity.workers.actor_rollout and transformers' tokenizers held 0.53 GiB, Linux x86-64, torch 2.13
#: CPU build, Ray 2.x), rounded up for the process group, tokenizer and data it then builds
CPU_WORKER_BASELINE_BYTES = int(0.6 * GIB)
#: rows of a log-prob chunk over the vocabulary
LOGPROB_CHUNK_TOKENS = DEFAULT_CHUNK_TOKENS
RESIDENT = "resident"


@dataclass(frozen=True)
class Term:
    """One thing a worker holds: ``name`` (``actor.params``), ``bytes``, the ``stage`` it is held in
    (``resident``: all the time) and ``where`` (``device`` or ``host``)."""

    name: str
    bytes: int
    stage: str = RESIDENT
    where: str = "device"


def _bytes_of(dtype: str | None) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


@dataclass(frozen=True)
class RunFacts:
    """What the terms read of a run config, resolved (sizes in tokens and rows)."""

    master_bytes: int  # model.dtype: the parameters, gradients and AdamW state
    rollout_bytes: int  # rollout.dtype (null: model.dtype)
    accelerator: bool
    prompt: int
    response: int

    @property
    def positions(self) -> int:
        """Tokens of one sequence: prompt + response."""
        return self.prompt + self.response


def run_facts(cfg: Any, backend_name: str) -> RunFacts:
    return RunFacts(
        master_bytes=_bytes_of(cfg.model.dtype),
        rollout_bytes=_bytes_of(rollout_dtype_name(cfg, on_accelerator=backend_name != "cpu")),
        accelerator=backend_name != "cpu",
        prompt=int(cfg.data.max_prompt_length),
        response=int(cfg.data.max_response_length),
    )


def _mixed_precision(options: Any, backend_name: str) -> bool:
    value = getattr(options, "mixed_precision", None)
    return backend_name in ("cuda", "rocm") if value is None else bool(value)


def _micro_rows(options: Any, micro_batch_size: int, positions: int) -> int:
    """Rows of one micro-batch: ``micro_batch_size``, fewer under ``micro_batch_tokens`` (at least one row)."""
    budget = int(getattr(options, "micro_batch_tokens", 0) or 0)
    if budget <= 0:
        return micro_batch_size
    return max(1, min(micro_batch_size, budget // positions))


# ------------------------------------------------------------------ one trained engine's terms


def trained_terms(
    name: str,
    stage: str,
    cfg: Any,
    run: RunFacts,
    shape: ModelShape,
    *,
    engine: str,
    options: Any,
    pool_size: int,
    micro_batch_size: int,
    trainable: bool,
    vocab_head: bool,
    backend_name: str,
) -> list[Term]:
    """A training engine's terms (``trainable=False``: a frozen one, the reference: parameters only)."""
    n_params = shape.n_params if vocab_head else shape.n_params - shape.lm_head_params + shape.hidden
    megatron = engine == "megatron"
    if megatron:
        tp = int(getattr(options, "tensor_parallel_size", 1))
        pp = int(getattr(options, "pipeline_parallel_size", 1))
        split, mixed = tp * pp, False
    else:
        tp = pp = 1
        sharded = getattr(options, "sharding", "full") == "full" and pool_size > 1
        split, mixed = (pool_size if sharded else 1), _mixed_precision(options, backend_name)
    compute = 2 if (mixed or run.master_bytes == 2) else 4
    offload_params = bool(getattr(options, "offload_params", False))
    offload_optimizer = offload_params or bool(getattr(options, "offload_optimizer", False))
    state = "host" if offload_params else "device"
    params = ceil_div(n_params * run.master_bytes, split)
    terms = [Term(f"{name}.params", params, RESIDENT, state)]
    # fsdp2.shard_vocab: the embedding (and an untied output layer) stay in their row shards, never gathered
    vocab_setting = getattr(options, "shard_vocab", False)
    if vocab_setting is None:  # the engine's default: on for a CPU run
        vocab_setting = backend_name == "cpu"
    shard_vocab = not megatron and split > 1 and bool(vocab_setting)
    vocab_weights = shape.vocab * shape.hidden * (2 if vocab_head and not shape.tied else 1)
    if not megatron and split > 1:  # FSDP2 all-gathers the root unit and two layers at a time
        root = shape.root_params - (vocab_weights if shard_vocab else 0)
        gathered = (root + 2 * shape.layer_params) * compute + shape.layer_params * 4
        terms.append(Term(f"{name}.gathered_weights", gathered, stage if trainable else f"{stage}_forward"))
    elif mixed and trainable:  # autocast keeps a bf16 copy of every weight through forward and backward
        terms.append(Term(f"{name}.bf16_weight_copies", n_params * 2, stage))
    if not trainable:
        return terms
    lora = getattr(cfg.actor, "lora", None) if name == "actor" else None
    if lora is not None and lora.enabled:
        trained = 0  # adapters only: their gradients and AdamW state are under 1% of the base's
    else:
        trained = params
    terms.append(Term(f"{name}.grads", trained, stage, state))
    terms.append(Term(f"{name}.optimizer", 2 * trained, RESIDENT, "host" if offload_optimizer else "device"))
    rows = _micro_rows(options, micro_batch_size, run.positions)
    tokens = rows * run.positions
    attn = getattr(options, "attn_implementation", None) or cfg.model.attn_implementation
    eager = run.positions if attn == "eager" else 0
    checkpointing = bool(cfg.model.gradient_checkpointing)
    acts = activation_bytes(shape, tokens, compute, checkpointing=checkpointing, eager_positions=eager)
    if megatron:  # GPipe: pp micro-batches in flight, each stage L / pp layers, widths split over tp
        acts = ceil_div(acts, tp)
    terms.append(Term(f"{name}.activations", acts, stage))
    if trained:
        # the token embedding's gradient is dense and whole on every rank before FSDP reduces it: with
        # tied embeddings the lookup's [V, H] gradient, the output layer's and their sum (measured: about
        # 3 x V x H x 4 bytes above the gradients in one process, at 152k tokens); untied, two. Under
        # shard_vocab each rank computes only its rows' share of them
        whole = (3 if shape.tied else 2) * shape.vocab * shape.hidden * 4
        terms.append(Term(f"{name}.embedding_grads", ceil_div(whole, split) if shard_vocab else whole, stage))
    if vocab_head:
        scored = rows * (run.response + 1)
        entropy_grad = name == "actor" and bool(cfg.actor.entropy_coeff)
        head = logprob_head_bytes(shape, scored, compute, LOGPROB_CHUNK_TOKENS, entropy_grad=entropy_grad)
        terms.append(Term(f"{name}.logprob_head", ceil_div(head, tp), stage))
        if shard_vocab:  # the logits' all-to-all: every rank's tokens x this rank's columns, sent and received
            terms.append(Term(f"{name}.vocab_exchange", 2 * scored * shape.vocab * compute, stage))
    return terms


# ------------------------------------------------------------------ the rollout's terms


def rollout_terms(
    cfg: Any, run: RunFacts, shape: ModelShape, dp: int, capacity: int | None, *, own_pool: bool
) -> list[Term]:
    """The rollout's weights and KV cache per rank; in the actor's workers on an accelerator only while generating."""
    r, d = cfg.rollout, cfg.data
    sleeps = run.accelerator and not own_pool
    stage = "generate" if sleeps else RESIDENT
    engine = r.engine
    if engine in ("vllm", "sglang"):
        opts = getattr(r, engine)
        # the engine's own GPUs, or (sync mode, vLLM) the replica of actor ranks it spans; one of them is 1
        tp = int(getattr(opts, "tensor_parallel_size", 1)) * rollout_replica_size(cfg)
        weights = ceil_div(shape.n_params * run.rollout_bytes, tp)
        kv = getattr(opts, "kv_cache_bytes", None) if engine == "vllm" else None
        fraction = opts.gpu_memory_utilization if engine == "vllm" else opts.mem_fraction_static
        if kv is None and capacity is not None and run.accelerator:
            # the engine takes this share of the device for weights and cache together
            reserved = int(fraction * capacity / USABLE_FRACTION)
            return [Term(f"rollout.{engine}_reserved", max(reserved, weights), stage)]
        terms = [Term("rollout.weights", weights, stage)]
        if kv is not None:
            terms.append(Term("rollout.kv_cache", int(kv), stage))
        if sleeps and getattr(opts, "sleep_level", 1) == 1:
            terms.append(Term("rollout.weights_asleep", weights, RESIDENT, "host"))
        return terms
    # the HF engine: a full copy of the policy per rank, or with rollout.tensor_parallel_size = tp a
    # 1/tp slice (the norms, a few KiB, are whole on every rank), its KV cache's heads split alike
    tp = int(r.tensor_parallel_size)
    weights = ceil_div(shape.n_params * run.rollout_bytes, tp)
    # colocated, the HF engine holds its weights only from a weight sync to the end of generate: asleep
    # they are in host memory on an accelerator, released on a CPU (HFRollout.sleep)
    released = not own_pool
    stage = "generate" if released else RESIDENT
    replicas = max(1, dp // tp)  # the prompts are split over replicas, each rank of one sees them all
    rows_per_rank = max(
        ceil_div(d.train_batch_size * r.n, replicas), ceil_div(d.val_batch_size * r.val_n, replicas)
    )
    rows = max(1, min(int(r.micro_batch_size), rows_per_rank))
    prompts = max(1, ceil_div(rows, int(r.n)))  # a group's prompt is prefilled once
    terms = [
        Term("rollout.weights", weights, stage),
        Term(
            "rollout.kv_cache",
            ceil_div(kv_cache_bytes(shape, rows, run.positions, run.rollout_bytes), tp),
            "generate",
        ),
        Term("rollout.prefill", prefill_bytes(shape, prompts, run.prompt, run.rollout_bytes), "generate"),
    ]
    if released:  # the sync at the end of the update refills them, one gathered bucket at a time
        terms.append(Term("rollout.weights_at_sync", weights, "weight_sync"))
        bucket = min(int(r.sync_bucket_mb) * 2**20, shape.n_params * run.master_bytes)
        # one process: the buckets are views of the weights; several: the gathered chunks, the
        # collective's own staging copy (gloo; not NCCL) and the full tensors cut from them. A
        # tensor larger than the bucket (the embedding) comes alone and is gathered in place, once.
        # With tp ranks per replica each rank sends, receives and keeps 1/tp of each bucket; a lone
        # tensor's slice is held twice, the all-to-all's send and receive buffers
        copies = 0 if dp == 1 else (2 if run.accelerator else 3)
        lone = shape.vocab * shape.hidden * run.rollout_bytes * (2 if tp > 1 else 1)
        largest = lone if dp > 1 and lone > bucket else 0
        terms.append(Term("rollout.sync_buckets", ceil_div(max(copies * bucket, largest), tp), "weight_sync"))
    if sleeps:
        terms.append(Term("rollout.weights_asleep", weights, RESIDENT, "host"))
    return terms


# ------------------------------------------------------------------ the plan


def reference_terms(
    cfg: Any, run: RunFacts, shape: ModelShape, n_workers: int, backend_name: str
) -> list[Term]:
    """The frozen reference: an engine of the actor's kind over the same model, sharded like it."""
    engine = cfg.actor.engine
    section = getattr(cfg, "reference", None)
    options = getattr(section, engine, None) if section is not None else None
    options = options if options is not None else getattr(cfg.actor, engine, None)
    terms = trained_terms(
        "reference",
        "compute_ref_log_prob",
        cfg,
        run,
        shape,
        engine=engine,
        options=options,
        pool_size=n_workers,
        micro_batch_size=cfg.actor.micro_batch_size,
        trainable=False,
        vocab_head=True,
        backend_name=backend_name,
    )
    return on_cpu(terms, run)


def on_cpu(terms: list[Term], run: RunFacts) -> list[Term]:
    """On a CPU every term is host memory."""
    if run.accelerator:
        return terms
    return [Term(t.name, t.bytes, t.stage, "host") for t in terms]
