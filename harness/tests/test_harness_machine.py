"""The machine a harness run records: CPU hardware labels, the CPU's matrix ISA, expected-file lookup."""

from __future__ import annotations

import pytest
from verity.hardware import cpu_matmul_isa
from verity_harness.machine import cpu_label, detect_machine, hardware_label


@pytest.mark.parametrize(
    ("device_name", "label"),
    [
        ("Intel(R) Xeon(R) Processor", "cpu-intel-xeon"),
        ("AMD EPYC", "cpu-amd-epyc"),
        ("AMD EPYC 9654 96-Core Processor", "cpu-amd-epyc-9654"),
        ("Intel(R) Core(TM) i7-10700 CPU @ 2.90GHz", "cpu-intel-core-i7-10700"),
        ("Intel(R) Xeon(R) Platinum 8480+", "cpu-intel-xeon-platinum-8480"),
        ("aarch64", "cpu-aarch64"),
        ("CPU", "cpu"),  # nothing of a model left
        ("", "cpu"),
    ],
)
def test_cpu_labels_name_the_processor(device_name: str, label: str) -> None:
    assert cpu_label(device_name) == label
    assert hardware_label("cpu", device_name) == label


def test_accelerator_labels_are_unchanged() -> None:
    assert hardware_label("cuda", "NVIDIA H200") == "h200"
    assert hardware_label("cuda", "NVIDIA H100 PCIe") == "h100-pcie"
    assert hardware_label("cuda", "Some New GPU") == "some-new-gpu"


def test_this_cpu_is_detected_with_its_label_isa_and_family_fallback() -> None:
    machine = detect_machine(family="cpu")
    assert machine.family == "cpu" and machine.label == cpu_label(machine.device_name)
    assert machine.cpu_isa == cpu_matmul_isa()
    # expected files: the processor's own first, then every CPU's (cpu-hf.yaml)
    assert machine.lookup_labels[-1] == "cpu"
    assert machine.lookup_labels[0] == machine.label
    renamed = detect_machine(family="cpu", label="lab-box")
    assert renamed.label == "lab-box" and renamed.lookup_labels == ["lab-box", "cpu"]
