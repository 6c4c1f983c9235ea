r"""KL in the reward, and the controllers of its coefficient.

In-reward penalty (per token, before advantages are computed):

.. math::  r'_t = r_t - \beta\,\mathrm{KL}_t\,m_t

Controllers of :math:`\beta`:

* fixed: :math:`\beta` never changes;
* adaptive (Ziegler et al. 2019, proportional controller): after a step whose
  observed KL is :math:`\mathrm{KL}_{\text{obs}}` over :math:`n` samples,

  .. math::  e = \operatorname{clip}\Big(\frac{\mathrm{KL}_{\text{obs}}}{\mathrm{KL}_{\text{target}}} - 1,
             -0.2, 0.2\Big),\qquad \beta \leftarrow \beta\,\Big(1 + e\,\frac{n}{H}\Big)

  with horizon :math:`H`.
"""

from __future__ import annotations

import torch

from verity.algorithms.configs import KLConfig
from verity.algorithms.kl import kl_penalty
from verity.algorithms.masked_ops import masked_mean
from verity.algorithms.tensor_checks import check_mask, check_positive, check_token_tensor

Tensor = torch.Tensor


def apply_kl_penalty(
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    kind: str = "k1",
    *,
    clamp: float | None = 10.0,
) -> tuple[Tensor, dict[str, float]]:
    """Subtract ``kl_coef * KL`` from the token rewards on masked-in tokens.

    Args:
        token_rewards: ``[B, R]`` rewards.
        logprobs: ``[B, R]`` behaviour-policy log-probs of the sampled tokens.
        ref_logprobs: ``[B, R]`` reference-policy log-probs.
        mask: ``[B, R]`` response mask.
        kl_coef: :math:`beta` >= 0 (e.g. ``controller.value``).
        kind: KL estimator (``k1`` is the classic choice for the reward).
        clamp: k3 clamp (see ``verity.algorithms.kl``).

    Returns:
        ``(rewards [B, R], metrics)`` with ``metrics["kl"]`` = mean over non-empty
        sequences of each sequence's masked mean KL (the quantity the adaptive
        controller tracks) and ``metrics["kl_coef"]``. No autograd history.
    """
    check_token_tensor("token_rewards", token_rewards)
    check_token_tensor("logprobs", logprobs, like=token_rewards)
    check_token_tensor("ref_logprobs", ref_logprobs, like=token_rewards)
    m = check_mask("mask", mask, like=token_rewards)
    check_positive("kl_coef", kl_coef, allow_zero=True)
    with torch.no_grad():
        kl = kl_penalty(logprobs.detach(), ref_logprobs.detach(), kind, clamp=clamp)
        kl = torch.where(m > 0, kl * m, torch.zeros_like(kl))
        rewards = token_rewards.detach() - kl_coef * kl
        nonempty = m.sum(dim=-1) > 0
        per_seq = masked_mean(kl, m, dim=-1)
        mean_kl = float(per_seq[nonempty].mean().item()) if bool(nonempty.any()) else 0.0
    return rewards, {"kl": mean_kl, "kl_coef": float(kl_coef)}


class FixedKLController:
    """A KL coefficient that never changes."""

    def __init__(self, kl_coef: float) -> None:
        check_positive("kl_coef", kl_coef, allow_zero=True)
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (same interface as :class:`AdaptiveKLController`)."""


class AdaptiveKLController:
    """Ziegler et al. (2019) proportional controller of the KL coefficient (formula in the module docstring).

    Args:
        init_kl_coef: starting :math:`\\beta`.
        target_kl: KL the controller steers to (same unit as ``metrics["kl"]``).
        horizon: :math:`H`, in samples.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        check_positive("init_kl_coef", init_kl_coef, allow_zero=True)
        check_positive("target_kl", target_kl)
        check_positive("horizon", horizon)
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Update ``value`` after a step that observed ``current_kl`` over ``n_steps`` samples."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(config: KLConfig) -> FixedKLController | AdaptiveKLController:
    """The controller chosen by ``config.kl_ctrl``, starting at ``config.kl_coef``."""
    config.validate()
    if config.kl_ctrl == "adaptive":
        return AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
    return FixedKLController(config.kl_coef)
