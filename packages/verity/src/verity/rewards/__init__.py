"""verity.rewards: verifiable rewards keyed by ``data_source``, run in a process pool that never stalls.

- :mod:`.extractors`, :mod:`.math_normalize` — answer extraction and math answer equality;
- :mod:`.builtin` — GSM8K, MATH, math-verify, DAPO and AIME reward functions;
- :mod:`.code`, :mod:`.sandbox` — code rewards, programs run in a confined child process;
- :mod:`.registry` — dispatch by ``data_source``, user reward functions (file path + name);
- :mod:`.process_pool`, :mod:`.manager` — :class:`RewardManager` with per-sample timeouts.

Held-out accuracy, avg@k, pass@k and maj@k are computed in :mod:`verity.evaluation.validation`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use, so that reward worker processes (which import the registry) do not pay
# for torch, which only the manager needs.
_EXPORTS = {
    "RewardManager": "verity.rewards.manager",
    "RewardManagerConfig": "verity.rewards.manager",
    "RewardFailureError": "verity.rewards.failures",
    "token_rewards_from_scores": "verity.rewards.manager",
    "DEFAULT_REWARD_TABLE": "verity.rewards.registry",
    "UnknownDataSourceError": "verity.rewards.registry",
    "call_reward": "verity.rewards.registry",
    "load_reward_function": "verity.rewards.registry",
    "resolve_spec": "verity.rewards.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'verity.rewards' has no attribute {name!r}")
