"""Which machine a run is on: a hardware label, its family, the device name, peak FLOP/s; provenance.

The **hardware label** names expected files and result files:

- on a CPU-only machine, ``cpu-`` and the processor's model without its trademarks,
  clock and core count (``cpu-intel-xeon``, ``cpu-amd-epyc-9654``; :func:`cpu_label`),
  so that two CPUs' results neither replace each other nor share a leaderboard row;
- on an accelerator, the model of a device in verity's peak table, lower-cased
  (``h100``, ``h200``, ``a100``, ``mi300x``, ``910b3``);
- otherwise the device name reduced to ``[a-z0-9]`` words joined by ``-``.

The **family** is the hardware backend's name (``cpu``, ``cuda``, ``rocm``, ``npu``);
expected files for a family apply to every device of it (``cpu-hf.yaml`` to every CPU).
On a CPU the machine also records its widest matrix instruction set (``cpu_isa``:
``amx_bf16``, ``avx512_bf16``, ``avx512f``, ``avx2``), which a virtual machine's model name
often hides and which sets how fast bf16 runs.

:func:`provenance` gathers what a result must record to be reproduced: the git
commit (and whether the tree had uncommitted changes), package versions, Python.
"""

from __future__ import annotations

import platform
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

FAMILIES = ("cpu", "cuda", "rocm", "npu")
VERSIONED_PACKAGES = (
    "verity",
    "verity-harness",
    "torch",
    "transformers",
    "ray",
    "mlflow-skinny",
    "mlflow",
    "tensordict",
    "hydra-core",
)


@dataclass(frozen=True)
class Machine:
    """What the harness records about the hardware of a run."""

    label: str  # e.g. "cpu", "h100"
    family: str  # "cpu" | "cuda" | "rocm" | "npu"
    device_name: str
    peak_flops: float | None  # one device, dense bf16, FLOP/s; None when unknown (CPU: measured per run)
    device_count: int
    cpu_isa: str | None = None  # CPU runs: verity.hardware.cpu_matmul_isa, e.g. "amx_bf16"; None elsewhere

    @property
    def lookup_labels(self) -> list[str]:
        """Expected-file labels from most to least specific: the label, then the family."""
        return [self.label] if self.label == self.family else [self.label, self.family]


def slug(text: str) -> str:
    """Lower-case ``[a-z0-9]`` words joined by ``-`` (``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``)."""
    return "-".join(re.findall(r"[a-z0-9]+", text.lower())) or "unknown"


_CPU_NAME_NOISE = re.compile(
    r"\((?:r|tm)\)|\bcpu\b|\bprocessor\b|\b\d+-core\b|@\s*[\d.]+\s*ghz|[+]", re.IGNORECASE
)


def cpu_label(device_name: str) -> str:
    """``cpu-<model>``: the processor's model name without trademarks, "CPU"/"Processor", clock and cores.

    ``"Intel(R) Xeon(R) Processor"`` -> ``"cpu-intel-xeon"``, ``"AMD EPYC 9654 96-Core
    Processor"`` -> ``"cpu-amd-epyc-9654"``; ``"cpu"`` when nothing of a model is left.
    """
    words = re.findall(r"[a-z0-9]+", _CPU_NAME_NOISE.sub(" ", device_name).lower())
    return "-".join(["cpu", *words]) if words else "cpu"


def device_text(result: Mapping[str, Any]) -> str:
    """A result's device in words: ``"AMD EPYC, avx512_bf16"`` (the CPU's ISA where recorded)."""
    return ", ".join(str(v) for v in (result.get("device_name"), result.get("cpu_isa")) if v)


def hardware_label(family: str, device_name: str) -> str:
    """The hardware label of a device (see the module docstring)."""
    from verity.hardware import lookup_device

    if family == "cpu":
        return cpu_label(device_name)
    known = lookup_device(device_name)
    if known is not None:
        words = known.label.split()
        return slug(words[-1] if words[-1] not in ("SXM", "PCIe", "NVL") else " ".join(words[-2:]))
    return slug(device_name)


def detect_machine(family: str | None = None, label: str | None = None) -> Machine:
    """The machine this process runs on; ``family`` forces a backend, ``label`` renames the hardware."""
    import torch
    from verity.hardware import cpu_matmul_isa, get_backend

    if family is not None and family not in FAMILIES:
        raise ValueError(f"hardware family must be one of {', '.join(FAMILIES)}, got {family!r}")
    backend = get_backend(family)
    device_name = backend.device_name()
    count = backend.device_count() if backend.name != "cpu" else 1
    peak = backend.peak_flops(torch.bfloat16) if backend.name != "cpu" else None
    return Machine(
        label=label or hardware_label(backend.name, device_name),
        family=backend.name,
        device_name=device_name,
        peak_flops=peak,
        device_count=max(1, count),
        cpu_isa=cpu_matmul_isa() if backend.name == "cpu" else None,
    )


def git_commit(repo: Path | None = None) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether tracked files differ from it) of the checkout, or (None, None).

    ``repo`` None: the checkout that holds the ``verity`` package this process imports (the code
    that runs), wherever the command was started; (None, None) when it is not in a git checkout
    (e.g. installed from a wheel).
    """
    if repo is None:
        import verity

        repo = Path(verity.__file__).resolve().parent
    cwd = str(repo)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--"], cwd=cwd, capture_output=True, timeout=30
        ).returncode
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit or None, dirty != 0


def package_versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Installed versions of the packages a result depends on (missing ones left out)."""
    out = {"python": platform.python_version()}
    for name in (*VERSIONED_PACKAGES, *extra):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    if "verity" not in out:  # a source checkout on sys.path, not installed
        import verity

        out["verity"] = verity.__version__
    return out
