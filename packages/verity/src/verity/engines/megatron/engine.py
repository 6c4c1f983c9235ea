"""Megatron-core training engine: tensor, pipeline and data parallelism behind the ``TrainingEngine`` interface.

Built from an HF Qwen2-family causal LM (a module or a local checkpoint folder), it
holds this rank's piece of a Megatron ``GPTModel`` (:mod:`.model`), converted exactly
from the HF weights (:mod:`.convert`). The world (the default process group) is cut
into ``TP x DP x PP`` by :class:`~verity.engines.megatron.options.MegatronOptions`;
ranks with the same data-parallel index must be given the same rows (a worker declares
this with ``Worker.set_dp_layout(*engine.dp_layout)``).

Training follows the same contract as :class:`~verity.engines.fsdp2.FSDP2Engine`:

- the aggregation context counts response tokens / sequences over the WHOLE
  mini-batch across data-parallel ranks; each micro-batch loss is its share of the
  mini-batch loss; micro-batch gradients are summed and data-parallel gradients are
  SUMMED (all-reduce), so the gradient does not depend on the split;
- the loss callables are the same (``loss_fn(micro, logprobs, entropy, agg)``); they
  run on the last pipeline stage over logits gathered across TP ranks (vocabulary
  padding dropped), so every TP rank computes the identical loss;
- AdamW (``torch.optim.AdamW`` over this rank's shards: the update is element-wise,
  so sharded AdamW is full AdamW), the warm-up/cosine schedule of
  :mod:`verity.engines.optim`, and clipping by the global gradient norm over all
  TP/PP shards, replicated parameters counted once;
- metrics are reduced over data-parallel ranks and are the same on every rank.

The micro-batch schedule is :mod:`.schedule` (GPipe-style, gloo or nccl
point-to-point); Megatron's CUDA-only schedules, optimizer and DDP wrapper are not
used.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verity.data.vision_inputs import has_images
from verity.engines.base import LossFn, TrainingEngine, make_aggregation_context
from verity.engines.logprobs import logprobs_and_entropy_from_logits
from verity.engines.megatron import convert
from verity.engines.megatron.checkpoint import ExpertMesh, StageMesh, build_state, restore_state
from verity.engines.megatron.full_tensors import iter_full_tensor_buckets
from verity.engines.megatron.imports import quiet_megatron_import
from verity.engines.megatron.model import build_gpt_model, check_divisible, qwen2_shape, rotary_inv_freq
from verity.engines.megatron.moe_routing import prepare_forward, stage_router_terms
from verity.engines.megatron.moe_steps import even_micro_batches, is_expert, real_results, split_expert_params
from verity.engines.megatron.options import MegatronOptions
from verity.engines.megatron.parallel import (
    all_reduce_floats,
    all_reduce_gradients,
    broadcast_from_last_stage,
    gather_vocab_parallel,
    global_grad_norm,
    initialize_layout,
    model_parallel_nodes,
    sum_tied_embedding_gradients,
)
from verity.engines.megatron.schedule import run_micro_batches
from verity.engines.megatron.stage_files import stage_tensors
from verity.engines.micro_batches import (
    LOGPROB_KEYS,
    TRAIN_KEYS,
    get_tensor,
    model_inputs,
    num_rows,
    padding_rows,
    take_rows,
    validate_layout,
)
from verity.engines.model_source import ModelSource
from verity.engines.moe_router import RouterSettings
from verity.engines.optim import OptimConfig, build_lr_scheduler, build_optimizer, scale_gradients
from verity.engines.train_rows import rows_to_run, step_totals
from verity.resharding.gather import DEFAULT_BUCKET_BYTES


class MegatronEngine(TrainingEngine):
    """Train an HF Qwen2-family model as a Megatron-core ``GPTModel`` (see the module docstring).

    Args:
        model: an HF causal LM module (its weights are read, it is not kept) or a local
            checkpoint folder.
        optim_config: AdamW and LR-schedule settings; ``None`` makes an inference-only engine.
        options: TP / PP sizes (:class:`MegatronOptions`); default TP=PP=1.
        total_steps: optimizer steps of the whole run, the horizon of the LR schedule.
        device: where this rank computes (default ``cuda:$LOCAL_RANK`` or ``cpu``).
        router: a mixture-of-experts model's router losses and routing replay
            (:mod:`verity.engines.moe_router`, the FSDP2 engine's definitions, through
            :mod:`.moe_routing`); the router metrics are recorded for every MoE model run on one
            pipeline stage. ``ValueError`` when set away from its defaults on a dense model or
            with ``pipeline_parallel_size > 1``.
    """

    name = "megatron"  # what a run records as the engine that trained
    supports_train_rows = True
    #: LoRA adapters are not implemented for this engine
    supports_adapters = False
    #: value models (a critic's scalar head) are not implemented for this engine
    trains_values = False

    def __init__(
        self,
        model: nn.Module | str | Path,
        optim_config: OptimConfig | None = None,
        options: MegatronOptions | None = None,
        *,
        total_steps: int = 1,
        device: torch.device | str | None = None,
        router: RouterSettings | None = None,
    ) -> None:
        from verity.engines.device import resolve_device

        self.options = options or MegatronOptions()
        self.options.validate()
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if isinstance(model, (str, Path)):
            model = ModelSource(str(model))
        # a streaming folder: each rank reads only its stage's tensors, one at a time, keeping its TP slice
        self.streamed = isinstance(model, ModelSource) and (model.streams or model.experts_stored_apart)
        if isinstance(model, ModelSource) and not self.streamed:
            model = model.load_whole()
        if isinstance(model, ModelSource):
            hf_config, dtype = model.config(), model.dtype
        elif isinstance(model, nn.Module) and getattr(model, "config", None) is not None:
            hf_config, dtype = model.config, next(model.parameters()).dtype
        else:
            raise TypeError(
                f"model must be an HF causal LM, a ModelSource or a checkpoint path, got {type(model).__name__}"
            )
        self.shape = qwen2_shape(hf_config)
        self.hf_config = hf_config
        if isinstance(model, ModelSource):
            weights: Mapping[str, torch.Tensor] = stage_tensors(model, self.shape, dtype)
        else:
            weights = convert.hf_state_dict(model)
        tp, pp = self.options.tensor_parallel_size, self.options.pipeline_parallel_size
        ep = self.options.expert_parallel_size
        check_divisible(self.shape, tp, pp, ep)
        with quiet_megatron_import():
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self.options.data_parallel_size(dist.get_world_size())
            self.layout = initialize_layout(tp, pp, ep)
            self.model_parallel_nodes = model_parallel_nodes(self.layout)
            if self.device.type == "cuda":
                from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                model_parallel_cuda_manual_seed(self.options.seed)
            self._module = build_gpt_model(self.shape, tp, pp, self.device, dtype, ep=ep)
        self.layouts = convert.param_layouts(self._module, self.shape)
        # an MoE model's routers: logits kept per forward, routes replayed where a micro-batch has them
        self.router_terms = stage_router_terms(self._module, router, pp)
        convert.load_hf_into_stage(self._module, self.layouts, weights, self.shape, tp, self.layout.tp_rank)
        del weights
        self.hf_shapes = convert.hf_shapes(self.shape)
        self.dtype = dtype
        self.inv_freq = rotary_inv_freq(self.shape, self.device)
        self.rank, self.world_size = self.layout.dp_rank, self.layout.dp
        self._mesh = StageMesh(self.layout, self.device.type)
        self._expert_mesh = ExpertMesh(self.layout, self.device.type)
        self.optim_config = optim_config
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if optim_config is not None:
            self.optimizer = build_optimizer(self._module.parameters(), optim_config)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, optim_config, total_steps)
        else:
            self._module.requires_grad_(False)
        self.global_step = 0

    # ------------------------------------------------------------------ layout
    @property
    def model(self) -> nn.Module:
        """This rank's stage of the Megatron ``GPTModel`` (TP shards; Megatron names)."""
        return self._module

    @property
    def dp_layout(self) -> tuple[int, int, bool]:
        """``(dp_rank, dp_size, is_collector)`` for ``Worker.set_dp_layout``: one collector per
        data-parallel replica (its TP rank 0 on the last pipeline stage)."""
        lay = self.layout
        return lay.dp_rank, lay.dp, lay.tp_rank == 0 and lay.is_last_stage

    def _micro_ranges(self, rows: int, micro_batch_size: int) -> list[tuple[int, int]]:
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
        return [(s, min(s + micro_batch_size, rows)) for s in range(0, rows, micro_batch_size)]

    def _response_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[R+1, b, V'/T]`` TP slice -> ``[b, R, V]`` full logits predicting the response tokens."""
        full = gather_vocab_parallel(logits, self.layout)[..., : self.shape.vocab_size]
        return full.transpose(0, 1)[:, :-1]

    def _run(self, micros: list[Any], last_fn: Any, backward: bool, spare: Any = None) -> list[Any]:
        """Run ``micros`` through the stage; with experts split over ranks, every rank of the EP group runs
        as many micro-batches as the busiest (``spare``'s first row, with a zero loss, fills the gap)."""
        inputs = [model_inputs(m) for m in micros]
        if self.layout.ep > 1:
            inputs, last_fn = even_micro_batches(inputs, last_fn, spare, self.layout, self.device, backward)
        response_len = get_tensor(micros[0] if micros else spare, "responses").shape[1]
        results = run_micro_batches(
            self._module,
            self.layout,
            inputs,
            self.inv_freq,
            last_fn,
            keep_last=response_len + 1,
            hidden_size=self.shape.hidden_size,
            dtype=self.dtype,
            backward=backward,
            before_forward=lambda inputs: prepare_forward(self.router_terms, inputs),
        )
        return real_results(results)

    # --------------------------------------------------------------- log-probs
    def compute_logprobs(
        self,
        batch: Any,
        micro_batch_size: int,
        temperature: float = 1.0,
        *,
        compute_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See :meth:`TrainingEngine.compute_logprobs`: float32 CPU ``[B, R]`` on every rank."""
        validate_layout(batch, LOGPROB_KEYS)
        _refuse_images(batch)
        rows = num_rows(batch)
        micros = [take_rows(batch, s, e, self.device) for s, e in self._micro_ranges(rows, micro_batch_size)]

        def last_fn(index: int, logits: torch.Tensor) -> tuple[None, Any]:
            lp, ent = logprobs_and_entropy_from_logits(
                self._response_logits(logits),
                get_tensor(micros[index], "responses"),
                temperature=temperature,
                compute_entropy=compute_entropy,
            )
            return None, (lp.float().cpu(), ent.float().cpu() if ent is not None else None)

        self._module.eval()
        with torch.no_grad():
            parts = self._run(micros, last_fn, backward=False, spare=batch)
        parts = broadcast_from_last_stage(parts if self.layout.is_last_stage else None, self.layout)
        logprobs = torch.cat([lp for lp, _ in parts])
        return logprobs, (torch.cat([e for _, e in parts]) if compute_entropy else None)

    # ---------------------------------------------------------------- training
    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("this engine was built without optim_config (inference only); it cannot train")
        return self.optimizer

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
        """Accumulate the mini-batch gradient of ``loss_fn`` (no optimizer step); same contract,
        ``train_rows`` and metrics as :meth:`verity.engines.fsdp2.FSDP2Engine.forward_backward`.

        After it, ``.grad`` holds the gradient SUMMED over data-parallel ranks (and, with
        tied embeddings under PP, over the two embedding copies).
        """
        self._require_optimizer()
        validate_layout(batch, TRAIN_KEYS)
        _refuse_images(batch)
        lay = self.layout
        rows = num_rows(batch) - padding_rows(batch)
        response_mask = get_tensor(batch, "response_mask")[:rows].float()
        attention_mask = get_tensor(batch, "attention_mask")[:rows]
        nonempty = response_mask.sum(-1) > 0
        token_sum, seq_sum, all_tokens = all_reduce_floats(
            [float(response_mask.sum()), float(nonempty.sum()), float(attention_mask[nonempty].sum())],
            lay.dp_group,
            self.device,
        )
        if max_response_len is None:
            max_response_len = int(
                all_reduce_floats([float(response_mask.shape[1])], lay.dp_group, self.device, op="max")[0]
            )
        if token_sum <= 0:
            raise ValueError("response_mask is all zero over the whole mini-batch: nothing to train on")
        agg = make_aggregation_context(token_sum, seq_sum, max_response_len)
        real_rows = rows
        batch, rows, row_counts = rows_to_run(batch, rows, train_rows)
        micros = [take_rows(batch, s, e, self.device) for s, e in self._micro_ranges(rows, micro_batch_size)]

        def last_fn(index: int, logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
            micro = micros[index]
            logprobs, entropy = logprobs_and_entropy_from_logits(
                self._response_logits(logits),
                get_tensor(micro, "responses"),
                temperature=temperature,
                entropy_grad=entropy_requires_grad,
            )
            if not entropy_requires_grad:
                entropy = entropy.detach()
            loss, metrics = loss_fn(micro, logprobs, entropy, agg)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError("loss_fn must return (scalar loss tensor, metrics dict)")
            mask = get_tensor(micro, "response_mask").float()
            if self.router_terms is not None:  # the router losses, weighted by the micro-batch's share of tokens
                term, router_metrics = self.router_terms.loss_and_metrics(mask.sum() / agg.global_tokens)
                loss = loss + term
                metrics = {**(metrics or {}), **router_metrics}
            entropy_sum = float((entropy.detach() * mask).sum())
            return loss, (float(loss.detach()), dict(metrics or {}), entropy_sum, float(mask.sum()))

        self._module.train()
        # gradients already accumulated by an earlier call are set aside so that only this
        # call's contribution is summed over ranks, then added back
        trainable = [p for p in self._module.parameters() if p.requires_grad]
        earlier = [p.grad for p in trainable]
        for p in trainable:
            p.grad = None
        if rows > 0 or lay.ep > 1:
            results = self._run(micros, last_fn, backward=True, spare=batch)
        else:
            results = []
        dense, experts = split_expert_params(self._module, trainable)
        all_reduce_gradients(dense, lay.dp_group)
        all_reduce_gradients(experts, lay.expert_dp_group)
        sum_tied_embedding_gradients(*self._tied_pair(), lay)
        for p, grad in zip(trainable, earlier, strict=True):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)
        out = None
        if lay.is_last_stage:
            metric_sums: dict[str, float] = {}
            loss_total = entropy_total = entropy_tokens = 0.0
            for loss_value, metrics, entropy_sum, response_tokens in results:
                loss_total += loss_value
                entropy_total += entropy_sum
                entropy_tokens += response_tokens
                for key, value in metrics.items():
                    metric_sums[key] = metric_sums.get(key, 0.0) + float(value)
            keys = sorted(metric_sums)
            reduced = all_reduce_floats(
                [
                    loss_total,
                    entropy_total,
                    entropy_tokens,
                    float(len(results)),
                    float(real_rows),
                    *row_counts,
                ]
                + [metric_sums[k] for k in keys],
                lay.dp_group,
                self.device,
            )
            loss_sum, entropy_sum_all, entropy_tokens_all, count, rows_all, skipped, run_tokens = reduced[:7]
            out = step_totals(loss_sum, token_sum, all_tokens, rows_all, skipped, run_tokens)
            out.update({k: v / max(count, 1.0) for k, v in zip(keys, reduced[7:], strict=True)})
            out["entropy"] = entropy_sum_all / max(entropy_tokens_all, 1.0)
        return broadcast_from_last_stage(out, lay)

    def _tied_pair(self) -> tuple[nn.Parameter | None, nn.Parameter | None]:
        """(first stage's embedding, last stage's output copy) when tied embeddings are split by PP."""
        if not self.shape.tie_word_embeddings or self.layout.pp == 1:
            return None, None
        params = dict(self._module.named_parameters())
        return params.get("embedding.word_embeddings.weight"), params.get("output_layer.weight")

    def _grad_norm(self) -> float:
        params = dict(self._module.named_parameters())
        counted, experts = [], []
        for lay in self.layouts:
            grad = params[lay.name].grad
            if grad is None or lay.duplicate:
                continue
            if is_expert(lay):
                experts.append(grad)  # each EP rank holds other experts: summed over the EP group
                continue
            if lay.shard_dim is None and self.layout.tp_rank != 0:
                continue  # replicated over TP: counted on TP rank 0 only
            counted.append(grad)
        return global_grad_norm(counted, self.layout, self.device, experts if self.shape.is_moe else None)

    def optimizer_step(self) -> dict[str, float]:
        """Clip by the global gradient norm, step AdamW and the LR schedule, zero gradients.

        Returns ``grad_norm`` (before clipping), ``lr`` (used by this step) and
        ``step_skipped`` (1.0 when a non-finite norm skipped the update; the schedule still advances).
        """
        optimizer = self._require_optimizer()
        assert self.optim_config is not None and self.lr_scheduler is not None
        grad_norm = self._grad_norm()
        lr = float(optimizer.param_groups[0]["lr"])
        finite = math.isfinite(grad_norm)
        if finite:
            scale_gradients(self._module.parameters(), grad_norm, self.optim_config.grad_clip)
            optimizer.step()
        self.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return {"grad_norm": grad_norm, "lr": lr, "step_skipped": 0.0 if finite else 1.0}

    # ---------------------------------------------------------- full tensors
    def iter_full_weights(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of full HF-named weights (TP shards gathered, PP stages collected) on every rank.

        A collective over the whole world: every rank must consume it to the end.
        """
        yield from iter_full_tensor_buckets(
            self._module,
            self.layouts,
            self.shape,
            self.layout,
            lambda p: p,
            bucket_bytes,
            dtype=dtype,
            device=torch.device(device) if device is not None else None,
        )

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Full HF-named gradients on CPU, on every rank (collective; zeros where a parameter has none)."""
        out: dict[str, torch.Tensor] = {}
        buckets = iter_full_tensor_buckets(
            self._module,
            self.layouts,
            self.shape,
            self.layout,
            lambda p: p.grad if p.grad is not None else torch.zeros_like(p),
            1 << 62,
        )
        for bucket in buckets:
            out.update({n: t.detach().float().cpu().clone() for n, t in bucket})
        return out

    # ------------------------------------------------------------- checkpoint
    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """HF-named ``{"model", "optimizer", "lr_scheduler", "global_step"}`` (see :mod:`.checkpoint`)."""
        state = build_state(
            self._module,
            self.layouts,
            self.shape,
            self.hf_shapes,
            self.layout,
            self._mesh,
            self.optimizer,
            self._expert_mesh,
        )
        state["global_step"] = self.global_step
        if self.optimizer is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict() if self.lr_scheduler else {}
        return state

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict_for_checkpoint` returned, after ``dcp.load`` filled it."""
        if "model" not in state:
            raise KeyError("checkpoint state has no 'model' entry")
        restore_state(state, self._module, self.layouts, self.shape, self.layout, self.optimizer)
        if self.lr_scheduler is not None and state.get("lr_scheduler"):
            self.lr_scheduler.load_state_dict(dict(state["lr_scheduler"]))
        self.global_step = int(state.get("global_step", 0))


def _refuse_images(batch: Any) -> None:
    """Megatron builds text-only GPT models: a batch with images is an error, never read without them."""
    if has_images(batch):
        raise ValueError(
            "the megatron engine builds text-only models but the batch carries images (pixel_values); "
            "use actor.engine=fsdp2 for vision-language models (docs/multimodal.md)"
        )
