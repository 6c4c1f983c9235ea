"""Input checks shared by the algorithm functions.

Each check raises a ``TypeError`` or ``ValueError`` that names the offending
input and what was expected, before any compute happens.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def check_tensor(name: str, x: object, *, ndim: int | None = None, floating: bool | None = None) -> Tensor:
    """Check that ``x`` is a tensor with ``ndim`` dimensions and the requested dtype family."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if floating is True and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if floating is False and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    return x


def check_token_tensor(name: str, x: object, like: Tensor | None = None) -> Tensor:
    """Check a per-token ``[B, R]`` floating tensor, optionally of the same shape as ``like``."""
    check_tensor(name, x, ndim=2, floating=True)
    assert isinstance(x, torch.Tensor)
    if like is not None and x.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)} ([B, R]), got {tuple(x.shape)}")
    return x


def check_mask(name: str, mask: object, like: Tensor | None = None) -> Tensor:
    """Check a ``[B, R]`` 0/1 mask (bool, int or float) and return it as ``like``'s float dtype."""
    check_tensor(name, mask, ndim=2)
    assert isinstance(mask, torch.Tensor)
    if like is not None and mask.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)} ([B, R]), got {tuple(mask.shape)}")
    dtype = like.dtype if like is not None and like.is_floating_point() else torch.float32
    return mask.to(dtype)


def check_per_sequence(name: str, x: object, batch_size: int, *, floating: bool) -> Tensor:
    """Check a per-sequence ``[B]`` tensor."""
    check_tensor(name, x, ndim=1, floating=floating)
    assert isinstance(x, torch.Tensor)
    if x.shape[0] != batch_size:
        raise ValueError(f"{name} must have shape [{batch_size}] ([B]), got {tuple(x.shape)}")
    return x


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Check that a config number is positive (or non-negative)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
