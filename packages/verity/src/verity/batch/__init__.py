"""verity.batch: the one batch type and the declared schema of its keys.

``Batch`` holds ``[B, ...]`` tensors in a ``tensordict.TensorDict``, per-sample Python
lists of length ``B`` and batch-wide ``meta``. ``schema`` declares every key that
crosses a role boundary with its symbolic shape; ``validate`` checks a batch against it.
"""

from __future__ import annotations

from verity.batch.core import Batch, BatchError
from verity.batch.schema import (
    BatchSchemaError,
    KeySpec,
    declared_keys,
    describe,
    get_key,
    register_key,
    validate,
)
from verity.batch.transport import keep_resident, materialize

__all__ = [
    "Batch",
    "BatchError",
    "BatchSchemaError",
    "KeySpec",
    "declared_keys",
    "describe",
    "get_key",
    "keep_resident",
    "materialize",
    "register_key",
    "validate",
]
