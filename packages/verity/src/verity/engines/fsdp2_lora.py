"""FSDP2 training of LoRA adapters over a frozen base model (``actor.lora.rank > 0``).

What changes against :class:`~verity.engines.fsdp2.FSDP2Engine` (everything else — the
micro-batch loop, the global loss aggregation, sum-reduced gradients, clipping, the LR
schedule — is the same code):

- **the model**: ``peft`` injects LoRA layers into the HF model in place
  (:func:`~verity.engines.lora.apply_lora`); the engine trains that HF model (names such as
  ``model.layers.0.self_attn.q_proj.lora_A.default.weight``), so log-probs and the loss go
  through exactly the forward pass a plain model takes;
- **loading**: given a :class:`~verity.engines.model_source.ModelSource` on several ranks
  under ``sharding="full"``, the base streams (``self.streamed``): the model is built empty,
  the adapters are injected (:func:`~verity.engines.lora.apply_lora_to_empty`, which keeps
  their seeded initial values, bitwise those of a whole load), the model is sharded, the
  base filled from the checkpoint under its plain names, and each rank copies its rows of
  the adapters' initial values;
- **sharding**: ``fully_shard`` per decoder layer, then the root, as for full training. A
  decoder layer's FSDP2 group then holds frozen base weights and trainable adapters side by
  side. FSDP2 keeps one ``FSDPParam`` per parameter: the all-gather carries both (mixed
  dtypes go through a byte buffer), but only parameters that received a gradient are
  reduce-scattered, and only trainable parameters must share one dtype — so a bf16 base
  with float32 adapters shards correctly, and no gradient memory is spent on the base
  (``torch.distributed.fsdp._fully_shard._fsdp_param_group``, torch 2.13);
- **the optimizer** holds AdamW moments for the adapters only (``build_optimizer`` takes
  the parameters with ``requires_grad``);
- **the reference for free**: :meth:`FSDP2LoRAEngine.adapter_free_reference` scores with the
  adapters disabled (``peft``'s ``disable_adapter``): the base model's log-probs from the same
  weights, with no second copy;
- **weight sync** (:meth:`FSDP2LoRAEngine.iter_full_weights`): merged weights ``W + s B A``
  under the plain HF names (:mod:`verity.resharding.lora_merge`);
- **checkpoints** hold the adapters, their optimizer state, the LR schedule and the step
  (``ignore_frozen_params``); the base is reloaded from the model path on resume, and
  :meth:`FSDP2LoRAEngine.checkpoint_meta` records the adapter settings and that path for
  ``verity export``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
)

from verity.engines.fsdp2 import FSDP2Engine
from verity.engines.hf_loading import load_causal_lm
from verity.engines.lora import ADAPTER_NAME, LoRAConfig, apply_lora, apply_lora_to_empty
from verity.engines.model_source import ModelSource
from verity.engines.optim import OptimConfig
from verity.resharding.lora_merge import iter_merged_weight_buckets, lora_sources, plain_name

#: sharded state of the trainable parameters only: the frozen base is not saved
_ADAPTER_STATE = StateDictOptions(full_state_dict=False, ignore_frozen_params=True)
# loading fills only the adapters (the frozen base is not in the state): not strict
_ADAPTER_LOAD = StateDictOptions(full_state_dict=False, ignore_frozen_params=True, strict=False)


class FSDP2LoRAEngine(FSDP2Engine):
    """FSDP2 training of LoRA adapters (see the module docstring).

    Args:
        model: the base model: an HF causal LM module, a local checkpoint directory (loaded
            whole), or a :class:`~verity.engines.model_source.ModelSource`, which streams as
            for :class:`~verity.engines.fsdp2.FSDP2Engine` (several ranks, ``sharding="full"``,
            safetensors): built empty with the adapters injected, sharded, each rank filled
            with its rows of the base, then of the adapters' seeded initial values.
        optim_config: AdamW and LR-schedule settings for the adapters (``None``: inference only).
        lora: the adapter settings (``rank > 0``).
        seed: seeds the adapters' initialisation (the same on every rank).
        base_model_path: the folder the base weights come from, recorded in checkpoints.
        **kwargs: as for :class:`~verity.engines.fsdp2.FSDP2Engine`.
    """

    name = "fsdp2"

    def __init__(
        self,
        model: nn.Module | ModelSource | str | Path,
        optim_config: OptimConfig | None = None,
        *,
        lora: LoRAConfig,
        seed: int = 0,
        base_model_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("shard_vocab"):
            raise ValueError("shard_vocab=True: LoRA's frozen base is not wired for a row-sharded vocabulary")
        kwargs["shard_vocab"] = False  # the frozen base keeps its vocabulary in FSDP2's root unit
        if base_model_path is None and isinstance(model, (str, Path)):
            base_model_path = str(model)
        elif base_model_path is None and isinstance(model, ModelSource):
            base_model_path = model.path
        if isinstance(model, (str, Path)):
            model = load_causal_lm(model)
        self.lora = lora
        self.seed = seed
        self.base_model_path = base_model_path
        # streamed: the adapters' initial values (whole, on CPU) until each rank has copied its rows
        self._adapter_init: dict[str, torch.Tensor] = {}
        # _prepare_module (called by the base __init__) injects the adapters
        super().__init__(model, optim_config, **kwargs)

    def _prepare_module(self, module: nn.Module) -> None:
        """Inject the adapters (seeded with ``seed``) before the model moves or shards."""
        if self.streamed:
            self.peft_model, self._adapter_init = apply_lora_to_empty(module, self.lora, seed=self.seed)
        else:
            self.peft_model = apply_lora(module, self.lora, seed=self.seed)
        self.adapted_layers = [s.layer for s in lora_sources(module).values()]

    def _checkpoint_name(self, name: str) -> str | None:
        """A base weight's name in the checkpoint (without ``base_layer``); None for an adapter."""
        return plain_name(name)

    def _init_fresh_parameters(self) -> None:
        """Give each rank its rows of the adapters' initial values (the fill left them at zero)."""
        init, self._adapter_init = self._adapter_init, {}
        with torch.no_grad():
            for name, param in self._module.named_parameters():
                if name not in init:
                    continue
                local = param.to_local() if hasattr(param, "to_local") else param
                full = init.pop(name)
                if tuple(local.shape) == tuple(full.shape):
                    local.copy_(full)
                    continue
                rows = math.ceil(full.shape[0] / self.world_size)
                start = min(self.rank * rows, full.shape[0])
                if tuple(local.shape) != (min(rows, full.shape[0] - start), *full.shape[1:]):
                    raise RuntimeError(
                        f"adapter {name!r}: rank {self.rank} holds {list(local.shape)} of {list(full.shape)}, "
                        "not torch.chunk's dim-0 rows"
                    )
                local.copy_(full[start : start + local.shape[0]])
        if init:
            raise RuntimeError(f"adapters left without initial values: {sorted(init)[:3]}")

    # -------------------------------------------------------------- adapters
    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """Within the block the model computes as the base model (the adapters are bypassed)."""
        with self.peft_model.disable_adapter():
            yield

    def adapter_free_reference(self) -> AdapterFreeReference:
        """The reference policy for free: this engine's base model, adapters disabled."""
        return AdapterFreeReference(self)

    def iter_full_weights(
        self,
        bucket_bytes: int = 256 * 1024 * 1024,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Merged weights ``W + s B A`` (and every other weight) under the base model's HF names.

        A collective, like the base method; see :mod:`verity.resharding.lora_merge`.
        """
        yield from iter_merged_weight_buckets(
            self._module, bucket_bytes, dtype=dtype, device=device, adapter=ADAPTER_NAME
        )

    # ------------------------------------------------------------ checkpoint
    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint must say about the adapters to be resumed or exported."""
        return {
            "adapter": {
                "type": "lora",
                "rank": self.lora.rank,
                "alpha": float(self.lora.alpha),
                "dropout": float(self.lora.dropout),
                "target_modules": sorted({layer.rsplit(".", 1)[-1] for layer in self.adapted_layers}),
                "exclude_modules": list(self.lora.exclude_modules),
                "adapted_layers": len(self.adapted_layers),
                "base_model": self.base_model_path,
                "base_dtype": str(self._base_dtype()).removeprefix("torch."),
            }
        }

    def _base_dtype(self) -> torch.dtype:
        """The dtype of the frozen base weights (what the merged model is made in)."""
        for param in self._module.parameters():
            if not param.requires_grad:
                return param.dtype
        return torch.float32

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """``{"model", "optimizer", "lr_scheduler", "global_step"}`` with only the adapters' tensors."""
        state = self._capture_state(_ADAPTER_STATE)
        model_sd = state["model"]
        # ignore_frozen_params drops frozen parameters under their first name only: a tied alias
        # (lm_head.weight = embed_tokens.weight) would stay; keep exactly the trained tensors
        trainable = self._trainable_names()
        state["model"] = {name: value for name, value in model_sd.items() if name in trainable}
        return state

    def _trainable_names(self) -> set[str]:
        return {n for n, p in self._module.named_parameters() if p.requires_grad}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restore the adapters (and their optimizer state) from :meth:`state_dict_for_checkpoint`."""
        if "model" not in state:
            raise KeyError("checkpoint state has no 'model' entry")
        missing = sorted(self._trainable_names() - set(state["model"]))
        if missing:
            raise KeyError(
                f"the checkpoint has no value for {len(missing)} adapter tensors, e.g. {missing[:3]}"
            )
        self._restore_state(state, _ADAPTER_LOAD)


class AdapterFreeReference:
    """The reference policy of a LoRA run: the actor engine's model with its adapters disabled.

    With adapters disabled every LoRA layer computes ``base_layer(x)`` alone, so these
    log-probs are those of the base model, from the weights the actor already holds — no
    second copy of the model (``docs/engines.md``, "LoRA").
    """

    name = "adapters-disabled"

    def __init__(self, engine: FSDP2LoRAEngine) -> None:
        self.engine = engine

    def compute_logprobs(
        self,
        batch: Any,
        micro_batch_size: int,
        temperature: float = 1.0,
        *,
        compute_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base model's log-probs (and entropy) of the responses, ``[B, R]`` float32 on CPU."""
        with self.engine.adapters_disabled():
            return self.engine.compute_logprobs(
                batch, micro_batch_size, temperature, compute_entropy=compute_entropy
            )
