"""Megatron-core training engine (tensor, pipeline and data parallelism); see :mod:`.engine`.

Importing this package does not import megatron-core; :class:`MegatronEngine` does,
and needs the ``megatron`` extra (``pip install 'verity[megatron]'``).
"""

from __future__ import annotations

from typing import Any

from verity.engines.megatron.imports import megatron_available
from verity.engines.megatron.options import MegatronOptions

__all__ = ["MegatronEngine", "MegatronOptions", "megatron_available"]


def __getattr__(name: str) -> Any:
    if name == "MegatronEngine":
        if not megatron_available():
            from verity.engines.base import EngineUnavailableError

            raise EngineUnavailableError(
                "the megatron engine needs megatron-core: pip install 'verity[megatron]' "
                "(megatron-core==0.16.1, see docs/engines.md)"
            )
        from verity.engines.megatron.engine import MegatronEngine

        return MegatronEngine
    raise AttributeError(name)
