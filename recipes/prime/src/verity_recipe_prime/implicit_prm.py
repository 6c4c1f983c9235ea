r"""The implicit process reward model's math: rewards, its loss, and how well it separates.

The PRM :math:`\pi_\phi` is a causal LM initialised from the same checkpoint as the
frozen reference :math:`\pi_{\text{ref}}` (Yuan et al. 2024, *Free Process Rewards
without Process Labels*; used online by PRIME, Cui et al. 2025, arXiv:2502.01456).
For a response :math:`y` to a prompt :math:`x`, both at temperature 1:

.. math::

    r_t &= \beta\,\big(\log\pi_\phi(y_t \mid x, y_{<t}) - \log\pi_{\text{ref}}(y_t \mid x, y_{<t})\big)
        && \text{process reward of token } t\\
    q &= \sum_t m_t\, r_t && \text{the implicit outcome score (a logit)}\\
    \ell &= -\big[c \log\sigma(q) + (1-c)\log(1-\sigma(q))\big]
        && \text{cross-entropy against the verifier's label } c \in [0, 1]

Training :math:`\ell` on outcome labels makes :math:`q` an outcome reward model whose
per-token terms :math:`r_t` are process rewards (the paper's Proposition: :math:`q`
then parameterises a Q-function whose increments are :math:`r_t`).

**Aggregation.** The loss of a mini-batch is the mean over its sequences that have a
response token, with the count :math:`S` taken over the WHOLE mini-batch across every
data-parallel rank (``agg.global_seqs``, see :mod:`verity.engines.base`): each
micro-batch contributes :math:`\frac1S\sum_{i \in \text{micro}} \ell_i`, so the
summed gradient

.. math::  \nabla_\phi L = \frac1S \sum_i \big(\sigma(q_i) - c_i\big)\,\beta \sum_t m_{i,t}\,\nabla_\phi \log\pi_\phi(y_{i,t})

does not depend on the micro-batch size or the number of workers. A fully masked row
(no response token) has :math:`q = 0` and no gradient; it is not counted in :math:`S`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

#: ``loss_fn(micro_batch, logprobs [b, R], entropy, agg) -> (loss, metrics)``, what the engine calls
PRMLossFn = Callable[[Any, Tensor, Tensor, Any], tuple[Tensor, Mapping[str, float]]]


def process_rewards(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor, beta: float) -> Tensor:
    r""":math:`r_t = \beta(\log\pi_\phi - \log\pi_{\text{ref}})` on model tokens, 0 elsewhere; all ``[B, R]``."""
    keep = response_mask > 0
    diff = logprobs - ref_logprobs.to(logprobs.dtype)
    return torch.where(keep, beta * diff, torch.zeros_like(diff))


def sequence_scores(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor, beta: float) -> Tensor:
    r""":math:`q_i = \beta\sum_t m_{i,t}(\log\pi_\phi - \log\pi_{\text{ref}})`, ``[B]`` (a logit)."""
    return process_rewards(logprobs, ref_logprobs, response_mask, beta).sum(-1)


def cross_entropy_sum(scores: Tensor, labels: Tensor, response_mask: Tensor) -> Tensor:
    r""":math:`\sum_i \ell_i` over the rows with a response token (``scores``/``labels`` ``[b]``, mask ``[b, R]``).

    :math:`\ell_i` is the binary cross-entropy of the logit :math:`q_i` against
    :math:`c_i \in [0, 1]`, computed stably as ``softplus(q) - c q``.
    """
    nonempty = (response_mask > 0).any(-1)
    losses = F.binary_cross_entropy_with_logits(scores, labels.to(scores.dtype), reduction="none")
    return torch.where(nonempty, losses, torch.zeros_like(losses)).sum()


def make_prm_loss(beta: float) -> PRMLossFn:
    """The PRM's loss callable for :meth:`verity.engines.FSDP2Engine.train_step` (temperature 1).

    The micro-batch must hold ``prm_ref_logprobs [b, R]``, ``acc [b]`` (labels in [0, 1])
    and ``response_mask [b, R]``. Its loss is this micro-batch's share of the mini-batch
    mean :math:`\\frac1S\\sum_i \\ell_i` (``agg.global_seqs`` = :math:`S`, see the module
    docstring). Metrics: ``prm/score_mean`` (mean :math:`q` of the micro-batch's rows).
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")

    def loss_fn(
        micro: Any, logprobs: Tensor, entropy: Tensor, agg: Any
    ) -> tuple[Tensor, Mapping[str, float]]:
        mask = micro["response_mask"].to(logprobs.dtype)
        scores = sequence_scores(logprobs, micro["prm_ref_logprobs"], mask, beta)
        labels = micro["acc"].to(logprobs.device)
        loss = cross_entropy_sum(scores, labels, mask) / max(float(agg.global_seqs), 1.0)
        return loss, {"prm/score_mean": float(scores.detach().mean())}

    return loss_fn


def auc(scores: Tensor, labels: Tensor) -> float | None:
    """Area under the ROC curve of ``scores [B]`` for ``labels [B]`` (1 right, 0 wrong; > 0.5 counts as right).

    The probability that a right response outscores a wrong one, ties counted half
    (Mann-Whitney). ``None`` when one of the two classes is absent.
    """
    positive = labels.float() > 0.5
    pos, neg = scores[positive].double(), scores[~positive].double()
    if pos.numel() == 0 or neg.numel() == 0:
        return None
    greater = (pos.unsqueeze(1) > neg.unsqueeze(0)).double().sum()
    ties = (pos.unsqueeze(1) == neg.unsqueeze(0)).double().sum()
    return float((greater + 0.5 * ties) / (pos.numel() * neg.numel()))


def classification_accuracy(scores: Tensor, labels: Tensor) -> float:
    r"""Share of responses the PRM classifies right at :math:`\sigma(q) = 0.5` (``q > 0``: right);
    :math:`q = 0` exactly counts half. ``scores``/``labels`` ``[B]``, ``B >= 1``."""
    if scores.numel() == 0:
        raise ValueError("classification_accuracy: no responses")
    positive = labels.float() > 0.5
    correct = ((scores > 0) == positive).double()
    correct = torch.where(scores == 0, torch.full_like(correct, 0.5), correct)
    return float(correct.mean())
