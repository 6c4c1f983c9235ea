"""The training-engine interface every backend (FSDP2, Megatron-core) implements.

An engine owns one model replica's share of parameters, gradients and optimizer
state inside a data-parallel group (the default ``torch.distributed`` process group,
created by the caller; no group means a single process). The trainer talks to it in
whole mini-batches of the verl layout (see ``verity.batch``):

- :meth:`TrainingEngine.compute_logprobs` scores the response tokens without grad;
- :meth:`TrainingEngine.forward_backward` runs the micro-batch loop of one mini-batch
  (forward, loss callable, backward; gradients summed over ranks) and
  :meth:`TrainingEngine.optimizer_step` clips gradients, steps the optimizer and the LR
  schedule: a trained role's update loop (:func:`verity.workers.role_training.update_epochs`)
  calls the two in turn, one optimizer step per mini-batch; :meth:`TrainingEngine.train_step`
  is the two together;
- :meth:`TrainingEngine.compute_values` / :meth:`TrainingEngine.forward_backward_values` are
  the same for a value model (a critic: the backbone with a scalar head), whose loss
  callable sees per-token values instead of log-probs;
- :meth:`TrainingEngine.iter_full_weights` yields the full weights under the HF
  model's names, in bounded buckets, on every rank (a collective): what
  ``verity.resharding.sync_weights`` hands to the rollout; by default it gathers
  :attr:`TrainingEngine.model` (FSDP2 ``DTensor`` shards);
- :meth:`TrainingEngine.state_dict_for_checkpoint` /
  :meth:`TrainingEngine.load_checkpoint_state` for ``torch.distributed.checkpoint``.

Loss callables follow the gradient-equality contract: the engine computes an
aggregation context of counts over the WHOLE mini-batch (all micro-batches, all
data-parallel ranks) and passes it to ``loss_fn``; each micro-batch loss is scaled so
that the SUM over micro-batches and ranks is the mini-batch loss, and engines reduce
gradients across ranks by SUM. The gradient therefore does not depend on the
micro-batch size or the number of workers.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from verity.algorithms import AggregationContext

#: ``loss_fn(micro_batch, logprobs [b, R], entropy [b, R], agg_ctx) -> (loss scalar, metrics)``
LossFn = Callable[[Any, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, Mapping[str, float]]]

#: ``loss_fn(micro_batch, values [b, R], agg_ctx) -> (loss scalar, metrics)`` (a critic's loss)
ValueLossFn = Callable[[Any, torch.Tensor, Any], tuple[torch.Tensor, Mapping[str, float]]]


def make_aggregation_context(
    global_tokens: float, global_seqs: float, max_response_len: int
) -> AggregationContext:
    """The ``verity.algorithms.AggregationContext`` handed to loss callables (counts over the mini-batch)."""
    return AggregationContext(
        global_tokens=float(global_tokens),
        global_seqs=float(global_seqs),
        max_response_len=int(max_response_len),
    )


def with_step_time(metrics: dict[str, float], seconds: float) -> dict[str, float]:
    """``metrics`` plus ``step_seconds`` and ``tokens_per_s`` (their ``tokens`` over ``seconds``)."""
    metrics["step_seconds"] = seconds
    metrics["tokens_per_s"] = metrics["tokens"] / max(seconds, 1e-9)
    return metrics


class TrainingEngine(abc.ABC):
    """Interface of a data-parallel training backend (see the module docstring)."""

    #: the engine's registered name (``fsdp2``, ``megatron``, ...): what a run records as having trained
    name: str = "engine"
    #: whether ``forward_backward`` takes ``train_rows`` (a ``[B]`` bool mask of the rows to run
    #: forward + backward on, the loss normalised over all rows; :mod:`verity.engines.train_rows`)
    supports_train_rows: bool = False
    #: how the weights lie over the data-parallel ranks (``fsdp2``: ``full`` | ``replicate``); None: the
    #: engine has no such choice
    sharding: str | None = None
    #: nodes one model-parallel group spans (Megatron's TP x PP; 1: its collectives stay in a node);
    #: None: no model parallelism
    model_parallel_nodes: int | None = None
    #: decoder layers compiled (``torch.compile``); 0: none
    compiled_layers: int = 0
    #: whether the loss head over the vocabulary runs compiled kernels
    compiled_head: bool = False
    #: whether the compiled layers' training passes replay as CUDA graphs
    cuda_graphs: bool = False
    #: whether the model was built empty and each rank given only its shard (or slice) of the
    #: checkpoint by one reader (:mod:`verity.engines.streamed_loading`); False: loaded whole
    streamed: bool = False
    #: rank and size of the data-parallel group (0 and 1 in a single process)
    rank: int
    world_size: int
    device: torch.device

    @abc.abstractmethod
    def compute_logprobs(
        self,
        batch: Any,
        micro_batch_size: int,
        temperature: float = 1.0,
        *,
        compute_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs and entropy of ``responses`` under the current weights.

        Args:
            batch: the local rows: ``input_ids [B, P+R]``, ``attention_mask [B, P+R]``,
                ``position_ids [B, P+R]``, ``responses [B, R]``.
            micro_batch_size: rows per forward pass.
            temperature: logits are divided by it.

        Returns:
            ``(logprobs [B, R], entropy [B, R] or None)``, float32 on CPU, no grad.
        """

    @abc.abstractmethod
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
        """Accumulate the gradient of ``loss_fn`` over the local mini-batch, micro-batch by micro-batch.

        ``batch`` needs ``response_mask [B, R]`` and whatever ``loss_fn`` reads besides the
        log-prob inputs. Gradients end summed over the data-parallel ranks (the gradient
        contract above); no optimizer step. Returns the mini-batch's metrics (``loss``,
        ``entropy``, ``tokens``, ``response_tokens``, each ``loss_fn`` metric), the same on every rank.
        """

    @abc.abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Clip gradients by their global norm, step the optimizer and the LR schedule, zero gradients.

        Returns ``grad_norm`` (before clipping), ``lr`` (used by this step) and ``step_skipped``
        (1.0 when a non-finite norm skipped the update).
        """

    def update_finished(self) -> None:
        """Called once after the last optimizer step of an update phase (one RL step's epochs,
        :func:`verity.workers.role_training.update_epochs`): an engine may give device memory back
        until the next :meth:`optimizer_step` (FSDP2's ``offload_optimizer``). Default: nothing."""
        return None

    def train_step(
        self,
        batch: Any,
        loss_fn: LossFn,
        micro_batch_size: int,
        temperature: float = 1.0,
        **pass_options: Any,
    ) -> dict[str, float]:
        """One optimizer step on the local mini-batch: :meth:`forward_backward`, then :meth:`optimizer_step`.

        ``pass_options`` go to :meth:`forward_backward`. Adds ``step_seconds`` (wall seconds) and
        ``tokens_per_s`` (attention-mask tokens per second) to the metrics.
        """
        started = time.perf_counter()
        metrics = self.forward_backward(batch, loss_fn, micro_batch_size, temperature, **pass_options)
        metrics.update(self.optimizer_step())
        return with_step_time(metrics, time.perf_counter() - started)

    def compute_values(self, batch: Any, micro_batch_size: int) -> torch.Tensor:
        """Per-token values ``[B, R]`` (float32, CPU, no grad) of a value model; ``batch`` as for log-probs.

        The value of response token ``j`` is the model's scalar output at position ``P-1+j``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not train value models")

    def forward_backward_values(
        self, batch: Any, loss_fn: ValueLossFn, micro_batch_size: int
    ) -> dict[str, float]:
        """:meth:`forward_backward` for a value model: ``loss_fn(micro_batch, values [b, R], agg)``."""
        raise NotImplementedError(f"{type(self).__name__} does not train value models")

    def value_train_step(self, batch: Any, loss_fn: ValueLossFn, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step of a value model: :meth:`forward_backward_values`, then :meth:`optimizer_step`."""
        started = time.perf_counter()
        metrics = self.forward_backward_values(batch, loss_fn, micro_batch_size)
        metrics.update(self.optimizer_step())
        return with_step_time(metrics, time.perf_counter() - started)

    def trainable_parameters(self) -> int | None:
        """Parameters the engine trains, at full (unsharded) size; None: every parameter of the model."""
        return None

    def optimizer_state_bytes(self) -> int | None:
        """Bytes of optimizer state over every rank (may be a collective); None: the engine does not say."""
        return None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the engine's matmuls run in (what a run records; MFU is taken against its peak).

        The default is the dtype of the model's first parameter; an engine that computes in
        another dtype than it stores (mixed precision) says so by overriding this.
        """
        model = getattr(self, "model", None)
        if not isinstance(model, torch.nn.Module):
            return torch.float32
        first = next(model.parameters(), None)
        return torch.float32 if first is None else first.dtype

    @property
    def dp_layout(self) -> tuple[int, int, bool]:
        """``(dp_rank, dp_size, is_collector)`` of this rank, for ``Worker.set_dp_layout``.

        Ranks with the same ``dp_rank`` must be given the same rows; exactly one of them
        is the collector whose answers are returned. Default: every rank its own replica.
        """
        return self.rank, self.world_size, True

    @property
    @abc.abstractmethod
    def model(self) -> torch.nn.Module:
        """The module holding this rank's weights (FSDP2: ``DTensor`` shards; Megatron: this
        rank's pipeline stage with its tensor-parallel shards, under Megatron's names).

        Weight sync reads :meth:`iter_full_weights`, not this module.
        """

    def iter_full_weights(
        self,
        bucket_bytes: int = 256 * 1024 * 1024,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets (lists of ``(name, full tensor)``, at most ``bucket_bytes`` each in ``dtype``) of
        every weight under the HF model's parameter names, on every rank.

        A collective: every rank must consume the generator to the end. The default
        gathers :attr:`model` with ``verity.resharding.iter_full_state_dict_buckets``.
        """
        from verity.resharding.gather import iter_full_state_dict_buckets

        yield from iter_full_state_dict_buckets(self.model, bucket_bytes, dtype=dtype, device=device)

    def iter_rollout_slices(
        self,
        tp_size: int,
        bucket_bytes: int = 256 * 1024 * 1024,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        stats: dict[str, int] | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of ``(name, this rank's slice)`` for a tensor-parallel rollout of ``tp_size`` ranks per
        replica (rank ``r`` is TP rank ``r % tp_size``; slices as :func:`verity.resharding.tp_slice_bounds`).

        A collective, like :meth:`iter_full_weights`. The default sends each rank only its slices straight
        from :attr:`model`'s FSDP2 shards (about ``1 / tp_size`` of the weights' bytes received per rank,
        :func:`verity.resharding.iter_tp_slice_buckets`). An engine whose full weights are computed
        (merged adapters, Megatron's layout) overrides :meth:`iter_full_weights`, and then its full
        tensors are gathered and sliced here (every rank receives the whole model). ``stats`` (if given)
        gets ``received_bytes`` and ``sliced_bytes`` added.
        """
        from verity.resharding.tp_reshard import iter_tp_slice_buckets, slice_full_buckets

        if type(self).iter_full_weights is TrainingEngine.iter_full_weights:
            yield from iter_tp_slice_buckets(
                self.model, tp_size, bucket_bytes, dtype=dtype, device=device, stats=stats
            )
            return

        def counted(
            buckets: Iterator[list[tuple[str, torch.Tensor]]],
        ) -> Iterator[list[tuple[str, torch.Tensor]]]:
            for bucket in buckets:  # every full tensor reached this rank (counted whole: an upper bound)
                if stats is not None:
                    got = sum(t.numel() * t.element_size() for _, t in bucket)
                    stats["received_bytes"] = stats.get("received_bytes", 0) + got
                yield bucket

        import torch.distributed as dist

        # the group's rank: an engine's own may count data-parallel replicas (Megatron's)
        rank = dist.get_rank() if dist.is_initialized() else 0
        full = self.iter_full_weights(bucket_bytes, dtype=dtype, device=device)
        yield from slice_full_buckets(counted(full), rank % tp_size, tp_size)

    def adapter_free_reference(self) -> Any | None:
        """With adapters (LoRA): an object whose ``compute_logprobs`` (same arguments as
        :meth:`compute_logprobs`) scores under the base model, adapters disabled, from this
        engine's own weights — the reference policy with no second copy. ``None`` without adapters."""
        return None

    def checkpoint_meta(self) -> dict[str, Any]:
        """Extra facts written beside the checkpoint's shards (``meta.json``), e.g. the adapter settings."""
        return {}

    @abc.abstractmethod
    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Sharded model + optimizer + schedule state for ``torch.distributed.checkpoint``."""

    @abc.abstractmethod
    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict_for_checkpoint` returned (after ``dcp.load``)."""


class EngineUnavailableError(RuntimeError):
    """The requested engine cannot run here (missing hardware or an unimplemented backend)."""
