"""FSDP2 training engine: ``torch.distributed.fsdp.fully_shard`` per decoder layer, then the root.

Runs in one process (no process group: the model stays an ordinary module) or in N
processes over the default process group (gloo on CPU, nccl on CUDA) created by the
caller. Parameters, gradients and AdamW state are sharded on dim 0 across ranks.

Gradient reduction is a SUM over ranks, not FSDP's default mean: every micro-batch
loss is already normalised by counts over the whole mini-batch (see
:mod:`verity.engines.base`), so ``sum_ranks sum_micro grad(loss)`` is the gradient of
the mini-batch loss. Where the FSDP2 API allows (``set_gradient_divide_factor(1.0)``
with sum-only collectives) the reduction itself is a sum; otherwise the backward loss
is multiplied by the world size to undo the mean.

``sharding="replicate"`` skips the sharding: every rank keeps a full copy and the
gradients are summed in one all-reduce per optimizer step (:mod:`verity.engines.replicate`),
which is faster for small models, where FSDP's per-layer collectives outweigh the memory saved.

Mixed precision (CUDA only, on by default there): parameters are all-gathered and
computed in bfloat16, gradients reduced in float32, and the sharded master weights
and optimizer state stay float32. On CPU everything is float32.

Offload (an accelerator only, :mod:`verity.engines.offload`): ``offload_params`` keeps the
parameter and gradient shards in host memory through FSDP2's ``CPUOffloadPolicy`` (AdamW
then steps on the CPU); ``offload_optimizer`` moves the AdamW state to host memory when an
update phase ends (:meth:`FSDP2Engine.update_finished`) and back before the next step.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from verity.engines.base import LossFn, TrainingEngine, ValueLossFn, make_aggregation_context
from verity.engines.compiled_layers import (
    check_cuda_graphs,
    compile_decoder_layers,
    compile_unavailable_reason,
)
from verity.engines.device import resolve_device
from verity.engines.fsdp2_scoring import FSDP2ScoringMixin
from verity.engines.fsdp2_sharding import shard_for_training
from verity.engines.fsdp2_state import FSDP2StateMixin
from verity.engines.hf_loading import (
    decoder_layers,
    enable_activation_checkpointing,
    use_attention_kernel,
)
from verity.engines.logprobs import DEFAULT_CHUNK_TOKENS
from verity.engines.micro_batch_groups import host_rows, micro_batch_groups, take_group
from verity.engines.micro_batches import (
    TRAIN_KEYS,
    get_tensor,
    model_inputs,
    num_rows,
    on_device,
    padding_rows,
    validate_layout,
)
from verity.engines.model_source import ModelSource
from verity.engines.moe_router import RouterSettings, router_terms_for
from verity.engines.offload import OptimizerStateOffload, check_offload, offload_policy
from verity.engines.optim import OptimConfig, build_lr_scheduler, build_optimizer, clip_gradients
from verity.engines.packed import resolve_packed
from verity.engines.packed_attention import use_packed_kernel
from verity.engines.replicate import SHARDING_MODES, all_reduce_gradients
from verity.engines.streamed_loading import fill_from_checkpoint, materialize
from verity.engines.train_rows import rows_to_run, step_totals
from verity.engines.ulysses_engine import sequence_parallel_packed, sequence_parallel_scoring
from verity.hardware.cpu_peak import cpu_has_native_bf16


def _add_values(sums: dict[str, Any], values: dict[str, Any]) -> None:
    """``sums[k] += values[k]``; tensors are added detached, where they are (no host sync)."""
    for key, value in values.items():
        value = value.detach() if isinstance(value, torch.Tensor) else float(value)
        sums[key] = sums.get(key, 0.0) + value


@dataclass(frozen=True)
class PolicyLoss:
    """A policy's training pass: ``fn(micro_batch, logprobs [b, R], entropy [b, R], agg)`` over the
    responses' log-probs at ``temperature`` (entropy with a gradient only when ``entropy_requires_grad``)."""

    fn: LossFn
    temperature: float = 1.0
    entropy_requires_grad: bool = False


@dataclass(frozen=True)
class ValueLoss:
    """A value model's training pass: ``fn(micro_batch, values [b, R], agg)``."""

    fn: ValueLossFn


class FSDP2Engine(FSDP2ScoringMixin, FSDP2StateMixin, TrainingEngine):
    """Data-parallel training of a causal LM with FSDP2 (see the module docstring).

    Args:
        model: an ``nn.Module`` (HF causal LM), a :class:`~verity.engines.model_source.ModelSource`
            or a local checkpoint directory (a causal LM). A source is built empty and each
            rank receives only its shard (:mod:`verity.engines.streamed_loading`) when the
            engine shards (several ranks, ``sharding="full"``) and the folder streams;
            otherwise it is loaded whole on every rank.
        optim_config: AdamW and LR-schedule settings; ``None`` makes an inference-only
            engine (e.g. the reference policy): :meth:`train_step` then raises.
        total_steps: optimizer steps of the whole run, the horizon of the LR schedule.
        device: where this rank computes; default :func:`verity.engines.device.default_device`.
        mixed_precision: bf16 compute with float32 master weights, gradients, gradient
            reduction and AdamW state; default True on CUDA, False on CPU. On CPU it pays
            off where the cores multiply bf16 natively (AMX or AVX-512 BF16:
            :func:`verity.hardware.cpu_has_native_bf16`); elsewhere bf16 matmuls are
            emulated and slower than float32.
        gradient_checkpointing: recompute activations in backward (HF models).
        reshard_after_forward: free gathered layer weights after forward (saves
            memory, costs an extra all-gather in backward).
        sharding: ``full`` (FSDP2) or ``replicate`` (a full copy per rank, one gradient
            all-reduce per optimizer step; see :mod:`verity.engines.replicate`).
        logprob_chunk_tokens: rows per chunk of the loss head over the vocabulary (no-grad
            log-prob passes and the training pass, :mod:`verity.engines.fused_logprobs`).
        micro_batch_tokens: most positions (rows x padding-free window width) per
            micro-batch, on top of the ``micro_batch_size`` rows each call is given, rows taken
            longest first; 0: consecutive rows only (see
            :func:`verity.engines.micro_batch_groups.micro_batch_groups`).
        attn_implementation: switch the model to this HF attention kernel (``eager``,
            ``sdpa``, ...); None keeps the one it was loaded with.
        compile_layers: compile each decoder layer with ``torch.compile`` (inductor), before
            sharding; see :mod:`verity.engines.compiled_layers`. Raises ``RuntimeError`` up
            front when inductor cannot run on ``device`` (no C++ compiler on a CPU).
        compile_head: score log-probs through the compiled loss head
            (:mod:`verity.engines.compiled_head`) in every pass; default: as ``compile_layers``.
        cuda_graphs: with ``compile_layers`` on a CUDA device, replay the compiled layers'
            training passes as CUDA graphs (one launch per layer instead of one per kernel;
            see :mod:`verity.engines.compiled_layers`). Gradients then live in buffers that
            are zeroed after each optimizer step instead of freed. Needs unsharded layers
            (one process, or ``sharding="replicate"``) and no gradient checkpointing;
            ``ValueError`` otherwise.
        offload_params: keep this rank's parameter and gradient shards in pinned host memory
            (FSDP2's ``CPUOffloadPolicy``); AdamW steps on the CPU. Needs an accelerator, a
            process group and ``sharding="full"`` (:mod:`verity.engines.offload`).
        offload_optimizer: move the optimizer state to host memory at :meth:`update_finished`
            and back before the next optimizer step. Needs an accelerator and ``optim_config``.
        shard_vocab: under ``sharding="full"`` on several ranks, keep only this rank's rows of
            the input embedding and the output layer, never gathered; tokens and logits
            travel instead (:mod:`verity.engines.vocab_sharding`). Not with ``offload_params``.
            None: on for a CPU device under ``sharding="full"``, off on accelerators.
        packed: run every pass on the packed layout (:mod:`verity.engines.packed`): a
            micro-batch's real tokens back to back, attention kept inside each row;
            ``micro_batch_tokens`` then counts real tokens. Micro-batches with images, and
            those a shared-prompt pass computes in fewer positions, stay padded. None: on for
            a CPU device with an HF model, off on accelerators.
        ulysses_sequence_parallel_size: ``s`` consecutive ranks split each packed micro-batch by
            tokens, heads exchanged around attention (:mod:`verity.engines.ulysses`); rows are
            data-parallel over the ``world / s`` groups (:attr:`dp_layout`). Implies ``packed``
            (``packed=False`` is refused); ``micro_batch_tokens`` counts a group's packed tokens. 1: off.
        router: a mixture-of-experts model's router losses and routing replay
            (:mod:`verity.engines.moe_router`); the router metrics are recorded for every MoE model.
            ``ValueError`` when set away from its defaults on a dense model.
    """

    name = "fsdp2"  # what a run records as the engine that trained
    supports_train_rows = True

    def __init__(
        self,
        model: nn.Module | str | Path,
        optim_config: OptimConfig | None = None,
        *,
        total_steps: int = 1,
        device: torch.device | str | None = None,
        mixed_precision: bool | None = None,
        gradient_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        sharding: str = "full",
        micro_batch_tokens: int = 0,
        attn_implementation: str | None = None,
        compile_layers: bool = False,
        compile_head: bool | None = None,
        cuda_graphs: bool = False,
        offload_params: bool = False,
        offload_optimizer: bool = False,
        shard_vocab: bool | None = None,
        packed: bool | None = None,
        ulysses_sequence_parallel_size: int = 1,
        router: RouterSettings | None = None,
    ) -> None:
        if sharding not in SHARDING_MODES:
            raise ValueError(f"sharding must be one of {list(SHARDING_MODES)}, got {sharding!r}")
        if (
            isinstance(micro_batch_tokens, bool)
            or not isinstance(micro_batch_tokens, int)
            or micro_batch_tokens < 0
        ):
            raise ValueError(
                f"micro_batch_tokens must be an int >= 0 (0: rows only), got {micro_batch_tokens!r}"
            )
        self.sharding = sharding
        self.micro_batch_tokens = micro_batch_tokens
        self.device = resolve_device(device)
        self.cuda_graphs = bool(cuda_graphs)
        if self.cuda_graphs:
            check_cuda_graphs(self.device, compile_layers, gradient_checkpointing, sharding)
        check_offload(
            self.device,
            offload_params=offload_params,
            offload_optimizer=offload_optimizer,
            sharding=sharding,
            has_optimizer=optim_config is not None,
            cuda_graphs=self.cuda_graphs,
        )
        self.offload_params = offload_params
        if shard_vocab is None:  # on where it measured faster: gloo on a CPU (docs/engines.md)
            shard_vocab = self.device.type == "cpu" and sharding == "full"
        if shard_vocab and (sharding != "full" or offload_params):
            raise ValueError(
                "shard_vocab=True shards the vocabulary rows like FSDP2's full sharding, on the device: "
                f"it needs sharding='full' (got {sharding!r}) and offload_params=False"
            )
        if mixed_precision is None:
            mixed_precision = self.device.type == "cuda"
        self.mixed_precision = bool(mixed_precision)
        if self.mixed_precision and self.device.type == "cpu" and not cpu_has_native_bf16():
            warnings.warn(
                "mixed_precision=True on a CPU without native bf16 multiplies (no amx_bf16 or avx512_bf16 "
                "flag): bf16 matmuls are emulated there and run slower than float32",
                stacklevel=2,
            )
        self.logprob_chunk_tokens = logprob_chunk_tokens
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1

        if isinstance(model, (str, Path)):
            model = ModelSource(str(model))
        # sharded over ranks: build empty, shard, then each rank receives only its shard
        self.streamed = (
            isinstance(model, ModelSource) and model.streams and self.distributed and sharding == "full"
        )
        if isinstance(model, ModelSource):
            module = model.build_empty() if self.streamed else model.load_whole()
        else:
            module = model
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"model must be an nn.Module, a ModelSource or a checkpoint path, got {type(model).__name__}"
            )
        self._prepare_module(module)
        if not self.streamed:
            module.to(self.device)
        if attn_implementation is not None:
            use_attention_kernel(module, attn_implementation)
        packed = sequence_parallel_packed(packed, ulysses_sequence_parallel_size, module)  # SP: packed
        self.packed = resolve_packed(packed, module, self.device, attn_implementation)
        if self.packed:  # once, so that recomputation (checkpointing) and padded passes see it too
            use_packed_kernel(module, self.device)
        if getattr(module, "config", None) is not None and hasattr(module.config, "use_cache"):
            module.config.use_cache = False
        # the scoring functions: padded / packed, or sequence-parallel (packed, heads exchanged)
        self.sp, self._logprobs_fn, self._values_fn = sequence_parallel_scoring(
            module, ulysses_sequence_parallel_size, self.packed, self.device
        )
        # an MoE model's routers: logits kept per forward, routes replayed where a micro-batch has them
        self.router_terms = router_terms_for(module, router)
        if self.router_terms is not None:
            self._logprobs_fn = self.router_terms.wrap(self._logprobs_fn)
        if gradient_checkpointing:
            enable_activation_checkpointing(module)
        # layers compiled in place, before sharding: names and state_dict keys stay the model's
        self.compiled_layers = (
            compile_decoder_layers(
                decoder_layers(module),
                self.device,
                cuda_graphs=self.cuda_graphs,
            )
            if compile_layers
            else 0
        )
        self.compiled_head = bool(compile_layers if compile_head is None else compile_head)
        if self.compiled_head and not compile_layers:
            reason = compile_unavailable_reason(self.device)
            if reason is not None:
                raise RuntimeError(f"compile_head=True: {reason}")
        self._module = module
        self._loss_scale = 1.0
        self.fsdp_modules: list[nn.Module] = []
        self.vocab_sharded = False  # whether the embedding and output layer are sharded by rows
        if self.distributed and sharding == "full":
            self._shard(reshard_after_forward, shard_vocab and self.world_size > 1)
        if self.streamed:
            assert isinstance(model, ModelSource)
            # offloaded shards live in host memory (FSDP2's CPU offload policy expects them there)
            materialize(module, torch.device("cpu") if self.offload_params else self.device)
            fill_from_checkpoint(module, model, self.device, self._checkpoint_name)
            self._init_fresh_parameters()

        self.optim_config = optim_config
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if optim_config is not None:
            self.optimizer = build_optimizer(self._module.parameters(), optim_config)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, optim_config, total_steps)
            if self.cuda_graphs:  # the graphs' gradients accumulate into buffers outside their pool
                for param in self._module.parameters():
                    if param.requires_grad:
                        param.grad = torch.zeros_like(param)
        else:
            self._module.requires_grad_(False)
        # offload_optimizer: the state goes to the host at update_finished(), back before the next step
        self.optimizer_offload = (
            OptimizerStateOffload(self.optimizer)
            if offload_optimizer and self.optimizer is not None
            else None
        )
        self.global_step = 0

    # ------------------------------------------------------------------ setup
    def _prepare_module(self, module: nn.Module) -> None:
        """Change the built model before it moves, compiles or shards (a subclass's hook).

        ``module``'s parameters are on ``meta`` when ``self.streamed`` (the values come from
        the checkpoint after sharding), real otherwise. Default: nothing.
        """

    def _checkpoint_name(self, name: str) -> str | None:
        """The checkpoint's name of the module parameter ``name``; None: not in it (fresh)."""
        return name

    def _init_fresh_parameters(self) -> None:
        """After a streamed fill: give fresh parameters (zeroed) their initial values. Default: none."""

    def _shard(self, reshard_after_forward: bool, shard_vocab: bool) -> None:
        sharded = shard_for_training(
            self._module,
            init_device_mesh(self.device.type, (self.world_size,)),
            mixed_precision=self.mixed_precision,
            reshard_after_forward=reshard_after_forward,
            # offload_params: each shard (and its gradient) in pinned host memory, copied in per use
            offload_policy=offload_policy(self.offload_params),
            shard_vocab=shard_vocab,
        )
        self.fsdp_modules, self._loss_scale = sharded.fsdp_modules, sharded.loss_scale
        self.vocab_sharded = sharded.vocab_sharded

    @property
    def model(self) -> nn.Module:
        """The (possibly FSDP2-sharded) module; its parameters are ``DTensor`` shards when distributed."""
        return self._module

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in: bfloat16 under mixed precision, else the parameters' dtype."""
        return torch.bfloat16 if self.mixed_precision else super().compute_dtype

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.mixed_precision and not self.fsdp_modules:  # FSDP2's policy casts sharded modules
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def dp_layout(self) -> tuple[int, int, bool]:
        """``(dp_rank, dp_size, is_collector)``: the ranks of an SP group share rows, its first answers."""
        return self.sp.index, self.sp.count, self.sp.rank == 0

    # ------------------------------------------------------------ collectives
    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max) ``values`` over the ranks; a sum counts each SP group's rows once (its ranks hold
        the same rows and compute the same numbers, so the sum over ranks is divided by the SP size)."""
        if not self.distributed or self.world_size == 1:
            return list(values)
        # "nccl", or "cpu:gloo,cuda:nccl" when offloaded shards need collectives on host tensors
        comm_device = self.device if "nccl" in str(dist.get_backend()) else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        if op == "sum" and self.sp.size > 1:
            t /= self.sp.size
        return t.tolist()

    def _micro_ranges(self, batch: Any, rows: int, micro_batch_size: int) -> tuple[list[torch.Tensor], int]:
        """(this rank's micro-batches of the first ``rows`` rows as row indices, max count over ranks).

        Micro-batches follow ``micro_batch_size`` rows and the engine's ``micro_batch_tokens``
        budget, counted in real tokens when packed, else in window positions
        (:func:`micro_batch_groups`). Ranks below the max run
        zero-weight passes: only sharded modules need matching passes (each pass all-gathers);
        unsharded, every rank runs just its own (no collective here).
        """
        cost = "tokens" if self.packed else "window"  # what a packed micro-batch computes: its real tokens
        groups = micro_batch_groups(batch, rows, micro_batch_size, self.micro_batch_tokens, cost)
        if not self.fsdp_modules:
            return groups, len(groups)
        return groups, int(self._all_reduce([float(len(groups))], op="max")[0])

    # --------------------------------------------------------------- log-probs
    # ---------------------------------------------------------------- training
    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("this engine was built without optim_config (inference only); it cannot train")
        return self.optimizer

    def _accumulate_gradients(
        self,
        batch: Any,
        micro_batch_size: int,
        loss: PolicyLoss | ValueLoss,
        max_response_len: int | None = None,
        train_rows: torch.Tensor | None = None,
    ) -> tuple[dict[str, float], dict[str, float]]:
        """The micro-batch loop of one mini-batch: global counts, then forward + loss + backward per micro-batch.

        Returns ``(out, sums)``: ``out`` has ``loss`` (global mini-batch loss),
        ``response_tokens``, ``tokens`` and each metric of ``loss.fn`` averaged over
        micro-batches and ranks; ``sums`` each of :meth:`_micro_batch_loss`'s sums added over
        the real micro-batches of all ranks.

        Padding: the trailing ``batch.pad_rows`` rows (added by ``Batch.split``) are
        skipped entirely; a rank with fewer micro-batches than another runs zero-weight
        passes so that the FSDP collectives of all ranks match.
        ``agg.max_response_len`` is ``max_response_len`` or else the widest ``R`` over ranks.

        ``train_rows`` (``[B]`` bool, optional): run forward + backward over these rows only,
        with the counts (``agg``) of the whole mini-batch (:mod:`verity.engines.train_rows`);
        ``out`` then also has ``skipped_row_fraction`` and ``trained_tokens`` (attention-mask
        tokens of the rows run, over all ranks).
        """
        self._require_optimizer()
        validate_layout(batch, TRAIN_KEYS)
        # 1. counts over the whole mini-batch (all micro-batches, all ranks): the loss normalisers
        rows = num_rows(batch) - padding_rows(batch)  # rows Batch.split appended as padding: left out
        response_mask = get_tensor(batch, "response_mask")[:rows].float()
        attention_mask = get_tensor(batch, "attention_mask")[:rows]
        nonempty = response_mask.sum(-1) > 0  # rows with no response token count in no total
        token_sum, seq_sum, all_tokens = self._all_reduce(
            [float(response_mask.sum()), float(nonempty.sum()), float(attention_mask[nonempty].sum())]
        )
        if max_response_len is None:
            max_response_len = int(self._all_reduce([float(response_mask.shape[1])], op="max")[0])
        if token_sum <= 0:
            raise ValueError("response_mask is all zero over the whole mini-batch: nothing to train on")
        agg = make_aggregation_context(token_sum, seq_sum, max_response_len)
        # 2. the micro-batches: row groups (every rank runs as many passes as the busiest)
        real_rows = rows
        batch, rows, row_counts = rows_to_run(batch, rows, train_rows)
        ranges, max_count = self._micro_ranges(batch, rows, micro_batch_size)
        local_count = len(ranges)
        resident = on_device(batch, max(rows, 1), self.device)

        # 3. forward, loss, backward per micro-batch; sums stay on the device until the end (no host sync)
        self._module.train()
        loss_total: Any = 0.0
        metric_sums: dict[str, Any] = {}
        extra_sums: dict[str, Any] = {}
        for i in range(max_count):
            real = i < local_count
            rows_i = ranges[i] if real else torch.zeros(1, dtype=torch.long)
            micro = take_group(resident, rows_i, self.device)
            value, metrics, sums = self._micro_batch_loss(micro, host_rows(batch, rows_i), agg, loss)
            if not isinstance(value, torch.Tensor) or value.dim() != 0:
                raise TypeError("loss_fn must return (scalar loss tensor, metrics dict)")
            weight = self._loss_scale if real else 0.0
            (value * weight).backward()
            if real:
                loss_total = loss_total + value.detach()
                _add_values(metric_sums, metrics or {})
                _add_values(extra_sums, sums)
        loss_total = float(loss_total)
        metric_sums = {k: float(v) for k, v in metric_sums.items()}
        extra_sums = {k: float(v) for k, v in extra_sums.items()}

        # 4. gradients summed over ranks (FSDP reduced them in backward); metrics reduced
        if self.sharding == "replicate":
            all_reduce_gradients(self._module.parameters())
        keys, extra_keys = sorted(metric_sums), sorted(extra_sums)
        reduced = self._all_reduce(
            [loss_total, float(local_count), float(real_rows), *row_counts]
            + [metric_sums[k] for k in keys]
            + [extra_sums[k] for k in extra_keys]
        )
        loss_global, count_global, rows_global, skipped_global, run_tokens_global = reduced[:5]
        out = step_totals(loss_global, token_sum, all_tokens, rows_global, skipped_global, run_tokens_global)
        for key, value in zip(keys, reduced[5 : 5 + len(keys)], strict=True):
            out[key] = value / count_global
        return out, dict(zip(extra_keys, reduced[5 + len(keys) :], strict=True))

    def _micro_batch_loss(
        self, micro: Any, layout: Any, agg: Any, loss: PolicyLoss | ValueLoss
    ) -> tuple[torch.Tensor, Any, dict[str, Any]]:
        """One micro-batch's forward and its share of the mini-batch loss: ``(loss, metrics, sums)``.

        A policy's ``sums`` are the response tokens' entropy and their count (for the token-mean
        entropy); a value model's are empty. ``layout``: the micro-batch's padding-free window,
        :func:`verity.engines.micro_batch_groups.host_rows`.
        """
        if isinstance(loss, ValueLoss):
            with self._autocast():
                values = self._values_fn(self._module, model_inputs(micro), layout=layout)
            value, metrics = loss.fn(micro, values, agg)
            return value, metrics, {}
        with self._autocast():
            logprobs, entropy = self._logprobs_fn(
                self._module,
                model_inputs(micro),
                temperature=loss.temperature,
                compute_entropy=True,
                chunk_tokens=self.logprob_chunk_tokens,
                entropy_grad=loss.entropy_requires_grad,
                compiled_head=self.compiled_head,
                layout=layout,
            )
        if not loss.entropy_requires_grad:
            entropy = entropy.detach()
        value, metrics = loss.fn(micro, logprobs, entropy, agg)
        mask = get_tensor(micro, "response_mask").to(entropy.device, torch.float32)
        if self.router_terms is not None:  # the router losses, weighted by the micro-batch's share of tokens
            term, router_metrics = self.router_terms.loss_and_metrics(mask.sum() / agg.global_tokens)
            value = value + term
            metrics = {**(metrics or {}), **router_metrics}
        return value, metrics, {"entropy_sum": (entropy.detach() * mask).sum(), "entropy_tokens": mask.sum()}

    def forward_backward(
        self,
        batch: Any,
        loss_fn: LossFn,
        micro_batch_size: int,
        temperature: float = 1.0,
        *,
        entropy_requires_grad: bool = False,
        max_response_len: int | None = None,
        train_rows: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Accumulate gradients of ``loss_fn`` over the local mini-batch (no optimizer step).

        Gradient contract: ``loss_fn(micro_batch, logprobs [b, R], entropy [b, R], agg)``
        returns a scalar whose SUM over micro-batches and ranks is the mini-batch loss,
        using ``agg.global_tokens`` (sum of ``response_mask`` over all ranks),
        ``agg.global_seqs`` (rows with >= 1 response token over all ranks) and
        ``agg.max_response_len`` (``max_response_len``, default the widest ``R`` over
        ranks). The ``batch.pad_rows`` trailing rows of a ``Batch.split`` part are skipped.
        ``train_rows`` (``[B]`` bool): only these rows run forward + backward, the counts
        stay the whole mini-batch's — exact for a loss whose other rows add exactly zero
        (:mod:`verity.engines.train_rows`).

        Returns:
            ``loss`` (global mini-batch loss), ``entropy`` (token-mean over the
            response tokens of the rows run), ``response_tokens``, ``tokens`` (attention-mask
            tokens of the non-padding rows over all ranks), ``skipped_row_fraction``,
            ``trained_tokens`` (attention-mask tokens of the rows run) and each ``loss_fn``
            metric averaged over micro-batches and ranks.
        """
        loss = PolicyLoss(loss_fn, temperature, entropy_requires_grad)
        out, sums = self._accumulate_gradients(batch, micro_batch_size, loss, max_response_len, train_rows)
        out["entropy"] = sums["entropy_sum"] / max(sums["entropy_tokens"], 1.0)
        return out

    def forward_backward_values(
        self, batch: Any, loss_fn: ValueLossFn, micro_batch_size: int
    ) -> dict[str, float]:
        """:meth:`forward_backward` for a value model (a critic): the loss sees values, not log-probs.

        ``loss_fn(micro_batch, values [b, R], agg) -> (loss scalar, metrics)`` with the
        same gradient contract as :meth:`forward_backward`; ``values`` carry the
        gradient (positions ``P-1 .. P+R-2``, see :mod:`verity.engines.values`).

        Returns:
            ``loss``, ``response_tokens``, ``tokens`` and each ``loss_fn`` metric
            averaged over micro-batches and ranks.
        """
        out, _ = self._accumulate_gradients(batch, micro_batch_size, ValueLoss(loss_fn))
        return out

    def optimizer_step(self) -> dict[str, float]:
        """Clip gradients, step AdamW and the LR schedule, zero gradients.

        A non-finite gradient norm skips the AdamW update (the schedule still advances).

        Returns:
            ``grad_norm`` (global L2 norm before clipping), ``lr`` (used by this
            step), ``step_skipped`` (1.0 when the update was skipped).
        """
        optimizer = self._require_optimizer()
        assert self.optim_config is not None and self.lr_scheduler is not None
        if self.optimizer_offload is not None:  # the state comes back from the host for the step
            self.optimizer_offload.to_device()
        grad_norm = clip_gradients(self._module.parameters(), self.optim_config.grad_clip)
        lr = float(optimizer.param_groups[0]["lr"])
        finite = math.isfinite(grad_norm)
        if finite:
            optimizer.step()
        self.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=not self.cuda_graphs)
        self.global_step += 1
        return {"grad_norm": grad_norm, "lr": lr, "step_skipped": 0.0 if finite else 1.0}

    def update_finished(self) -> None:
        """After an update phase: with ``offload_optimizer``, the optimizer state moves to host memory."""
        if self.optimizer_offload is not None:
            self.optimizer_offload.to_host()
