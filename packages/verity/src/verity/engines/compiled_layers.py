"""Decoder layers compiled with ``torch.compile`` (inductor): fused kernels for the elementwise work.

On a CPU that multiplies bf16 in hardware the matmuls of a training pass are no longer
most of its time: most goes to memory-bound elementwise kernels — dtype casts, ``mul``
(RMSNorm, SiLU gating, rotary), adds, softmax (a profile:
``ci/reports/2026-12-06-docstring-figures.md``). Inductor fuses those into a few loops per layer.

Each decoder layer is compiled in place (``nn.Module.compile``), so parameter names,
``state_dict`` keys, checkpoints and the weight sync to the rollout are unchanged.
Compilation is ``dynamic=True``: micro-batches of any length share one graph, and
every layer shares it as well (the engine runs the model without a KV cache, so no
per-layer state enters the guards). Training and no-grad passes compile one graph each;
the first pass of each pays the compile (slow on a CPU), later passes reuse it.

Inductor generates C++ on CPU (it needs a C++ compiler: ``g++`` or ``clang++``) and
Triton kernels on CUDA; :func:`compile_unavailable_reason` says, before any compute,
what is missing.

**CUDA graphs** (``cuda_graphs=True``, CUDA only): the training passes (gradients
enabled) of each layer run through ``mode="reduce-overhead"``: inductor records the
layer's forward and backward kernels once per distinct input shape and replays them
with one launch, so the host no longer issues each kernel of each layer of each
micro-batch. Consecutive layers form one path of a CUDA-graph tree sharing one memory
pool: a layer's output feeds the next layer's graph without a copy. No-grad passes
(log-probs) use a second compiled function without graphs: there each layer call starts
a new graph generation, which would free the previous layer's output before the next
layer reads it. The engine keeps its gradients in buffers allocated outside the graphs'
pool (zeroed, never set to None), so the replays' gradients accumulate into them.
Every new micro-batch shape records a new graph (a warm-up pass, a recording, and its own
activations in the shared pool): runs whose micro-batches vary in length pay that per
length seen.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["check_cuda_graphs", "compile_decoder_layers", "compile_unavailable_reason"]


def compile_unavailable_reason(device: torch.device) -> str | None:
    """Why inductor cannot compile for ``device`` here (a sentence), or None when it can.

    CPU: a C++ compiler on the ``PATH`` (inductor's own search: ``$CXX`` then ``g++``);
    CUDA: an importable ``triton``.
    """
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch.compile on CUDA generates Triton kernels, and the triton package is not installed"
        return None
    if device.type != "cpu":
        return f"torch.compile of the training layers is supported on cpu and cuda devices, not {device.type!r}"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as err:  # inductor raises its own InvalidCxxCompiler when the search fails
        return (
            "torch.compile on CPU generates C++ and no C++ compiler was found "
            f"(install one, e.g. apt-get install g++, or name it in $CXX): {err}"
        )
    return None


def compile_decoder_layers(
    layers: list[nn.Module],
    device: torch.device,
    *,
    cuda_graphs: bool = False,
) -> int:
    """Compile each of ``layers`` in place with inductor (``dynamic=True``); returns how many.

    ``cuda_graphs``: training passes through CUDA graphs (``mode="reduce-overhead"``), no-grad
    passes through a plain compiled function (see the module doc); the caller must keep
    gradients in buffers outside the graphs' pool. Raises ``RuntimeError`` with
    :func:`compile_unavailable_reason` when inductor cannot run on ``device``, ``ValueError``
    when there are no layers to compile or ``cuda_graphs`` is asked for off CUDA.
    """
    reason = compile_unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"compile=true: {reason}")
    if not layers:
        raise ValueError("compile=true: the model has no repeated decoder layers to compile")
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=true: CUDA graphs need a CUDA device, this engine runs on {device.type!r}")
    for layer in layers:
        if cuda_graphs:
            layer.forward = _graphed_when_training(layer.forward)
        else:
            layer.compile(dynamic=True)
    return len(layers)


def _graphed_when_training(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` compiled twice: with CUDA graphs while gradients are on, without them otherwise."""
    training = torch.compile(forward, dynamic=True, mode="reduce-overhead")
    inference = torch.compile(forward, dynamic=True)

    @functools.wraps(forward)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return (training if torch.is_grad_enabled() else inference)(*args, **kwargs)

    dispatch.cuda_graphs = True  # type: ignore[attr-defined]  # what the engine reports as ran
    return dispatch


def check_cuda_graphs(
    device: torch.device, compile_layers: bool, gradient_checkpointing: bool, sharding: str
) -> None:
    """``ValueError`` naming what rules CUDA graphs out for an engine, if anything does."""
    if not compile_layers:
        raise ValueError("cuda_graphs=True replays the compiled layers: it needs compile_layers=True")
    if gradient_checkpointing:
        raise ValueError(
            "cuda_graphs=True does not combine with gradient_checkpointing (the recomputed forward "
            "would run inside the graphed backward); switch one off"
        )
    if sharding == "full" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "cuda_graphs=True needs unsharded layers: FSDP2 gathers each layer's weights into new "
            "memory every pass, and a graph replays fixed addresses; use sharding='replicate'"
        )
    if device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device; this engine runs on {device.type!r}")
