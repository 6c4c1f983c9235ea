"""The ``dapo:`` config section: one switch per DAPO component that the runtime does not already have.

Clip-higher (``actor.policy_loss.clip_ratio_low`` / ``clip_ratio_high``), the token-level
loss (``actor.policy_loss.loss_agg_mode=token-mean``) and "no KL" (``algorithm.kl``) are
runtime keys; the recipe's configs pin them. This section adds::

    dapo:
      dynamic_sampling:   {enabled, metric, max_num_gen_batches}
      overlong_shaping:   {enabled, buffer_len, penalty_factor}
      overlong_filter:    {enabled}

Every switch is off by default, so a run that has this package installed but does not
ask for DAPO is unchanged. The checks that need the rest of the config (the response
budget, the group size) run in :meth:`DapoConfig.validate` with the whole config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

METRICS = ("acc", "score")


@dataclass
class DynamicSamplingConfig:
    # drop prompt groups whose samples all agree on `metric` (no learning signal), draw more prompts
    # and generate again until data.train_batch_size groups are kept
    enabled: bool = False
    metric: str = "acc"  # acc: the verifier's correctness (the paper) | score: the reward incl. shaping
    max_num_gen_batches: int = 10  # generation rounds per step at most (the first included); 0: no cap


@dataclass
class OverlongShapingConfig:
    # soft overlong punishment: a linear penalty over the last buffer_len tokens of the response budget
    enabled: bool = False
    buffer_len: int = (
        4  # tokens (L_cache in the paper); the penalty starts at max_response_length - buffer_len
    )
    penalty_factor: float = 1.0  # the penalty at the end of the budget (a truncated response gets -factor)


@dataclass
class OverlongFilterConfig:
    # truncated samples (no EOS within data.max_response_length) are masked out of the policy loss
    enabled: bool = False


@dataclass
class DapoConfig:
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong_shaping: OverlongShapingConfig = field(default_factory=OverlongShapingConfig)
    overlong_filter: OverlongFilterConfig = field(default_factory=OverlongFilterConfig)

    def any_enabled(self) -> bool:
        """Whether any component of this section is switched on."""
        return self.dynamic_sampling.enabled or self.overlong_shaping.enabled or self.overlong_filter.enabled

    def validate(self) -> None:
        """Ranges of this section alone."""
        ds, shaping = self.dynamic_sampling, self.overlong_shaping
        if ds.metric not in METRICS:
            raise ValueError(f"dynamic_sampling.metric must be one of {'|'.join(METRICS)}, got {ds.metric!r}")
        if ds.max_num_gen_batches < 0:
            raise ValueError(
                f"dynamic_sampling.max_num_gen_batches must be >= 0 (0: no cap), got {ds.max_num_gen_batches}"
            )
        if shaping.buffer_len < 1:
            raise ValueError(f"overlong_shaping.buffer_len must be >= 1 token, got {shaping.buffer_len}")
        if shaping.penalty_factor < 0:
            raise ValueError(f"overlong_shaping.penalty_factor must be >= 0, got {shaping.penalty_factor}")

    def validate_run(self, cfg: Any) -> None:
        """This section against the whole run config ``cfg``: the response budget and ``rollout.n``."""
        ds, shaping = self.dynamic_sampling, self.overlong_shaping
        budget = cfg.data.max_response_length
        if shaping.enabled and shaping.buffer_len >= budget:
            raise ValueError(
                f"overlong_shaping.buffer_len = {shaping.buffer_len} must be below data.max_response_length = "
                f"{budget} (the penalty starts at max_response_length - buffer_len tokens)"
            )
        if ds.enabled and cfg.rollout.n < 2:
            raise ValueError(
                f"dynamic_sampling needs rollout.n >= 2 samples per prompt (got {cfg.rollout.n}): "
                "a group of one sample never has a signal"
            )
