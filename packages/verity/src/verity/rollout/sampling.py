"""Sampling parameters and the one-step token sampler.

Log-probability convention (``rollout_logprobs``): the log-probability of the
chosen token under the **temperature-scaled** distribution *before* top-k /
top-p truncation::

    logprob_t = log_softmax(logits_t / temperature)[token_t]

This is what a trainer computes when it re-scores a response with
``log_softmax(logits / temperature)``, so the rollout's log-probs and the
trainer's agree when the weights agree (truncation changes which tokens can be
drawn, not the reported log-prob). Greedy decoding reports
``log_softmax(logits)[argmax]`` (temperature 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

_META_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "do_sample", "n", "ignore_eos")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses.

    ``temperature`` > 0 divides the logits; ``top_p`` in (0, 1] keeps the smallest
    set of most likely tokens whose probability reaches ``top_p``; ``top_k`` keeps
    the ``top_k`` most likely tokens (0 or -1: no limit); ``max_new_tokens`` is the
    response length R; ``do_sample=False`` (or ``temperature == 0``) decodes
    greedily; ``n`` samples per prompt (the rollout repeats each prompt ``n``
    times, consecutively); ``ignore_eos`` keeps generating past EOS until
    ``max_new_tokens``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    do_sample: bool = True
    n: int = 1
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 0 and self.top_k != -1):
            raise ValueError(f"top_k: expected -1, 0 or a positive int, got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n: expected an int >= 1, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax token (``do_sample=False`` or ``temperature == 0``)."""
        return not self.do_sample or self.temperature == 0

    def updated(self, overrides: dict[str, Any]) -> SamplingParams:
        """A copy with the fields named in ``overrides`` replaced; other keys are ignored.

        Used with a batch's ``meta`` so a caller can ask for e.g. greedy
        validation (``{"do_sample": False}``) without rebuilding the engine.
        """
        known = {f.name for f in fields(self)}
        chosen = {key: value for key, value in overrides.items() if key in known and key in _META_KEYS}
        return replace(self, **chosen) if chosen else self

    def to_dict(self) -> dict[str, Any]:
        """The parameters as a plain dict."""
        return asdict(self)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p set to -inf.

    logits: [B, V] (already temperature-scaled). Returns a new [B, V] tensor;
    at least one token per row always survives.
    """
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Probability mass strictly before each token; a token is dropped when
        # the tokens ahead of it already reach top_p (so the first always stays).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_index, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row.

    logits: [B, V] raw next-token logits. Returns ``(tokens [B] int64,
    logprobs [B] float32)`` with the log-prob convention of the module docstring.
    """
    logits = logits.float()
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logprobs
    scaled = logits / params.temperature
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    truncated = filter_top_k_top_p(scaled, params.top_k, params.top_p)
    tokens = draw_categorical(torch.softmax(truncated, dim=-1), generator)
    logprobs = logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def draw_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of ``probs`` ``[B, V]`` (rows sum to 1), drawn with those probabilities.

    Inverse-CDF sampling: one uniform ``u`` per row, the first index whose cumulative
    probability exceeds ``u`` times the row's total. It draws exactly from ``probs`` (up to
    the float64 cumulative sum) with one random number per row, where ``torch.multinomial``
    spends one per vocabulary entry on CPU and is slower
    (``ci/reports/2026-12-06-docstring-figures.md``). A token of probability 0 is never drawn.
    Returns ``[B]`` int64.
    """
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=torch.float64)
    return categorical_from_uniform(probs, u)


def categorical_from_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index of each row of ``probs`` ``[B, V]`` at which the cumulative probability first
    exceeds ``u [B, 1]`` (in [0, 1)) times the row's total: ``[B]`` int64, never a zero-probability index."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # u < 1, but u * total may round up to total: keep the target strictly below it
    target = torch.minimum(u.double() * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
