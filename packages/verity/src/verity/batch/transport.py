"""How a Batch's tensors travel through pickle, cloudpickle and Ray.

CPU tensors are sent as numpy arrays: pickle protocol 5 (which Ray uses) carries them
as out-of-band buffers, so they are not re-encoded by ``torch.save`` and Ray's object
store holds them without extra copies. Dtypes numpy lacks (bfloat16, float8, ...) are
sent as a same-size integer view and viewed back. On arrival a read-only buffer (Ray's
shared memory) is copied once, so receivers can modify tensors in place. GPU tensors,
tensors that require grad, and sparse tensors use torch's own pickling.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["pack_tensor", "unpack_tensor"]

# Same-size integer dtypes used to send tensors whose dtype numpy lacks.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_tensor(value: torch.Tensor) -> Any:
    """CPU tensors travel as ``(numpy array, dtype name)``; others as themselves."""
    if value.device.type != "cpu" or value.requires_grad or value.is_sparse:
        return value
    value = value.contiguous()
    dtype = value.dtype
    try:
        return ("np", value.numpy(), None)
    except TypeError:
        carrier = _INT_OF_SIZE[value.element_size()]
        return ("np", value.view(carrier).numpy(), str(dtype).removeprefix("torch."))


def unpack_tensor(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    _, array, dtype_name = packed
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    if dtype_name is not None:
        tensor = tensor.view(getattr(torch, dtype_name))
    return tensor
