"""The machine a night ran on, and whether the accepted baseline was measured on the same one.

The nightly compares ratios measured side by side in one run, which cancel most of a
machine's speed but not all of it: the same code read a 512x8 bf16 TRL pair of 2.77 on a
2-core Xeon with AMX and 2.20 on a 2-core EPYC without (``ci/reports/2026-11-26-nightly-8.md``),
because there bf16 matmuls bound both sides. So a night records its machine
(:func:`this_machine`), ``--accept`` stores it beside the accepted figures of its machine
class (``ci/nightly_baselines.py``), and a night is compared with its own class's
baseline, or, on a class with none, with the nearest class's (``ci/nightly_cross_class.py``).
Within a class, a machine that still differs (another core count, another device name) is
named above the table and beside every speed figure (:func:`speed_figure`), so a figure that moved
with the hardware is read as such, not as a code change; the gates still apply.

A machine is ``{"hardware", "device_name", "cpu_isa", "logical_cpus"}``: the harness's
hardware label and device name (:mod:`verity_harness.machine`), the CPU's widest matrix
instruction set (``amx_bf16``, ``avx512_bf16``, ...; None off CPU or unknown) and
``os.cpu_count()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

MACHINE_KEYS = ("hardware", "device_name", "cpu_isa", "logical_cpus")


def this_machine() -> dict[str, Any]:
    """The machine this process runs on (the nightly runs every row and bench here)."""
    from verity_harness.machine import detect_machine

    machine = detect_machine()
    return {
        "hardware": machine.label,
        "device_name": machine.device_name,
        "cpu_isa": machine.cpu_isa,
        "logical_cpus": os.cpu_count(),
    }


def describe(machine: Mapping[str, Any] | None) -> str:
    """One line: ``cpu-amd-epyc (AMD EPYC, avx512_bf16, 2 logical CPUs)``; "not recorded" for None."""
    if not machine:
        return "not recorded"
    details = [str(machine.get("device_name") or "?")]
    if machine.get("cpu_isa"):
        details.append(str(machine["cpu_isa"]))
    if machine.get("logical_cpus"):
        details.append(f"{machine['logical_cpus']} logical CPUs")
    return f"{machine.get('hardware', '?')} ({', '.join(details)})"


def machine_differences(tonight: Mapping[str, Any], accepted: Mapping[str, Any] | None) -> list[str]:
    """What differs between tonight's machine and the accepted night's: ``["cpu_isa: avx512_bf16, accepted amx_bf16"]``.

    ``[]`` when they are the same; ``["the accepted night's machine is not recorded"]`` for a
    baseline accepted before nights recorded their machine.
    """
    if not accepted:
        return ["the accepted night's machine is not recorded"]
    return [
        f"{key}: {tonight.get(key)}, accepted {accepted.get(key)}"
        for key in MACHINE_KEYS
        if tonight.get(key) != accepted.get(key)
    ]


def speed_figure(metric: str) -> bool:
    """Whether a baseline figure measures speed (a bench ratio, a row's tokens/s against plain PyTorch)."""
    return metric.startswith("bench.") or metric.endswith(".tokens_per_s_vs_plain_torch")


def note_other_machine(
    findings: Sequence[Any], machine: Mapping[str, Any], accepted_machine: Mapping[str, Any] | None
) -> None:
    """Append "accepted on another machine" to the note of each speed finding when the machines differ.

    ``findings``: the nightly's ``Finding`` objects (``metric``, ``baseline``, ``note``), changed in place.
    """
    if not machine_differences(machine, accepted_machine):
        return
    for finding in findings:
        if speed_figure(finding.metric) and finding.baseline is not None:
            finding.note = "; ".join(n for n in (finding.note, "accepted on another machine") if n)


def machine_lines(tonight: Mapping[str, Any], accepted: Mapping[str, Any] | None) -> list[str]:
    """The report's lines on the machine: tonight's, the accepted night's, and what differs."""
    lines = [f"machine: {describe(tonight)}; accepted night's: {describe(accepted)}"]
    differences = machine_differences(tonight, accepted)
    if differences:
        lines += [
            "",
            "**Another machine than the accepted night's** ("
            + "; ".join(differences)
            + "): the speed figures below compare two machines, not only two commits.",
        ]
    return lines
