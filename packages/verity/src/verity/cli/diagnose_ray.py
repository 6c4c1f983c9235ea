"""``verity diagnose --ray``: Ray's status here, the joined cluster's nodes, and whether a run's layout fits.

Split from :mod:`verity.cli.diagnose` (versions, hardware, the report's rendering): this module
starts or joins Ray, lists the nodes (:func:`verity.controller.placement.cluster_nodes`) and,
given a run config, plans its pools on them (:func:`verity.launch.pools.pool_requests`,
:func:`verity.controller.placement.plan_placement`) and estimates each worker's memory
(:mod:`verity.launch.memory_plan`) without starting anything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verity.controller.placement import PoolRequest
    from verity.hardware import HardwareBackend
    from verity.launch.memory_plan import MemoryPlan


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
    memory: MemoryPlan | None = None
    memory_error: str | None = None


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
    from verity.launch.pools import pool_requests

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
    try:
        from verity.launch.memory_plan import plan_for_run, policy_model

        question.memory = plan_for_run(cfg, policy_model(cfg), backend)
    except (ConfigError, OSError, ValueError) as error:
        question.memory_error = f"{type(error).__name__}: {error}"
    return question


def collect_memory(question: LayoutQuestion) -> dict[str, Any]:
    """The ``memory_plan`` section: each worker's estimated peak and terms, and whether it fits
    (``fits``: None when the memory per worker is unknown; ``error``: the refusal's sentence)."""
    if question.memory is None:
        return {"fits": None if question.error else False, "error": question.memory_error or question.error}
    plan = question.memory
    out: dict[str, Any] = {"fits": plan.fits(), "plan": plan.describe().splitlines(), "record": plan.record()}
    refusal = plan.refusal()
    if refusal is not None:
        out["error"] = refusal
    return out


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
