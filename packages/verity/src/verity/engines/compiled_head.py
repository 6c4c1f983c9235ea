"""The loss head as two inductor kernels: log-probs, entropy and their backward without ``[N, V]`` temporaries.

For logits ``x [N, V]`` at temperature ``tau``, ``z = x / tau``::

    lse     = log sum_v exp(z_v)                       (one pass: online max and sum)
    log p_y = z_y - lse
    H       = sum_v exp(z_v - lse) (lse - z_v)
    d log p_y / d x_v = (1[v = y] - exp(z_v - lse)) / tau

The forward is one fused reduction per row that reads the (bf16) logits and writes three
``[N]`` vectors (``log p_y``, ``H``, ``lse``); the backward is one pointwise kernel that
reads the logits and the saved ``lse`` and writes the gradient in the logits' dtype.
Against the eager chunked head of :mod:`verity.engines.fused_logprobs` (a float32
``log_softmax`` per chunk, ``exp``, a product and a sum forward; a ``softmax``, a scaled
scatter and a cast backward) that is two reads and one write of ``[N, V]`` per micro-batch
instead of about a dozen passes, most of them float32.

On CUDA the same math runs as hand-written Triton kernels that read each row once
(:mod:`verity.engines.triton_head`); inductor's forward loops over a row once for each of
its reductions (its CPU code: maximum, normaliser, entropy), and on a GPU it was slower than
the Triton forward (``ci/reports/2026-12-06-docstring-figures.md``).

Engines use it when their layers are compiled (``fsdp2.compile=true``), in the training
pass and in every no-grad pass alike, so that recomputed and training log-probs come from
the same kernel. Both functions are compiled once per vocabulary size, with the number of
rows dynamic; the values equal the eager head's up to float32 rounding.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KERNEL_CHOICES", "CompiledChosenTokenLogprobs", "head_backward", "head_forward", "use_kernels"]


def head_forward(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p(labels) [N], entropy [N], lse [N])`` of ``logits [N, V] / temperature``, at least float32."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    shifted = lse.unsqueeze(-1) - z  # -log p_v >= 0: a sum of non-negative terms, no cancellation
    entropy = (torch.exp(-shifted) * shifted).sum(-1)
    return logprobs, entropy, lse


def head_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_logprobs: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """``d sum_i g_i log p_i(labels_i) / d logits``: ``[N, V]`` in the logits' dtype.

    ``lse [N]``: the forward's normaliser; ``grad_logprobs [N]``: ``g``.
    """
    z = logits.to(lse.dtype)
    if temperature != 1.0:
        z = z / temperature
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab.unsqueeze(0) == labels.unsqueeze(-1)).to(lse.dtype)
    scale = (grad_logprobs.to(lse.dtype) / temperature).unsqueeze(-1)
    return ((onehot - torch.exp(z - lse.unsqueeze(-1))) * scale).to(logits.dtype)


_COMPILED: dict[str, Any] = {}
KERNEL_CHOICES = ("auto", "inductor", "triton")
_kernels = "auto"


def use_kernels(name: str) -> None:
    """Which kernels the compiled head runs: ``auto`` (Triton's on CUDA for 16/32-bit logits,
    inductor's elsewhere), ``inductor`` or ``triton`` (CUDA only). A benchmark's switch."""
    global _kernels
    if name not in KERNEL_CHOICES:
        raise ValueError(f"compiled head kernels must be one of {list(KERNEL_CHOICES)}, got {name!r}")
    _kernels = name


def _triton_kernels_for(logits: torch.Tensor) -> bool:
    """Whether :mod:`verity.engines.triton_head` computes this call."""
    if _kernels == "inductor":
        return False
    fits = logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if _kernels == "triton" and not fits:
        raise ValueError(
            f"the Triton loss head runs 16/32-bit logits on CUDA, got {logits.dtype} on {logits.device}"
        )
    return fits and logits.stride(-1) == 1


def _compiled(name: str) -> Any:
    """``head_forward`` / ``head_backward`` through inductor, compiled on first use."""
    if name not in _COMPILED:
        fn = {"forward": head_forward, "backward": head_backward}[name]
        _COMPILED[name] = torch.compile(fn, fullgraph=True)
    return _COMPILED[name]


def _rows_dynamic(*tensors: torch.Tensor) -> None:
    """Any number of rows, one compiled kernel; the vocabulary stays a constant in it.

    A symbolic vocabulary size would turn the kernels' row/column index arithmetic into
    64-bit divisions by a runtime value, the slowest integer operation a GPU has.
    """
    for t in tensors:
        if t.shape[0] > 1:  # 0 and 1 are specialised by dynamo whatever the marks say
            torch._dynamo.mark_dynamic(t, 0)


class CompiledChosenTokenLogprobs(torch.autograd.Function):
    """``(log p(labels) [N], entropy [N] or empty)`` from ``logits [N, V]`` by the compiled kernels."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, temperature: float, compute_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _triton_kernels_for(logits):
            from verity.engines.triton_head import triton_head_forward

            logprobs, entropy, lse = triton_head_forward(logits, labels, temperature)
            ctx.triton = True
        else:
            _rows_dynamic(logits, labels)
            logprobs, entropy, lse = _compiled("forward")(logits, labels, temperature)
            ctx.triton = False
        if not compute_entropy:
            entropy = entropy.new_empty(0)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, _grad_entropy: Any) -> tuple[Any, ...]:  # type: ignore[override]
        logits, labels, lse = ctx.saved_tensors
        grad_logprobs = grad_logprobs.contiguous()
        if ctx.triton:
            from verity.engines.triton_head import triton_head_backward

            grad = triton_head_backward(logits, labels, lse, grad_logprobs, ctx.temperature)
        else:
            _rows_dynamic(logits, labels, lse, grad_logprobs)
            grad = _compiled("backward")(logits, labels, lse, grad_logprobs, ctx.temperature)
        return grad, None, None, None
