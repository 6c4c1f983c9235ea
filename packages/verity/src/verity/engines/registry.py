"""Training engines by name: ``actor.engine: fsdp2`` (and ``critic.engine``) picks one here.

An engine registers a build function that turns an :class:`EngineBuildContext`
into a :class:`~verity.engines.base.TrainingEngine`::

    def build_my_engine(ctx: EngineBuildContext) -> TrainingEngine:
        return MyEngine(ctx.load_model(), ctx.optim, total_steps=ctx.total_steps, device=ctx.device)

    register_training_engine("mine", build_my_engine)

The worker of every trained role builds its engine through :func:`build_training_engine`,
so a new engine is one new file plus a registration (in the runtime, or in a plug-in:
see :mod:`verity.plugins`). Engine-specific settings live in a small dataclass the
engine owns; a built-in engine's is a field of the role's config section
(``actor.fsdp2``), a plug-in engine's a plug-in config section of its own. The
built engine's ``name`` is what the run records as having trained — never the
config string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verity.engines.base import TrainingEngine
from verity.engines.lora import LoRAConfig
from verity.engines.model_source import ModelSource
from verity.engines.optim import OptimConfig
from verity.registry import Registry

__all__ = [
    "TRAINING_ENGINES",
    "EngineBuildContext",
    "EngineSpec",
    "build_training_engine",
    "register_training_engine",
]


@dataclass(frozen=True)
class EngineBuildContext:
    """What an engine needs to build one rank's share of a role's model.

    Attributes:
        role: the role being built (``actor``, ``critic``, ``reference`` or a plug-in's).
        load_model: loads the role's HF module at float32 (or ``model.dtype``) on CPU,
            e.g. a causal LM for the actor, a value model for the critic. Call it once.
        model_path: the local HF folder it loads from.
        source: the same model as a :class:`~verity.engines.model_source.ModelSource`, for
            engines that build it empty and give each rank only its shard (FSDP2); ``None``
            when the role's module is only available whole (``load_model``).
        device: where this rank computes.
        optim: the role's optimizer settings; ``None`` for an inference-only engine.
        total_steps: optimizer steps of the whole run (the LR schedule's horizon).
        gradient_checkpointing: recompute activations in backward.
        options: the engine's own settings (its dataclass), or ``None``.
        lora: LoRA adapters to train on the frozen model (``rank > 0``), or ``None``;
            only an engine registered with ``supports_adapters=True`` is given one.
        seed: seeds what the engine initialises itself (the adapters), the same on every rank.
        cfg: the whole run config, for anything else an engine may need.
    """

    role: str
    load_model: Callable[[], nn.Module]
    model_path: str
    device: torch.device
    source: ModelSource | None = None
    optim: OptimConfig | None = None
    total_steps: int = 1
    gradient_checkpointing: bool = False
    options: Any = None
    lora: LoRAConfig | None = None
    seed: int = 0
    cfg: Any = None

    @property
    def adapters(self) -> bool:
        """Whether the engine must train LoRA adapters (``lora.rank > 0``)."""
        return self.lora is not None and self.lora.enabled


@dataclass(frozen=True)
class EngineSpec:
    """A registered training engine: its build function and what it can do.

    ``trains_values``: it can train a value model (a critic: backbone + scalar head).
    ``supports_adapters``: it can train parameter-efficient adapters (LoRA).
    """

    name: str
    build: Callable[[EngineBuildContext], TrainingEngine]
    trains_values: bool = True
    supports_adapters: bool = False


TRAINING_ENGINES: Registry[EngineSpec] = Registry("training engine")


def register_training_engine(
    name: str,
    build: Callable[[EngineBuildContext], TrainingEngine],
    *,
    trains_values: bool = True,
    supports_adapters: bool = False,
) -> None:
    """Make ``build`` the engine called ``name`` (``actor.engine: <name>``)."""
    TRAINING_ENGINES.add(name, EngineSpec(name, build, trains_values, supports_adapters))


def build_training_engine(name: str, ctx: EngineBuildContext) -> TrainingEngine:
    """Build the engine called ``name`` (``UnknownNameError`` lists the known ones).

    ``ValueError`` when ``ctx`` asks for LoRA adapters and the engine does not support them
    (the config check refuses that earlier, naming the keys).
    """
    spec = TRAINING_ENGINES.get(name)
    if ctx.adapters and not spec.supports_adapters:
        raise ValueError(
            f"the {name!r} training engine does not train LoRA adapters ({ctx.role}): "
            "use the fsdp2 engine, or switch LoRA off (lora.rank=0)"
        )
    engine = spec.build(ctx)
    if not isinstance(engine, TrainingEngine):
        raise TypeError(
            f"training engine {name!r} built a {type(engine).__name__}, not a verity.engines.TrainingEngine"
        )
    return engine


def _router_settings(ctx: EngineBuildContext) -> Any:
    """``actor.moe`` for the actor's engine (the reference and the critic route on their own); None otherwise."""
    moe = getattr(getattr(getattr(ctx, "cfg", None), "actor", None), "moe", None)
    if getattr(ctx, "role", None) != "actor" or moe is None:
        return None
    from verity.engines.moe_router import RouterSettings

    return RouterSettings(float(moe.aux_loss_coef), float(moe.z_loss_coef), bool(moe.routing_replay))


def _build_fsdp2(ctx: EngineBuildContext) -> TrainingEngine:
    from verity.engines.fsdp2 import FSDP2Engine

    options = ctx.options
    kwargs: dict[str, Any] = {
        "total_steps": ctx.total_steps,
        "device": ctx.device,
        "gradient_checkpointing": ctx.gradient_checkpointing,
        "mixed_precision": getattr(options, "mixed_precision", None),
        "reshard_after_forward": getattr(options, "reshard_after_forward", True),
        "sharding": getattr(options, "sharding", "full"),
        "micro_batch_tokens": getattr(options, "micro_batch_tokens", 0),
        "attn_implementation": getattr(options, "attn_implementation", None),
        "compile_layers": bool(getattr(options, "compile", False)),
        "cuda_graphs": bool(getattr(options, "cuda_graphs", False)),
        "offload_params": bool(getattr(options, "offload_params", False)),
        "offload_optimizer": bool(getattr(options, "offload_optimizer", False)),
        "shard_vocab": getattr(options, "shard_vocab", None),
        "packed": getattr(options, "packed", None),
        "ulysses_sequence_parallel_size": int(getattr(options, "ulysses_sequence_parallel_size", 1)),
        "router": _router_settings(ctx),
    }
    if ctx.adapters:
        from verity.engines.fsdp2_lora import FSDP2LoRAEngine

        assert ctx.lora is not None
        # a ModelSource streams the frozen base as for full training (several ranks, sharding=full)
        return FSDP2LoRAEngine(
            ctx.source if ctx.source is not None else ctx.load_model(),
            ctx.optim,
            lora=ctx.lora,
            seed=ctx.seed,
            base_model_path=ctx.model_path,
            **kwargs,
        )
    return FSDP2Engine(ctx.source if ctx.source is not None else ctx.load_model(), ctx.optim, **kwargs)


register_training_engine("fsdp2", _build_fsdp2, supports_adapters=True)


def _build_megatron(ctx: EngineBuildContext) -> TrainingEngine:
    from verity.engines.megatron import MegatronEngine

    if ctx.gradient_checkpointing:
        raise ValueError(
            "the megatron engine does not implement activation recomputation (model.gradient_checkpointing)"
        )
    model = ctx.source if ctx.source is not None else ctx.load_model()
    return MegatronEngine(
        model,
        ctx.optim,
        ctx.options,
        total_steps=ctx.total_steps,
        device=ctx.device,
        router=_router_settings(ctx),
    )


register_training_engine("megatron", _build_megatron, trains_values=False, supports_adapters=False)
