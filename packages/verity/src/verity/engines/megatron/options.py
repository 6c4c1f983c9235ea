"""Settings of the Megatron-core engine: :class:`verity.engines.options.MegatronOptions` (``actor.megatron``)."""

from __future__ import annotations

from verity.engines.options import MegatronOptions

__all__ = ["MegatronOptions"]
