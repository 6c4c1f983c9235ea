r"""Per-token KL estimators between the policy and the reference policy, and the KL loss term.

Tokens are sampled from the policy :math:`\pi`; with
:math:`d_t = \log\pi(y_t) - \log\pi_{\text{ref}}(y_t)` and
:math:`\rho_t = \pi_{\text{ref}}(y_t)/\pi(y_t) = e^{-d_t}`, each estimator's
expectation under :math:`\pi` relates to :math:`\mathrm{KL}(\pi\,\|\,\pi_{\text{ref}})`
(Schulman, "Approximating KL Divergence", 2020):

=======  ==========================  ======================================================
kind     value                       notes
=======  ==========================  ======================================================
k1       :math:`d`                   unbiased, high variance, can be negative
k2       :math:`\tfrac12 d^2`        biased (low bias when close), always >= 0
k3       :math:`\rho - 1 - \log\rho` unbiased, low variance, always >= 0 ("low_var_kl")
abs      :math:`|d|`                 biased, always >= 0
=======  ==========================  ======================================================

Aliases: ``kl`` = k1, ``mse`` = k2, ``low_var_kl`` = k3.

Gradients. As a LOSS on on-policy samples, the gradient that estimates
:math:`\nabla_\theta\mathrm{KL}(\pi_\theta\|\pi_{\text{ref}}) = \mathbb{E}_\pi[d\,\nabla\log\pi]`
is the gradient of k2: :math:`\nabla\tfrac12 d^2 = d\,\nabla\log\pi`. The k1 loss
gives :math:`\nabla\log\pi` (zero in expectation) and the k3 loss gives
:math:`(1-\rho)\nabla\log\pi`, whose expectation is the gradient of the reverse
KL, :math:`\mathrm{KL}(\pi_{\text{ref}}\|\pi)`. The straight-through kinds ``k1+``,
``k3+`` (``low_var_kl+``) and ``abs+`` keep the base kind's VALUE (for logging and
for the reward) and take the gradient of k2:

.. math::  \mathrm{X{+}}_t = k2_t - \operatorname{sg}[k2_t] + \operatorname{sg}[X_t]
           \quad\Rightarrow\quad \mathrm{X{+}}_t = X_t,\;\; \nabla\mathrm{X{+}}_t = d_t\,\nabla\log\pi(y_t).

Clamps (verl's convention): for k3 the exponent is clamped to :math:`-d \in [-20, 20]`
before ``exp`` (overflow guard) and the result to :math:`[-\text{clamp}, \text{clamp}]`
(``clamp`` = 10 by default, ``None`` disables). Other kinds are not clamped.
A clamped k3 token passes no gradient; its ``k3+`` form still does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verity.algorithms.aggregation import AggregationContext, aggregate_loss
from verity.algorithms.masked_ops import masked_mean
from verity.algorithms.registry import AGGREGATION_MODES, KL_ESTIMATORS
from verity.algorithms.tensor_checks import check_mask, check_token_tensor

Tensor = torch.Tensor
KLEstimator = Callable[[Tensor, Tensor, "float | None"], Tensor]

K3_EXPONENT_CLAMP = 20.0


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = None) -> Tensor:
    r""":math:`d = \log\pi - \log\pi_{\text{ref}}`, ``[B, R]``."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = None) -> Tensor:
    r""":math:`\tfrac12 d^2`, ``[B, R]``."""
    d = logprobs - ref_logprobs
    return 0.5 * d * d


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = 10.0) -> Tensor:
    r""":math:`\rho - 1 - \log\rho` with :math:`\log\rho = \log\pi_{\text{ref}} - \log\pi`, ``[B, R]``."""
    log_rho = (ref_logprobs - logprobs).clamp(-K3_EXPONENT_CLAMP, K3_EXPONENT_CLAMP)
    value = torch.exp(log_rho) - log_rho - 1.0
    return value if clamp is None else value.clamp(-clamp, clamp)


@KL_ESTIMATORS.register("abs")
def kl_abs(logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = None) -> Tensor:
    r""":math:`|d|`, ``[B, R]``."""
    return (logprobs - ref_logprobs).abs()


def straight_through(value: Tensor, gradient_source: Tensor) -> Tensor:
    """A tensor equal to ``value`` whose gradient is that of ``gradient_source``."""
    return gradient_source - gradient_source.detach() + value.detach()


def _with_k2_gradient(base: KLEstimator) -> KLEstimator:
    def estimator(logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = 10.0) -> Tensor:
        return straight_through(base(logprobs, ref_logprobs, clamp), kl_k2(logprobs, ref_logprobs))

    estimator.__doc__ = f"Value of {base.__name__}, gradient of k2 (straight-through), ``[B, R]``."
    return estimator


KL_ESTIMATORS.add("k1+", _with_k2_gradient(kl_k1), "kl+")
KL_ESTIMATORS.add("k3+", _with_k2_gradient(kl_k3), "low_var_kl+")
KL_ESTIMATORS.add("abs+", _with_k2_gradient(kl_abs))


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str, *, clamp: float | None = 10.0) -> Tensor:
    """Per-token KL estimate ``[B, R]`` of kind ``kind`` (see the module docstring).

    Args:
        logprobs: ``[B, R]`` log-probs of the sampled tokens under the policy (may carry grad).
        ref_logprobs: ``[B, R]`` log-probs under the reference policy (treated as constant).
        kind: ``k1``, ``k2``, ``k3``, ``abs``, ``k1+``, ``k3+``, ``abs+`` or an alias.
        clamp: bound on |k3| (``None``: none); ignored by the other kinds.

    Returns:
        ``[B, R]`` in nats, unmasked (callers mask).
    """
    estimator = KL_ESTIMATORS.get(kind)
    check_token_tensor("logprobs", logprobs)
    check_token_tensor("ref_logprobs", ref_logprobs, like=logprobs)
    if clamp is not None and clamp <= 0:
        raise ValueError(f"clamp must be > 0 or None, got {clamp}")
    return estimator(logprobs, ref_logprobs.detach(), clamp)


def kl_loss(
    *,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    agg: AggregationContext,
    kind: str = "k3",
    loss_agg_mode: str = "token-mean",
    clamp: float | None = 10.0,
) -> tuple[Tensor, dict[str, float]]:
    """KL-to-reference loss term: ``aggregate(kl_penalty(logprobs, ref_logprobs, kind))``.

    The trainer adds ``kl_loss_coef`` times this to the policy loss. Use a
    straight-through kind (``k3+``) for an unbiased gradient of
    KL(pi || pi_ref); ``k3`` follows the GRPO paper.

    Returns:
        ``(loss, {"kl_loss": value})``: 0-dim loss in nats (per token or per
        sequence according to ``loss_agg_mode``) and the masked per-token mean.
    """
    AGGREGATION_MODES.get(loss_agg_mode)
    per_token = kl_penalty(logprobs, ref_logprobs, kind, clamp=clamp)
    mask = check_mask("response_mask", response_mask, like=logprobs)
    loss = aggregate_loss(per_token, mask, loss_agg_mode, agg)
    with torch.no_grad():
        metrics = {"kl_loss": float(masked_mean(per_token.detach(), mask).item())}
    return loss, metrics
