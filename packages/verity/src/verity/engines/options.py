"""Settings owned by the built-in training engines, one small dataclass each.

A role's config section holds the built-in engines' settings as fields named after
the engine (``actor.fsdp2.reshard_after_forward``); the engine the role runs
(``actor.engine``) reads its own and ignores the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FSDP2Options"]


@dataclass
class FSDP2Options:
    """FSDP2 (``torch.distributed.fsdp.fully_shard`` per decoder layer)."""

    # free each layer's gathered weights after forward: less memory, one more all-gather in backward
    reshard_after_forward: bool = True
    # bf16 compute with fp32 gradient reduction and master weights; null: on for CUDA, off on CPU
    mixed_precision: bool | None = None
