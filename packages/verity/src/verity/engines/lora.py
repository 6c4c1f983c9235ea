r"""LoRA adapters (low-rank adaptation, Hu et al. 2021, arXiv:2106.09685) on a causal LM, with ``peft``.

A LoRA layer keeps a frozen base weight :math:`W \in \mathbb{R}^{d_{out} \times d_{in}}` and
trains two small matrices :math:`A \in \mathbb{R}^{r \times d_{in}}` and
:math:`B \in \mathbb{R}^{d_{out} \times r}`:

.. math::
    y = W x + s \, B (A\, \mathrm{dropout}(x)), \qquad s = \alpha / r

(the bias, if any, stays frozen). ``A`` starts random (Kaiming-uniform), ``B`` at zero, so
the adapted model starts as the base model. Merged, the layer is the plain linear layer
with weight :math:`W + s\,BA` (:func:`merge_lora_weight`): what the rollout receives and
what ``verity export`` writes.

Gradients of the adapters follow from the gradient :math:`G = \partial L / \partial W_{eff}`
of the loss with respect to the merged weight :math:`W_{eff} = W + sBA` (dropout off):

.. math::
    \partial L / \partial A = s\, B^\top G, \qquad \partial L / \partial B = s\, G A^\top

— the identity ``tests/integration/test_lora_engine.py`` checks the engine against.

Config: :class:`LoRAConfig` (``actor.lora``); ``rank: 0`` (the default) switches LoRA off.
``peft`` is imported only when an adapter is built.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from verity.resharding.lora_merge import lora_sources, merge_lora_weight, plain_name

__all__ = [
    "ADAPTER_NAME",
    "LoRAConfig",
    "apply_lora",
    "apply_lora_to_empty",
    "check_lora_targets",
    "merge_lora_weight",
    "peft_available",
    "peft_lora_config",
]

#: the name peft gives the one adapter verity trains
ADAPTER_NAME = "default"


@dataclass
class LoRAConfig:
    """Low-rank adapters on the trained model (``actor.lora``); ``rank: 0`` = off (train every weight)."""

    rank: int = 0  # r, the adapters' inner dimension; 0: no LoRA, every weight trains
    alpha: float = 16.0  # scale of the adapter's output: s = alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input during training (0: none)
    # module names (or name suffixes) that get adapters; null: every linear layer of the
    # decoder (attention q/k/v/o and MLP gate/up/down projections; never the output layer)
    target_modules: list[str] | None = None
    exclude_modules: list[str] = field(
        default_factory=list
    )  # module names (or suffixes) left without adapters

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (``rank > 0``)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on ``B @ A``."""
        return self.alpha / self.rank if self.rank > 0 else 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that is out of range."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be an int >= 0 (0: LoRA off), got {self.rank!r}")
        if not self.enabled:
            return
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"alpha must be a number > 0, got {self.alpha!r}")
        if not math.isfinite(float(self.alpha)):
            raise ValueError(f"alpha must be finite, got {self.alpha!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.target_modules is not None:
            names = list(self.target_modules)
            if not names or any(not isinstance(n, str) or not n for n in names):
                raise ValueError(
                    f"target_modules must be a non-empty list of module names, or null for every linear "
                    f"layer of the decoder, got {self.target_modules!r}"
                )
        if any(not isinstance(n, str) or not n for n in self.exclude_modules):
            raise ValueError(f"exclude_modules must be a list of module names, got {self.exclude_modules!r}")

    def describe(self) -> str:
        """A one-line summary, e.g. ``lora(rank=8, alpha=16, targets=all-linear)``."""
        targets = "all-linear" if self.target_modules is None else ",".join(self.target_modules)
        return f"lora(rank={self.rank}, alpha={self.alpha:g}, targets={targets})"


def peft_available() -> bool:
    """Whether ``peft`` can be imported."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True


def linear_targets(model: nn.Module) -> list[str] | str:
    """What ``target_modules: null`` adapts in ``model``: ``"all-linear"`` (peft's every linear layer but the
    output layer), or for a mixture-of-experts model the names of its ``nn.Linear`` layers only.

    peft's ``all-linear`` also wraps a Qwen3-MoE router and its routed experts (3-D parameters, not
    linear layers), which verity neither merges into the rollout nor exports; on an MoE model the
    adapters therefore go on the attention projections (and a Qwen2-MoE shared expert's MLP and
    gate), while the routers and the routed experts stay frozen (docs/lora.md).
    """
    if not any(type(m).__name__.endswith("TopKRouter") for m in model.modules()):
        return "all-linear"
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not output})


def peft_lora_config(config: LoRAConfig, model: nn.Module | None = None) -> Any:
    """The ``peft.LoraConfig`` of ``config`` (task ``CAUSAL_LM``, biases frozen); ``model`` decides what
    ``target_modules: null`` adapts (:func:`linear_targets`; None: peft's ``all-linear``)."""
    from peft import LoraConfig

    default = "all-linear" if model is None else linear_targets(model)
    return LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules) if config.target_modules is not None else default,
        exclude_modules=list(config.exclude_modules) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, config: LoRAConfig, *, seed: int = 0) -> Any:
    """Wrap ``model`` (an HF causal LM) in a ``peft`` LoRA model; only the adapters train.

    The adapters are injected into ``model`` in place (its ``nn.Linear`` targets become
    ``peft`` LoRA layers with ``base_layer``, ``lora_A``, ``lora_B``); every base weight gets
    ``requires_grad=False``. ``A`` is drawn from a generator seeded with ``seed`` whatever the
    global RNG did before, so every data-parallel rank builds the same adapters.

    Returns the ``peft.PeftModel`` (``.base_model.model`` is ``model``). ``ValueError`` when a
    target module is not in the model (peft's message names it).
    """
    from peft import get_peft_model

    config.validate()
    if not config.enabled:
        raise ValueError("apply_lora: LoRA is off (rank 0)")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads transformers' deprecated is_gradient_checkpointing (a FutureWarning per process)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        return get_peft_model(model, peft_lora_config(config, model), adapter_name=ADAPTER_NAME)


def apply_lora_to_empty(
    model: nn.Module, config: LoRAConfig, *, seed: int = 0
) -> tuple[Any, dict[str, torch.Tensor]]:
    """:func:`apply_lora` on a model whose parameters are on ``meta``; keep the adapters' values.

    ``peft`` draws ``A`` on the CPU and then moves each adapter to its base layer's device:
    on ``meta`` the values would be lost. So every ``meta`` parameter is stood in for, while
    ``peft`` runs, by a CPU tensor of its shape and dtype that has no storage (one element,
    expanded); ``peft`` then makes exactly the adapters it makes on the whole model — same
    generator, same draws, same dtype cast — and the stand-ins are swapped back. The
    adapters then move to ``meta`` too (a sharding engine materializes the model as one).

    Returns the ``peft.PeftModel`` and the adapters' initial values by parameter name
    (whole tensors on CPU, bitwise those :func:`apply_lora` gives the whole model with the
    same ``seed``), for the engine to copy each rank's rows from after sharding.
    """
    stand_ins: list[tuple[nn.Module, str, nn.Parameter]] = []
    for owner in model.modules():
        for attr, param in list(owner._parameters.items()):
            if param is not None and param.device.type == "meta":
                stand_ins.append((owner, attr, param))
                fake = torch.empty((), dtype=param.dtype).expand(param.shape)
                owner._parameters[attr] = nn.Parameter(fake, requires_grad=param.requires_grad)
    try:
        peft_model = apply_lora(model, config, seed=seed)
    finally:
        for owner, attr, param in stand_ins:
            param.requires_grad_(owner._parameters[attr].requires_grad)  # peft freezes the base
            owner._parameters[attr] = param
    initial: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            continue
        if plain_name(name) is not None:
            raise RuntimeError(f"apply_lora_to_empty: {name!r} is real but not an adapter weight")
        initial[name] = param.detach().clone()
    for owner in model.modules():
        for attr, param in list(owner._parameters.items()):
            if param is not None and param.device.type != "meta":
                owner._parameters[attr] = nn.Parameter(
                    param.detach().to("meta"), requires_grad=param.requires_grad
                )
    return peft_model, initial


def check_lora_targets(model_path: str, config: LoRAConfig) -> list[str]:
    """The modules of the model at ``model_path`` that would get adapters (built on the meta device).

    Cheap (no weights are read): the driver calls it before any worker starts, so a target
    that does not exist fails as a config error. Returns the adapted module names.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    peft_model = apply_lora(model, config)
    return [source.layer for source in lora_sources(peft_model.base_model.model).values()]


@contextlib.contextmanager
def adapters_disabled(peft_model: Any) -> Iterator[None]:
    """Within the block the model computes as its base model (``peft``'s ``disable_adapter``)."""
    with peft_model.disable_adapter():
        yield
