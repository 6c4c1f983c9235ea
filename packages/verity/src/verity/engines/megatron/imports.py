"""Importing megatron-core: availability check and its start-up warnings.

megatron-core warns at import, once per module, that Transformer Engine and Apex are
missing and that it falls back to plain PyTorch implementations. That fallback is what
this engine uses on purpose (local layer spec, ``torch.nn.RMSNorm``, ``torch.optim.AdamW``),
so the warnings are filtered while verity imports it; any other warning passes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Iterator

_FALLBACK_WARNINGS = (
    r"Transformer Engine and Apex are not installed.*",
    r"Apex is not installed.*",
    r"full scope is deprecated.*",  # TransformerConfig's default cuda_graph_scope; CUDA graphs are not used
)


def megatron_available() -> bool:
    """Whether ``megatron.core`` can be imported here."""
    return (
        importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None
    )


@contextlib.contextmanager
def quiet_megatron_import() -> Iterator[None]:
    """Filter megatron-core's "not installed, falling back" warnings inside the block."""
    with warnings.catch_warnings():
        for pattern in _FALLBACK_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
        yield
