"""Small dataclass configs for the algorithm library.

Plain types only (str, float, int, bool, Optional of those), so a Hydra
structured config can embed them unchanged. Each has ``validate()``, which the
functions that consume it call before computing; a config package can call it
too when it checks a composed config.
"""

from __future__ import annotations

from dataclasses import dataclass

from verity.algorithms.tensor_checks import check_positive


@dataclass
class AdvantageConfig:
    """How advantages (and returns) are computed from rewards.

    Attributes:
        estimator: registered estimator name (see ``docs/algorithms.md``).
        gamma: discount factor (GAE, REINFORCE++).
        lam: GAE lambda.
        norm_by_std: divide by the group standard deviation (GRPO, GRPO pass@k).
        eps: added to the group standard deviation before dividing.
        whiten_eps: added to the batch variance when whitening (REINFORCE++, GAE).
        gae_whiten: whiten GAE advantages over the batch's response tokens.
        gpg_norm_by_std: GPG's F_norm = group std (True) or 1 (False, the paper's default).
        gpg_alpha_correction: GPG's alpha = B / (B - M) correction.
    """

    estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    eps: float = 1e-6
    whiten_eps: float = 1e-8
    gae_whiten: bool = True
    gpg_norm_by_std: bool = False
    gpg_alpha_correction: bool = True

    def validate(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"AdvantageConfig.gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"AdvantageConfig.lam must be in [0, 1], got {self.lam}")
        check_positive("AdvantageConfig.eps", self.eps, allow_zero=True)
        check_positive("AdvantageConfig.whiten_eps", self.whiten_eps, allow_zero=True)


@dataclass
class PolicyLossConfig:
    """Policy-loss settings.

    Attributes:
        name: registered policy-loss name.
        loss_agg_mode: aggregation mode (see ``verity.algorithms.aggregation``).
        clip_ratio_low / clip_ratio_high: PPO ratio clipped to [1 - low, 1 + high]
            (clip-higher: high > low).
        clip_ratio_c: dual-clip constant (> 1) bounding the loss of negative-advantage
            tokens by ``-A * c``; ``None`` disables dual-clip (plain PPO).
        log_ratio_clamp: log importance ratios are clamped to [-x, x] before ``exp``.
        gspo_clip_ratio_low / gspo_clip_ratio_high: GSPO's sequence-ratio clip range.
        cispo_clip_ratio_low: IS weight lower bound 1 - low; ``None`` = no lower bound.
        cispo_clip_ratio_high: IS weight upper bound 1 + high.
        clip_cov_ratio / clip_cov_lb / clip_cov_ub: Clip-Cov fraction of tokens and
            covariance window.
        kl_cov_ratio / kl_cov_coef: KL-Cov fraction of tokens and penalty coefficient.
    """

    name: str = "ppo"
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = None
    log_ratio_clamp: float = 20.0
    gspo_clip_ratio_low: float = 3e-4
    gspo_clip_ratio_high: float = 4e-4
    cispo_clip_ratio_low: float | None = None
    cispo_clip_ratio_high: float = 0.28
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0

    def validate(self) -> None:
        for name in ("clip_ratio_low", "clip_ratio_high", "gspo_clip_ratio_low", "gspo_clip_ratio_high"):
            check_positive(f"PolicyLossConfig.{name}", getattr(self, name), allow_zero=True)
        for name in ("clip_ratio_low", "gspo_clip_ratio_low"):
            if getattr(self, name) >= 1.0:
                raise ValueError(f"PolicyLossConfig.{name} must be < 1, got {getattr(self, name)}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"PolicyLossConfig.clip_ratio_c must be > 1 (or None), got {self.clip_ratio_c}")
        check_positive("PolicyLossConfig.log_ratio_clamp", self.log_ratio_clamp)
        if self.cispo_clip_ratio_low is not None:
            check_positive(
                "PolicyLossConfig.cispo_clip_ratio_low", self.cispo_clip_ratio_low, allow_zero=True
            )
        check_positive("PolicyLossConfig.cispo_clip_ratio_high", self.cispo_clip_ratio_high, allow_zero=True)
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"PolicyLossConfig.{name} must be in [0, 1], got {value}")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"PolicyLossConfig.clip_cov_lb ({self.clip_cov_lb}) must be < clip_cov_ub ({self.clip_cov_ub})"
            )
        check_positive("PolicyLossConfig.kl_cov_coef", self.kl_cov_coef, allow_zero=True)


@dataclass
class ValueLossConfig:
    """Critic loss settings.

    Attributes:
        cliprange_value: value predictions are kept within +-cliprange_value of the
            old values in the clipped branch; ``None`` disables value clipping.
        loss_agg_mode: aggregation mode.
    """

    cliprange_value: float | None = 0.5
    loss_agg_mode: str = "token-mean"

    def validate(self) -> None:
        if self.cliprange_value is not None:
            check_positive("ValueLossConfig.cliprange_value", self.cliprange_value)


@dataclass
class KLConfig:
    """KL regularisation against the reference policy.

    Attributes:
        use_kl_in_reward: subtract ``kl_coef * KL`` from the token rewards.
        kl_in_reward_kind: KL estimator for the reward penalty.
        kl_ctrl: ``"fixed"`` or ``"adaptive"`` (Ziegler et al. proportional controller).
        kl_coef: (initial) coefficient of the reward penalty.
        kl_target: adaptive controller's target KL (nats per sequence-mean token).
        kl_horizon: adaptive controller's horizon (samples).
        use_kl_loss: add ``kl_loss_coef * KL`` to the actor loss.
        kl_loss_kind: KL estimator for the loss term (``"k3+"`` gives an unbiased gradient).
        kl_loss_coef: coefficient of the KL loss term.
        kl_clamp: |k3| values are clamped to this (``None``: no clamp).
    """

    use_kl_in_reward: bool = False
    kl_in_reward_kind: str = "k1"
    kl_ctrl: str = "fixed"
    kl_coef: float = 0.001
    kl_target: float = 0.1
    kl_horizon: float = 10000.0
    use_kl_loss: bool = False
    kl_loss_kind: str = "k3"
    kl_loss_coef: float = 0.001
    kl_clamp: float | None = 10.0

    def validate(self) -> None:
        if self.kl_ctrl not in ("fixed", "adaptive"):
            raise ValueError(f"KLConfig.kl_ctrl must be 'fixed' or 'adaptive', got {self.kl_ctrl!r}")
        check_positive("KLConfig.kl_coef", self.kl_coef, allow_zero=True)
        check_positive("KLConfig.kl_loss_coef", self.kl_loss_coef, allow_zero=True)
        if self.kl_ctrl == "adaptive":
            check_positive("KLConfig.kl_target", self.kl_target)
            check_positive("KLConfig.kl_horizon", self.kl_horizon)
        if self.kl_clamp is not None:
            check_positive("KLConfig.kl_clamp", self.kl_clamp)


@dataclass
class EntropyConfig:
    """Entropy bonus settings.

    Attributes:
        coef: coefficient of the bonus; the loss term is ``-coef * aggregate(entropy)``.
        chunk_size: rows of logits processed at once by ``entropy_from_logits``
            (``None``: all at once).
    """

    coef: float = 0.0
    chunk_size: int | None = None

    def validate(self) -> None:
        check_positive("EntropyConfig.coef", self.coef, allow_zero=True)
        if self.chunk_size is not None:
            check_positive("EntropyConfig.chunk_size", self.chunk_size)
