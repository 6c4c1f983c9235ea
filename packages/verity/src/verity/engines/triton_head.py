"""The compiled loss head's CUDA kernels, written in Triton: one read of the logits forward, one read and one write backward.

Forward, one program per row of ``x [N, V]`` at ``z = x / tau``: a single pass over the
vocabulary keeps, per lane, the running maximum ``m``, ``s = sum exp(z - m)`` and
``t = sum exp(z - m) (z - m)``, rescaled whenever ``m`` grows (``m -> m'``:
``s -> s e^(m - m')``, ``t -> e^(m - m') (t + (m - m') s)``); the lanes are then combined
to the row's ``M``, ``S``, ``T`` and::

    lse = M + log S        log p_y = z_y - lse        H = log S - T / S

(``H = lse - E_p[z]`` and ``E_p[z - M] = T / S``). Backward, one program per row and
block of columns: ``(1[v = y] - exp(z_v - lse)) g / tau`` written in the logits' dtype.

Inductor's kernel for the same math (:func:`verity.engines.compiled_head.head_forward`)
loops over each row once per reduction (maximum, normaliser, entropy, as its CPU code
shows); these read it once. Used on CUDA
for 16- and 32-bit logits; :mod:`verity.engines.compiled_head` chooses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["triton_head_backward", "triton_head_forward"]

FORWARD_BLOCK = 4096
BACKWARD_BLOCK = 4096


@triton.jit
def _forward_kernel(
    logits_ptr,
    labels_ptr,
    logprobs_ptr,
    entropy_ptr,
    lse_ptr,
    row_stride,
    vocab,
    inv_temperature,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    t = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        z = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, z)
        seen = m_new > float("-inf")  # a lane that has only read padding has nothing to add
        m_ref = tl.where(seen, m_new, 0.0)
        alpha = tl.where(seen, tl.exp(m - m_ref), 1.0)
        e = tl.exp(z - m_ref)
        d = tl.where(e > 0.0, z - m_ref, 0.0)
        t = alpha * (t + tl.where(s > 0.0, m - m_ref, 0.0) * s) + e * d
        s = alpha * s + e
        m = m_new
    big_m = tl.max(m, axis=0)
    used = s > 0.0
    w = tl.where(used, tl.exp(m - big_m), 0.0)
    big_s = tl.sum(w * s, axis=0)
    big_t = tl.sum(w * (t + tl.where(used, m - big_m, 0.0) * s), axis=0)
    log_s = tl.log(big_s)
    lse = big_m + log_s
    label = tl.load(labels_ptr + row)
    chosen = tl.load(base + label).to(tl.float32) * inv_temperature
    tl.store(logprobs_ptr + row, chosen - lse)
    tl.store(entropy_ptr + row, log_s - big_t / big_s)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _backward_kernel(
    logits_ptr,
    labels_ptr,
    lse_ptr,
    grad_out_ptr,
    grad_ptr,
    row_stride,
    vocab,
    inv_temperature,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    z = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=0.0).to(tl.float32) * inv_temperature
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_out_ptr + row) * inv_temperature
    label = tl.load(labels_ptr + row)
    grad = (tl.where(cols == label, 1.0, 0.0) - tl.exp(z - lse)) * g
    tl.store(grad_ptr + row * vocab + cols, grad.to(grad_ptr.dtype.element_ty), mask=inside)


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [N, V] with unit column stride and labels [N], got {tuple(logits.shape)} "
            f"(strides {logits.stride()}) and {tuple(labels.shape)}"
        )


def triton_head_forward(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p(labels) [N], entropy [N], lse [N])`` float32, of ``logits [N, V] / temperature``."""
    _check(logits, labels)
    rows, vocab = logits.shape
    out = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    if rows:
        _forward_kernel[(rows,)](
            logits, labels, out[0], out[1], out[2], logits.stride(0), vocab, 1.0 / temperature,
            BLOCK=FORWARD_BLOCK, num_warps=8,
        )  # fmt: skip
    return out[0], out[1], out[2]


def triton_head_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_logprobs: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """The gradient ``[N, V]`` in the logits' dtype; see the module docstring."""
    _check(logits, labels)
    rows, vocab = logits.shape
    grad = torch.empty(rows, vocab, dtype=logits.dtype, device=logits.device)
    if rows:
        grid = (rows, triton.cdiv(vocab, BACKWARD_BLOCK))
        _backward_kernel[grid](
            logits, labels, lse.contiguous(), grad_logprobs.float().contiguous(), grad, logits.stride(0),
            vocab, 1.0 / temperature, BLOCK=BACKWARD_BLOCK, num_warps=8,
        )  # fmt: skip
    return grad
