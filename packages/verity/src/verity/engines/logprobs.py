"""Per-token log-probabilities and entropy of response tokens, from a causal LM's logits.

Layout (the verl layout): ``input_ids [B, P+R]`` is a left-padded prompt of length
``P`` followed by a right-padded response ``responses [B, R]``. The logit at position
``t`` predicts the token at ``t + 1``, so the response tokens ``input_ids[:, P:P+R]``
are predicted by the logits at positions ``P-1 .. P+R-2``.

For logits ``z`` over a vocabulary of size ``V`` and sampling temperature ``tau``::

    z' = z / tau
    log p(y) = z'_y - logsumexp(z')
    H        = logsumexp(z') - sum_v softmax(z')_v * z'_v

Memory: the full log-softmax over ``[N, V]`` is never materialised; the functions
work in float32 on chunks of at most ``chunk_tokens`` rows (without autograd) so
that the extra memory is bounded by ``chunk_tokens * V * 4`` bytes whatever the
batch size. With autograd, chunking does not bound saved activations, so a
single pass is used there.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

DEFAULT_CHUNK_TOKENS = 4096


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``labels`` and entropy of the tempered distribution.

    Args:
        logits: ``[..., V]`` unnormalised scores (any float dtype; computed in float32).
        labels: ``[...]`` int64 token ids, same leading shape as ``logits``.
        temperature: ``tau > 0``; logits are divided by it.
        compute_entropy: return ``None`` for entropy when False.
        chunk_tokens: rows per chunk when autograd is off (bounds peak memory).

    Returns:
        ``(logprobs [...], entropy [...] or None)``, float32, natural-log units (nats).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits leading shape {tuple(logits.shape[:-1])} must equal labels shape {tuple(labels.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    lead_shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    grad_needed = torch.is_grad_enabled() and flat_logits.requires_grad
    step = flat_logits.shape[0] if grad_needed else chunk_tokens
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, max(flat_logits.shape[0], 1), max(step, 1)):
        z = flat_logits[start : start + step].float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        picked = z.gather(-1, flat_labels[start : start + step].unsqueeze(-1)).squeeze(-1)
        logprob_chunks.append(picked - lse)
        if compute_entropy:
            probs = torch.softmax(z, dim=-1)
            entropy_chunks.append(lse - (probs * z).sum(-1))
    logprobs = torch.cat(logprob_chunks).reshape(lead_shape)
    entropy = torch.cat(entropy_chunks).reshape(lead_shape) if compute_entropy else None
    return logprobs, entropy


_LOGITS_TO_KEEP_SUPPORT: dict[type, bool] = {}


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` (HF causal LMs since 4.50)."""
    cls = type(model)
    if cls not in _LOGITS_TO_KEEP_SUPPORT:
        try:
            params = inspect.signature(model.forward).parameters
            _LOGITS_TO_KEEP_SUPPORT[cls] = "logits_to_keep" in params
        except (TypeError, ValueError):
            _LOGITS_TO_KEEP_SUPPORT[cls] = False
    return _LOGITS_TO_KEEP_SUPPORT[cls]


def response_logprobs(
    model: nn.Module,
    micro_batch: Mapping[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``model`` on one micro-batch and score its response tokens.

    Args:
        model: a causal LM returning ``.logits [B, T, V]`` (HF convention).
        micro_batch: ``input_ids [B, P+R]``, ``attention_mask [B, P+R]``,
            ``position_ids [B, P+R]``, ``responses [B, R]`` on the model's device.
        temperature: sampling temperature the responses were drawn with.
        compute_entropy: also return per-token entropy.

    Returns:
        ``(logprobs [B, R], entropy [B, R] or None)`` float32; autograd flows through
        them when grad mode is on.
    """
    input_ids = micro_batch["input_ids"]
    responses = micro_batch["responses"]
    response_len = responses.shape[1]
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": micro_batch["attention_mask"],
        "position_ids": micro_batch["position_ids"],
        "use_cache": False,
    }
    if _accepts_logits_to_keep(model):
        # keep only positions P-1 .. P+R-1 (the last R+1), the last one is dropped below
        kwargs["logits_to_keep"] = response_len + 1
    logits = model(**kwargs).logits
    logits = logits[:, -(response_len + 1) : -1, :]
    return logprobs_and_entropy_from_logits(
        logits,
        responses,
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_tokens=chunk_tokens,
    )
