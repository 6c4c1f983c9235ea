"""The compiled loss head's CUDA kernels, written in Triton: one read of the logits forward, one read and one write backward.

Both kernels work in base-2 units, ``z = x * log2(e) / tau`` for logits ``x [N, V]`` at
temperature ``tau``, so that each exponential is one ``exp2`` (the GPU's native ``ex2``)
with no extra multiply. Natural-unit results are ``ln 2`` times the base-2 ones.

Forward, one program per row: a single pass over the vocabulary in blocks of ``BLOCK``
columns. Each block's maximum updates the row's running maximum ``m`` (``m -> m'``), and
the running sums ``s = sum 2^(z - m)`` and ``t = sum 2^(z - m) (z - m)`` are rescaled once
per block, as scalars (``s -> s 2^(m - m')``, ``t -> 2^(m - m') (t + (m - m') s)``), so
each logit costs one ``exp2``, a subtraction and two sums. Then::

    lse = ln2 (m + log2 s)       log p_y = ln2 (z_y - m - log2 s)       H = ln2 (log2 s - t / s)

(``H = lse - E_p[x / tau]``, and ``E_p[z - m] = t / s``). Lanes past the vocabulary read
``-inf``; the shifted value is clamped at ``-1e30`` so that they, and any logit at ``-inf``,
add ``0 * finite`` to ``t`` rather than ``0 * inf``.

Backward, one program per row and block of columns:
``(1[v = y] - 2^(z_v - lse / ln2)) g / tau`` written in the logits' dtype.

Inductor's kernel for the same math (:func:`verity.engines.compiled_head.head_forward`)
loops over each row once per reduction (maximum, normaliser, entropy, as its CPU code
shows); these read it once. Used on CUDA for 16- and 32-bit logits;
:mod:`verity.engines.compiled_head` chooses. Under ``TRITON_INTERPRET=1`` they run on CPU
tensors (how the CPU test suite checks their arithmetic).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = [
    "BACKWARD_BLOCK",
    "BACKWARD_WARPS",
    "FORWARD_BLOCK",
    "FORWARD_WARPS",
    "triton_head_backward",
    "triton_head_forward",
]

# 4096 columns and 4 warps (32 logits a thread): compiled for sm_90, the forward's loop spends
# the fewest instructions per logit there; with 8 warps the block's three reductions weigh more
# (ci/reports/2026-12-06-docstring-figures.md)
FORWARD_BLOCK = 4096
FORWARD_WARPS = 4
BACKWARD_BLOCK = 4096
BACKWARD_WARPS = 8
_LN2 = tl.constexpr(math.log(2.0))


@triton.jit
def _forward_kernel(
    logits_ptr,
    labels_ptr,
    logprobs_ptr,
    entropy_ptr,
    lse_ptr,
    row_stride,
    vocab,
    scale,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    lanes = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)  # float32 scalars, loop-carried
    s = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    t = s
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        z = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * scale
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # any finite value while all read is -inf
        d = tl.maximum(z - m_ref, -1.0e30)
        e = tl.exp2(d)
        shift = tl.maximum(m - m_ref, -1.0e30)
        alpha = tl.exp2(shift)
        t = alpha * (t + shift * s) + tl.sum(e * d, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    log2_s = tl.log2(s)
    label = tl.load(labels_ptr + row)
    chosen = tl.load(base + label).to(tl.float32) * scale
    tl.store(logprobs_ptr + row, (chosen - m - log2_s) * _LN2)
    tl.store(entropy_ptr + row, (log2_s - t / s) * _LN2)
    tl.store(lse_ptr + row, (m + log2_s) * _LN2)


@triton.jit
def _backward_kernel(
    logits_ptr,
    labels_ptr,
    lse_ptr,
    grad_out_ptr,
    grad_ptr,
    row_stride,
    vocab,
    scale,
    inv_temperature,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    z = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32) * scale
    lse2 = tl.load(lse_ptr + row) / _LN2
    g = tl.load(grad_out_ptr + row) * inv_temperature
    label = tl.load(labels_ptr + row)
    grad = (tl.where(cols == label, 1.0, 0.0) - tl.exp2(z - lse2)) * g
    tl.store(grad_ptr + row * vocab + cols, grad.to(grad_ptr.dtype.element_ty), mask=inside)


def _check(logits: torch.Tensor, labels: torch.Tensor, block: int, num_warps: int) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [N, V] with unit column stride and labels [N], got {tuple(logits.shape)} "
            f"(strides {logits.stride()}) and {tuple(labels.shape)}"
        )
    for name, value in (("block", block), ("num_warps", num_warps)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")


def triton_head_forward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    *,
    block: int = FORWARD_BLOCK,
    num_warps: int = FORWARD_WARPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p(labels) [N], entropy [N], lse [N])`` float32, of ``logits [N, V] / temperature``.

    ``block``: columns a program reads per step (a power of two); ``num_warps``: the
    program's warps. The defaults are what the engines run; a benchmark may sweep them.
    """
    _check(logits, labels, block, num_warps)
    rows, vocab = logits.shape
    out = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    if rows:
        _forward_kernel[(rows,)](
            logits, labels, out[0], out[1], out[2], logits.stride(0), vocab, math.log2(math.e) / temperature,
            BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    return out[0], out[1], out[2]


def triton_head_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_logprobs: torch.Tensor,
    temperature: float,
    *,
    block: int = BACKWARD_BLOCK,
    num_warps: int = BACKWARD_WARPS,
) -> torch.Tensor:
    """The gradient ``[N, V]`` in the logits' dtype; see the module docstring.

    ``lse [N]``: the forward's normaliser (natural log); ``grad_logprobs [N]``: the
    gradient of the loss with respect to ``log p(labels)``.
    """
    _check(logits, labels, block, num_warps)
    rows, vocab = logits.shape
    grad = torch.empty(rows, vocab, dtype=logits.dtype, device=logits.device)
    if rows:
        grid = (rows, triton.cdiv(vocab, block))
        _backward_kernel[grid](
            logits, labels, lse.contiguous(), grad_logprobs.float().contiguous(), grad, logits.stride(0),
            vocab, math.log2(math.e) / temperature, 1.0 / temperature, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    return grad
