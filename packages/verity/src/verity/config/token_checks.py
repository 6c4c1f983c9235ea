"""Checks of the token budgets before any worker starts: ``<role>.fsdp2.micro_batch_tokens``.

A micro-batch budget smaller than the longest row a run can produce (``data.max_prompt_length +
data.max_response_length`` tokens) cannot hold that row: the run is refused with one sentence
naming the key, its value and the longest row.
"""

from __future__ import annotations

from verity.config.derived import needs_critic
from verity.config.errors import ConfigError
from verity.config.schema import VerityConfig

__all__ = ["check_token_budgets"]


def check_token_budgets(cfg: VerityConfig) -> None:
    """Each FSDP2 role's ``micro_batch_tokens`` (0: off) holds the longest row (the reference runs the actor's)."""
    d = cfg.data
    longest = d.max_prompt_length + d.max_response_length
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if needs_critic(cfg) else [])
    for name, role in roles:
        budget = role.fsdp2.micro_batch_tokens if role.engine == "fsdp2" else 0
        if 0 < budget < longest:
            raise ConfigError(
                f"{name}.fsdp2.micro_batch_tokens={budget} is smaller than the longest row, "
                f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + "
                f"{d.max_response_length} = {longest} tokens; set it to at least {longest}, or 0 for rows only"
            )
