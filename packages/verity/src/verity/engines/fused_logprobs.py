"""Log-probabilities of chosen tokens with a hand-written backward, chunk by chunk over the vocabulary.

For logits ``x [N, V]`` at temperature ``tau``, ``z = x / tau``, the log-probability of
label ``y`` and its gradient are::

    log p(y) = z_y - lse(z)                     lse(z) = log sum_v exp(z_v)
    d log p(y) / d x_v = (1[v = y] - softmax(z)_v) / tau

and the entropy (returned without a gradient) is ``H = -sum_v p_v (z_v - lse)``.

Autograd's version of the same computation keeps a float32 copy of the logits for the
backward and makes several full passes over ``[N, V]`` in both directions: the float32
cast, the normaliser's backward, ``gather``'s dense zero-filled gradient, their sum and
the cast back. With a vocabulary of 151,936 those passes, not the matrix products, are what a
training step's loss head costs. :class:`ChosenTokenLogprobs` keeps only the logits as
they are (bf16 under autocast: half the bytes of the float32 copy); forward and backward
each work on ``chunk_tokens`` rows at a time in float32 — forward one ``log_softmax``
(the chosen entry, and the entropy from ``p`` and ``log p``),
backward one ``softmax`` that becomes the gradient in place — and write the gradient
straight into the logits' dtype.

Every log-prob pass of the engines computes here or through :func:`rows_log_softmax`
(:func:`verity.engines.logprobs.logprobs_and_entropy_from_logits`), so no-grad and training
passes agree to the bit; the gradient equals autograd's up to float32 rounding.
"""

from __future__ import annotations

from typing import Any

import torch


def _float_chunk(logits: torch.Tensor, start: int, end: int, temperature: float) -> torch.Tensor:
    """``logits[start:end] / temperature`` as a fresh tensor of at least float32 precision."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits[start:end].to(dtype, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def rows_log_softmax(logits: torch.Tensor, start: int, end: int, temperature: float) -> torch.Tensor:
    """``log_softmax(logits[start:end] / temperature)`` in at least float32, a fresh tensor.

    Every log-prob pass computes through this one function, so that a no-grad pass and a
    training pass give the same bits for the same row (the on-policy PPO ratio is exactly 1).
    At temperature 1 the 16-bit logits go straight into ``log_softmax(..., dtype=float32)``
    (on CUDA one kernel reads bf16 and writes float32), not through a float32 copy first.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if temperature == 1.0:
        return torch.log_softmax(logits[start:end], dim=-1, dtype=dtype)
    return torch.log_softmax(_float_chunk(logits, start, end, temperature), dim=-1)


def _chunk_softmax(logits: torch.Tensor, start: int, end: int, temperature: float) -> torch.Tensor:
    """``softmax(logits[start:end] / temperature)`` in at least float32, a fresh tensor."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if temperature == 1.0:
        return torch.softmax(logits[start:end], dim=-1, dtype=dtype)
    return torch.softmax(_float_chunk(logits, start, end, temperature), dim=-1)


class ChosenTokenLogprobs(torch.autograd.Function):
    """``(log p(labels) [N], entropy [N] or empty)`` from ``logits [N, V]``; only the log-probs carry a gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk_tokens: int,
        compute_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = logits.shape[0]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logprobs = torch.empty(rows, dtype=dtype, device=logits.device)
        entropy = torch.empty(rows if compute_entropy else 0, dtype=dtype, device=logits.device)
        for start in range(0, rows, chunk_tokens):
            end = min(start + chunk_tokens, rows)
            logp = rows_log_softmax(logits, start, end, temperature)  # [n, V]
            logprobs[start:end] = logp.gather(-1, labels[start:end].unsqueeze(-1)).squeeze(-1)
            if compute_entropy:
                # H = -sum_v p_v log p_v; the product is written over p
                entropy[start:end] = -logp.exp().mul_(logp).sum(-1)
        ctx.save_for_backward(logits, labels)
        ctx.temperature = temperature
        ctx.chunk_tokens = chunk_tokens
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, _grad_entropy: Any) -> tuple[Any, ...]:  # type: ignore[override]
        logits, labels = ctx.saved_tensors
        temperature, chunk_tokens = ctx.temperature, ctx.chunk_tokens
        grad = torch.empty_like(logits)
        scale = grad_logprobs / temperature if temperature != 1.0 else grad_logprobs
        for start in range(0, logits.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, logits.shape[0])
            p = _chunk_softmax(logits, start, end, temperature)
            g = scale[start:end].unsqueeze(-1).to(p.dtype)
            p.mul_(-g).scatter_add_(-1, labels[start:end].unsqueeze(-1), g)
            grad[start:end] = p
        return grad, None, None, None, None


def chosen_token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    compute_entropy: bool = True,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels [N]`` under ``logits [N, V] / temperature`` (with a gradient) and the entropy (without).

    Returns ``(logprobs [N], entropy [N] or None)`` in float32 (float64 for float64 logits),
    natural-log units. See the module docstring for the math and the memory it saves.
    ``compiled``: the same math as two inductor kernels over all ``N`` rows at once
    (:mod:`verity.engines.compiled_head`; ``chunk_tokens`` is then unused: nothing of
    size ``[N, V]`` is made but the gradient).
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [N, V] and labels [N], got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if compiled:
        from verity.engines.compiled_head import CompiledChosenTokenLogprobs

        logprobs, entropy = CompiledChosenTokenLogprobs.apply(
            logits, labels, float(temperature), bool(compute_entropy)
        )
    else:
        logprobs, entropy = ChosenTokenLogprobs.apply(
            logits, labels, float(temperature), int(chunk_tokens), bool(compute_entropy)
        )
    return logprobs, (entropy if compute_entropy else None)
