"""Peak dense FLOP/s of known accelerators, and model-FLOPs utilisation (MFU).

The table holds the *dense* (no 2:4 structured sparsity) 16-bit tensor-core
peak of each device, in FLOP/s, as printed on the vendor's spec sheet. Vendors
usually headline the sparse figure, which is exactly twice the dense one; the
numbers below are the dense ones.

| device                 | dense bf16/fp16 TFLOP/s | source                                                    |
|------------------------|-------------------------|-----------------------------------------------------------|
| NVIDIA H100 SXM5       | 989.4                   | NVIDIA H100 Tensor Core GPU datasheet (1,979 sparse)      |
| NVIDIA H100 PCIe       | 756.5                   | same datasheet (1,513 sparse)                             |
| NVIDIA H100 NVL        | 835.5                   | same datasheet (1,671 sparse)                             |
| NVIDIA H800 SXM5/PCIe  | 989.4 / 756.5           | NVIDIA H800 datasheet (same tensor cores as H100)         |
| NVIDIA H200 SXM        | 989.4                   | NVIDIA H200 Tensor Core GPU datasheet (1,979 sparse)      |
| NVIDIA H200 NVL        | 835.5                   | same datasheet (1,671 sparse)                             |
| NVIDIA H20             | 148                     | NVIDIA H20 product brief (296 sparse)                     |
| NVIDIA A100 (SXM/PCIe) | 312                     | NVIDIA A100 Tensor Core GPU datasheet (624 sparse)        |
| NVIDIA A800            | 312                     | NVIDIA A800 datasheet (624 sparse)                        |
| NVIDIA L40S            | 362.05                  | NVIDIA L40S datasheet (733 sparse)                        |
| AMD Instinct MI325X    | 1307.4                  | AMD Instinct MI325X data sheet (2,614.9 sparse)           |
| AMD Instinct MI300X    | 1307.4                  | AMD Instinct MI300X data sheet (2,614.9 sparse)           |
| AMD Instinct MI250X    | 383                     | AMD Instinct MI250X data sheet (no sparsity)              |
| Huawei Ascend 910B1    | 414                     | figures reported for the 910B variants (fp16); Huawei      |
| Huawei Ascend 910B2    | 376                     | publishes no per-variant public datasheet, so treat these |
| Huawei Ascend 910B3    | 313                     | four as approximate. A bare "910B" uses the 910B3 figure. |
| Huawei Ascend 910B4    | 280                     |                                                           |

bf16 and fp16 share one peak on every device listed. Other dtypes return
``None``: MFU for fp8 or fp32 training needs its own column, which nobody here
has measured against.

Device names are matched case-insensitively on the string the runtime reports
(``torch.cuda.get_device_name()`` — e.g. "NVIDIA H100 80GB HBM3",
"NVIDIA A100-SXM4-80GB", "AMD Instinct MI300X" — or torch_npu's
"Ascend910B3"). Unknown devices get ``None`` rather than a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

TERA = 1e12

_SIXTEEN_BIT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KnownDevice:
    """One row of the peak table: a display name, a name pattern, the dense 16-bit peak."""

    label: str
    pattern: str  # regex searched in the lower-cased runtime device name
    dense_bf16_flops: float  # FLOP/s


# Order matters: the first match wins, so variants come before their family
# ("h100 pcie" before "h100", "h200" before "h20").
KNOWN_DEVICES: tuple[KnownDevice, ...] = (
    KnownDevice("NVIDIA H100 PCIe", r"h100.*pcie", 756.5 * TERA),
    KnownDevice("NVIDIA H100 NVL", r"h100.*nvl", 835.5 * TERA),
    KnownDevice("NVIDIA H100 SXM", r"h100", 989.4 * TERA),
    KnownDevice("NVIDIA H800 PCIe", r"h800.*pcie", 756.5 * TERA),
    KnownDevice("NVIDIA H800 SXM", r"h800", 989.4 * TERA),
    KnownDevice("NVIDIA H200 NVL", r"h200.*nvl", 835.5 * TERA),
    KnownDevice("NVIDIA H200", r"h200", 989.4 * TERA),
    KnownDevice("NVIDIA H20", r"h20(?![0-9])", 148.0 * TERA),
    KnownDevice("NVIDIA A100", r"a100", 312.0 * TERA),
    KnownDevice("NVIDIA A800", r"a800", 312.0 * TERA),
    KnownDevice("NVIDIA L40S", r"l40s", 362.05 * TERA),
    KnownDevice("AMD Instinct MI325X", r"mi325x", 1307.4 * TERA),
    KnownDevice("AMD Instinct MI300X", r"mi300x", 1307.4 * TERA),
    KnownDevice("AMD Instinct MI250X", r"mi250x", 383.0 * TERA),
    KnownDevice("Huawei Ascend 910B1", r"910b1", 414.0 * TERA),
    KnownDevice("Huawei Ascend 910B2", r"910b2", 376.0 * TERA),
    KnownDevice("Huawei Ascend 910B3", r"910b3", 313.0 * TERA),
    KnownDevice("Huawei Ascend 910B4", r"910b4", 280.0 * TERA),
    KnownDevice("Huawei Ascend 910B", r"910b", 313.0 * TERA),
)


def lookup_device(device_name: str) -> KnownDevice | None:
    """The table row whose pattern matches ``device_name`` (case-insensitive), or None."""
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str, got {type(device_name).__name__}")
    lowered = device_name.lower()
    for known in KNOWN_DEVICES:
        if re.search(known.pattern, lowered):
            return known
    return None


def peak_flops_for(device_name: str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense peak FLOP/s of one device for ``dtype``; None for an unknown device or dtype.

    Only 16-bit floating types (bfloat16, float16) have figures.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if dtype not in _SIXTEEN_BIT_DTYPES:
        return None
    known = lookup_device(device_name)
    return None if known is None else known.dense_bf16_flops


def training_flops_per_token(
    n_params: int, *, n_layers: int = 0, hidden_size: int = 0, seq_len: int = 0
) -> float:
    """Model FLOPs to train on one token (forward + backward), excluding recomputation.

    ``6 * N`` counts the matrix multiplies against the N weights: 2N in the
    forward pass (one multiply and one add per weight), 4N in the backward pass
    (gradients with respect to activations and to weights). Attention's
    score and value products, which touch no weights, add ``12 * L * H * S``
    per token (L layers, hidden size H, context length S; forward + backward)
    when the three are given; leave them at 0 to count weights only.
    Embedding lookups are not matrix multiplies and are counted only insofar
    as they are included in ``n_params`` — pass the non-embedding count to
    leave them out.
    """
    if n_params < 0 or n_layers < 0 or hidden_size < 0 or seq_len < 0:
        raise ValueError(
            f"n_params, n_layers, hidden_size, seq_len must be >= 0, got "
            f"{n_params}, {n_layers}, {hidden_size}, {seq_len}"
        )
    return 6.0 * n_params + 12.0 * n_layers * hidden_size * seq_len


def mfu(
    tokens_per_s: float,
    n_params: int,
    peak_flops: float | None,
    *,
    num_devices: int = 1,
    flops_per_token: float | None = None,
) -> float | None:
    """Model-FLOPs utilisation: achieved model FLOP/s over the devices' peak.

    ``MFU = flops_per_token * tokens_per_s / (peak_flops * num_devices)`` with
    ``flops_per_token = 6 * n_params`` unless given (see
    :func:`training_flops_per_token`). ``tokens_per_s`` is the training
    throughput summed over all ``num_devices`` devices (tokens that went through
    forward and backward; padding excluded). A value in [0, 1] on a sane run.

    Returns None when ``peak_flops`` is None (unknown device) so callers can
    log MFU only where it means something.
    """
    if tokens_per_s < 0:
        raise ValueError(f"tokens_per_s must be >= 0, got {tokens_per_s}")
    if n_params <= 0 and flops_per_token is None:
        raise ValueError(f"n_params must be > 0, got {n_params}")
    if num_devices <= 0:
        raise ValueError(f"num_devices must be > 0, got {num_devices}")
    if peak_flops is None:
        return None
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0 FLOP/s, got {peak_flops}")
    per_token = 6.0 * n_params if flops_per_token is None else float(flops_per_token)
    return per_token * tokens_per_s / (peak_flops * num_devices)


def moe_layer_count(config: object) -> int:
    """Decoder layers of an HF mixture-of-experts config that route to experts (0 for a dense config).

    Qwen2-MoE and Qwen3-MoE: layer ``i`` is sparse when it is not in ``mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``.
    """
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    if experts <= 1:
        return 0
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    layers = int(config.num_hidden_layers)  # type: ignore[attr-defined]
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def active_parameters(n_params: int, config: object) -> int:
    """Parameters one token computes with: ``n_params`` less the routed experts it does not visit.

    For a mixture-of-experts config (``num_experts`` E, ``num_experts_per_tok`` k, expert width
    ``moe_intermediate_size`` I, hidden size H) each sparse layer holds E experts of ``3 H I`` weights
    (gate, up, down projections) and a token runs k of them, so ``(E - k) 3 H I`` per sparse layer are
    left out; shared experts, attention, routers and embeddings all count. A dense config: ``n_params``.
    Pass the result as :func:`training_flops_per_token`'s ``n_params`` for an MoE model's MFU.
    """
    sparse = moe_layer_count(config)
    if sparse == 0:
        return int(n_params)
    experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
    top_k = int(config.num_experts_per_tok)  # type: ignore[attr-defined]
    width = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)  # type: ignore[attr-defined]
    idle = sparse * (experts - top_k) * 3 * int(config.hidden_size) * width  # type: ignore[attr-defined]
    return int(n_params) - idle
