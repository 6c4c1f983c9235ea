"""verity.hardware.flops: the peak table's name matching and the MFU arithmetic."""

from __future__ import annotations

import pytest
import torch
from verity.hardware import lookup_device, mfu, peak_flops_for, training_flops_per_token


@pytest.mark.parametrize(
    ("runtime_name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.4),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA H20", 148.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A800-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.05),
        ("AMD Instinct MI300X", 1307.4),
        ("AMD Instinct MI325X", 1307.4),
        ("AMD Instinct MI250X", 383.0),
        ("Ascend910B3", 313.0),
        ("Ascend910B1", 414.0),
        ("Ascend910B", 313.0),
    ],
)
def test_known_devices_match_their_runtime_names(runtime_name, tflops):
    assert peak_flops_for(runtime_name, torch.bfloat16) == pytest.approx(tflops * 1e12)
    assert peak_flops_for(runtime_name, torch.float16) == pytest.approx(tflops * 1e12)


def test_h20_is_not_mistaken_for_h200_and_back():
    assert lookup_device("NVIDIA H20").label == "NVIDIA H20"
    assert lookup_device("NVIDIA H200").label == "NVIDIA H200"


def test_unknown_devices_and_dtypes_have_no_peak():
    assert peak_flops_for("NVIDIA GeForce RTX 4090") is None
    assert peak_flops_for("NVIDIA H100 80GB HBM3", torch.float32) is None
    with pytest.raises(TypeError, match="dtype"):
        peak_flops_for("NVIDIA H100", "bf16")  # type: ignore[arg-type]


def test_mfu_is_six_n_tokens_over_peak():
    # 1e9 params * 6 FLOP * 1000 tokens/s = 6e12 FLOP/s against a 1e14 peak.
    assert mfu(1000.0, 1_000_000_000, 1e14) == pytest.approx(0.06)
    assert mfu(1000.0, 1_000_000_000, 1e14, num_devices=2) == pytest.approx(0.03)
    assert mfu(1000.0, 1_000_000_000, None) is None
    assert mfu(10.0, 1, 1e3, flops_per_token=50.0) == pytest.approx(0.5)


def test_training_flops_per_token_adds_attention_term():
    # 6 * 100 + 12 * layers 2 * hidden 4 * seq 8 = 600 + 768
    assert training_flops_per_token(100, n_layers=2, hidden_size=4, seq_len=8) == 1368.0
    assert training_flops_per_token(100) == 600.0


def test_mfu_rejects_nonsense():
    with pytest.raises(ValueError, match="tokens_per_s"):
        mfu(-1.0, 10, 1e12)
    with pytest.raises(ValueError, match="num_devices"):
        mfu(1.0, 10, 1e12, num_devices=0)
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1.0, 10, 0.0)


def test_the_cpu_matmul_peak_is_measured_on_the_threads_asked_for() -> None:
    import torch
    from verity.hardware.cpu_peak import measure_matmul_flops

    before = torch.get_num_threads()
    one = measure_matmul_flops(1, size=128, min_seconds=0.02, repeats=2)
    # a float32 128^3 matmul takes microseconds: anything between 10 MFLOP/s and 100 TFLOP/s is a
    # measurement; 0, a negative or an absurd figure is a bug in the arithmetic
    assert 1e7 < one < 1e14
    assert torch.get_num_threads() == before  # the caller's thread setting is restored
    with pytest.raises(ValueError, match="threads must be >= 1"):
        measure_matmul_flops(0)
