"""Settings owned by the built-in training engines, one small dataclass each.

A role's config section holds the built-in engines' settings as fields named after
the engine (``actor.fsdp2.reshard_after_forward``); the engine the role runs
(``actor.engine``) reads its own; a setting changed in another engine's section is
rejected before the run (:mod:`verity.config.idle_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ATTN_IMPLEMENTATIONS", "FSDP2Options", "MegatronOptions"]

# the HF attention kernels a model may be loaded or switched to
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass
class FSDP2Options:
    """FSDP2 (``torch.distributed.fsdp.fully_shard`` per decoder layer)."""

    # free each layer's gathered weights after forward: less memory, one more all-gather in backward
    reshard_after_forward: bool = True
    # bf16 compute with fp32 gradient reduction and master weights; null: on for CUDA, off on CPU
    mixed_precision: bool | None = None
    # full: parameters, gradients and AdamW state sharded over the ranks (FSDP) | replicate: a full
    # copy per rank, gradients summed in one all-reduce per optimizer step (faster for small models)
    sharding: str = "full"
    # most positions (rows x padding-free window) per micro-batch, on top of the role's
    # micro_batch_size rows; 0: rows only. On CPU ~2k positions keep activations cache- and
    # allocator-friendly (docs/engines.md, "Micro-batches by tokens")
    micro_batch_tokens: int = 0
    # the attention kernel this engine's copy of the model computes with; null: model.attn_implementation.
    # The rollout keeps its own (on CPU under bf16, eager trains faster and sdpa decodes faster)
    attn_implementation: str | None = None
    # torch.compile (inductor) each decoder layer: fused elementwise kernels, same weights and names.
    # The first pass pays the compile (tens of seconds); on CPU it needs a C++ compiler (docs/engines.md)
    compile: bool = False
    # with compile=true on a CUDA device: replay each compiled layer's training forward and backward
    # as CUDA graphs (one launch per layer, not per kernel). Unsharded layers only (one worker or
    # sharding=replicate), no gradient checkpointing; a graph is recorded per micro-batch shape
    cuda_graphs: bool = False
    # keep this rank's shard of the fp32 parameters and gradients in pinned host memory (FSDP2's
    # CPUOffloadPolicy), copied to the device per layer in use; AdamW then steps on the CPU. Saves
    # 16 B per parameter / ranks of device memory; an accelerator and sharding=full only (docs/engines.md, "Offload")
    offload_params: bool = False
    # move AdamW's state (8 B per parameter / ranks) to host memory after each update phase and back
    # before the next optimizer step; an accelerator only, and not with offload_params (docs/engines.md, "Offload")
    offload_optimizer: bool = False
    # under sharding=full on several ranks: each rank keeps only its rows of the input embedding and the
    # output layer, never gathered whole; the micro-batch's tokens and logits travel instead. Saves
    # (1 - 1/ranks) of the vocabulary's weights and gradients per rank; null: on for CPU (gloo) runs,
    # off on accelerators, where it is not measured yet (docs/engines.md, "Vocabulary sharding")
    shard_vocab: bool | None = None
    # run log-prob, value and training passes on the packed (padding-free) layout: each micro-batch's
    # real tokens back to back in one sequence, attention kept inside each row; micro_batch_tokens then
    # counts real tokens. null: on for a CPU device (measured faster), off on accelerators (not measured
    # yet) and with an attn_implementation other than sdpa (packing attends through its own kernel);
    # images keep the padded layout; forced on by ulysses_sequence_parallel_size > 1, which refuses
    # false (docs/engines.md, "Packed sequences")
    packed: bool | None = None
    # Ulysses sequence parallelism: this many consecutive ranks (inside a node) split each packed
    # micro-batch by tokens and exchange heads around attention (the packed layout: packed=false is
    # refused); rows are data-parallel, and token-balanced, over the n_workers / size groups. Must divide the workers, the workers per node, the attention heads and
    # the key/value heads; text models only. 1: off (docs/engines.md, "Sequence parallelism (Ulysses)")
    ulysses_sequence_parallel_size: int = 1

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that is out of range."""
        for key in ("compile", "cuda_graphs", "offload_params", "offload_optimizer"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"fsdp2.{key} must be true or false, got {getattr(self, key)!r}")
        if self.cuda_graphs and not self.compile:
            raise ValueError("fsdp2.cuda_graphs=true replays the compiled layers: set fsdp2.compile=true as well")
        if self.sharding not in ("full", "replicate"):
            raise ValueError(f"fsdp2.sharding must be 'full' or 'replicate', got {self.sharding!r}")
        if self.offload_params and self.offload_optimizer:
            raise ValueError(
                "fsdp2.offload_params=true already keeps the AdamW state in host memory (the optimizer steps "
                "on the CPU); set fsdp2.offload_optimizer=false"
            )
        if self.offload_params and self.sharding != "full":
            raise ValueError(
                f"fsdp2.offload_params=true is FSDP2's offload policy for sharded layers, and "
                f"fsdp2.sharding={self.sharding} keeps a whole copy on every device; set fsdp2.sharding=full"
            )
        if self.offload_params and self.cuda_graphs:
            raise ValueError(
                "fsdp2.offload_params=true with fsdp2.cuda_graphs=true: the graphs replay fixed device "
                "addresses of weights that offload keeps in host memory; switch one off"
            )
        if self.packed is not None and not isinstance(self.packed, bool):
            raise ValueError(f"fsdp2.packed must be true, false or null, got {self.packed!r}")
        if self.shard_vocab is not None and not isinstance(self.shard_vocab, bool):
            raise ValueError(f"fsdp2.shard_vocab must be true, false or null, got {self.shard_vocab!r}")
        if self.shard_vocab and (self.sharding != "full" or self.offload_params):
            raise ValueError(
                "fsdp2.shard_vocab=true shards the vocabulary rows on the device like full sharding: it needs "
                f"fsdp2.sharding=full (got {self.sharding}) and fsdp2.offload_params=false"
            )
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"fsdp2.attn_implementation must be null or one of {'|'.join(ATTN_IMPLEMENTATIONS)}, "
                f"got {self.attn_implementation!r}"
            )
        if self.packed and self.attn_implementation not in (None, "sdpa", "flash_attention_2", "flash_attention_3"):
            raise ValueError(
                f"fsdp2.packed=true attends through its own kernel, but fsdp2.attn_implementation="
                f"{self.attn_implementation} was asked for: set fsdp2.packed=false to keep it, or "
                "fsdp2.attn_implementation=null"
            )
        size = self.ulysses_sequence_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"fsdp2.ulysses_sequence_parallel_size must be an int >= 1 (1: off), got {size!r}"
            )
        if size > 1 and self.compile:
            raise ValueError(
                f"fsdp2.ulysses_sequence_parallel_size={size} with fsdp2.compile=true is not supported yet "
                "(the compiled layers would trace the all-to-all exchanges); set one of them off"
            )
        tokens = self.micro_batch_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"fsdp2.micro_batch_tokens must be an int >= 0 (0: rows only), got {tokens!r}")


@dataclass
class MegatronOptions:
    """How the Megatron-core engine splits a model over the ranks of its process group.

    The world (every rank of the default ``torch.distributed`` group) is cut into
    ``tensor_parallel_size x pipeline_parallel_size x data_parallel_size`` ranks, in
    Megatron's order: tensor-parallel peers are consecutive ranks, data-parallel
    replicas next, pipeline stages outermost. ``data_parallel_size`` is what is left:
    ``world_size / (tensor_parallel_size * pipeline_parallel_size)``.

    Attributes:
        tensor_parallel_size: ranks that split each weight matrix (Megatron TP): attention
            heads and MLP width column-wise, output projections row-wise, the vocabulary
            of the embedding and output layer. Must divide the number of attention heads,
            key/value heads, MLP width and vocabulary.
        pipeline_parallel_size: stages the decoder layers are cut into (equal numbers of
            layers per stage; the first stage also holds the embedding, the last the final
            norm and output layer). Must divide the number of layers.
        seed: the seed of Megatron's model-parallel RNG on GPUs (dropout is off; kept for
            reproducible layer construction).
        expert_parallel_size: for mixture-of-experts models, consecutive data-parallel ranks
            that split each MoE layer's experts (rank ``r`` of an EP group holds experts
            ``[r E/EP, (r+1) E/EP)``); each token's hidden state is sent to its top-k
            experts' ranks and back (all-to-all). Must divide the experts and the
            data-parallel size; expert gradients are summed over the ``dp / EP`` ranks that
            hold the same experts.
        expert_tensor_parallel_size: ranks splitting one expert's weights; ``None`` or 1 only.
    """

    tensor_parallel_size: int = 1  # ranks splitting each weight matrix (heads, MLP width, vocabulary)
    pipeline_parallel_size: int = 1  # stages the decoder layers are cut into
    seed: int = 1234  # Megatron's model-parallel RNG seed on GPUs
    # mixture-of-experts models: consecutive data-parallel ranks (inside a node) that split each MoE
    # layer's experts, tokens sent to their experts' ranks by an all-to-all. Must divide the number of
    # experts and the data-parallel size; 1: every rank holds every expert (docs/engines.md, "Mixture of experts")
    expert_parallel_size: int = 1
    # ranks splitting each expert's weights; only null or 1 (whole experts) in this version
    expert_tensor_parallel_size: int | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that is out of range."""
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"megatron.{name} must be an int >= 1, got {value!r}")
        if self.expert_tensor_parallel_size not in (None, 1) or isinstance(self.expert_tensor_parallel_size, bool):
            raise ValueError(
                "megatron.expert_tensor_parallel_size must be null or 1 (each expert kept whole on its rank), "
                f"got {self.expert_tensor_parallel_size!r}"
            )

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size / (TP * PP)``; ``ValueError`` when it does not divide, or when
        ``expert_parallel_size`` does not divide the result (EP groups are cut from data-parallel ranks)."""
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if world_size % model_parallel != 0:
            raise ValueError(
                f"the {world_size} ranks cannot be cut into tensor_parallel_size={self.tensor_parallel_size} "
                f"x pipeline_parallel_size={self.pipeline_parallel_size} groups: "
                f"{world_size} is not a multiple of {model_parallel}"
            )
        dp = world_size // model_parallel
        if dp % self.expert_parallel_size:
            raise ValueError(
                f"megatron.expert_parallel_size={self.expert_parallel_size} must divide the data-parallel size "
                f"{dp} (= {world_size} ranks / (tensor_parallel_size x pipeline_parallel_size))"
            )
        return dp
