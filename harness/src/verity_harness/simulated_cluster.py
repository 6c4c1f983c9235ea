"""Several Ray nodes on this machine, for recipe configs that span nodes (``trainer.nnodes: 2``).

    shape = shape_to_simulate(overrides, config_file, family="cpu")   # None: the run needs none
    with simulated_cluster(shape) as address:                        # None when shape is None
        cfg = load_config([*overrides, f"trainer.ray_address={address}"], config_file=config_file)

A config that asks for more than one node (``trainer.nnodes``, or a separate role's ``nnodes``)
and names no cluster to join is refused by verity's validation. The harness runs it anyway, on a
cluster it simulates: a ``ray.cluster_utils.Cluster`` with that many nodes on this machine, the
head (node 1) also the driver's node, each node with the CPUs of its share of the pools (workers
per node x ``trainer.cpus_per_worker``, at least 1). A run that names a cluster
(``trainer.ray_address=auto``, or ``RAY_ADDRESS`` in the environment) joins it and nothing is
simulated.

The cluster lives in a fresh short folder under ``/tmp`` (``RAY_TMPDIR`` points there while it
runs; Ray's socket paths live under it), and is torn down when the block ends, also on a failure.
Its processes carry ``VERITY_RAY_CLUSTER=<folder>`` (and ``SPT_NOENV=1``) like a private cluster's
(:func:`verity.controller.cluster.cluster_environment`), and verity's reaper
(:mod:`verity.controller.reaper`) kills what is left of them should the harness die without its
``finally`` (``kill -9``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: stands in for a cluster address while the harness reads the shape a config asks for
PROBE_ADDRESS = "harness-simulated-cluster"


@dataclass(frozen=True)
class SimulatedShape:
    """The cluster the harness starts: ``nodes`` nodes (the head included) of ``cpus_per_node`` CPUs each."""

    nodes: int
    cpus_per_node: int


def nodes_asked(cfg: Any) -> int:
    """The most nodes any of the run's pools asks for (the actor's ``trainer.nnodes``, a separate role's ``nnodes``)."""
    from verity.launch.pools import role_shapes

    return max((shape.nnodes or 1) for shape in role_shapes(cfg).values())


def cpus_per_node(cfg: Any) -> int:
    """CPUs each simulated node gets: the sum of every pool's per-node share, at least 1.

    A pool's share is its workers over its nodes (all of them when its ``nnodes`` is unset: the
    placement plan may put it on one node) times ``trainer.cpus_per_worker``; colocated roles run in
    the actor's pool.
    """
    from verity.launch.pools import role_shapes

    cpus = 0.0
    for name, shape in role_shapes(cfg).items():
        if name != "actor" and shape.placement != "separate":
            continue
        per_node = math.ceil(shape.n_workers / (shape.nnodes or 1))
        cpus += per_node * float(cfg.trainer.cpus_per_worker)
    return max(1, math.ceil(cpus - 1e-9))


def shape_of(probe_cfg: Any) -> SimulatedShape | None:
    """The cluster to simulate for ``probe_cfg`` (composed with ``trainer.ray_address=PROBE_ADDRESS`` ahead of
    the caller's overrides), or None: one node, or the caller named a cluster of their own."""
    if probe_cfg.trainer.ray_address != PROBE_ADDRESS:
        return None
    nodes = nodes_asked(probe_cfg)
    if nodes <= 1:
        return None
    return SimulatedShape(nodes, cpus_per_node(probe_cfg))


def shape_to_simulate(
    overrides: Sequence[str], config_file: str | Path, family: str = "cpu"
) -> SimulatedShape | None:
    """Whether the harness must simulate a cluster to run this config, and which; None: it loads as it is.

    The config is loaded as given first: when it loads (one node, or a cluster named by
    ``trainer.ray_address`` or ``RAY_ADDRESS``), nothing is simulated. When it is refused, it is
    loaded again with :data:`PROBE_ADDRESS` as the cluster (before ``overrides``, so the caller's
    own address wins); if that loads and asks for several nodes, they are simulated. Otherwise the
    refusal is raised: the second load's (a setting wrong besides the missing cluster), else the
    first's. Simulated nodes share this machine's devices, so only a CPU run
    (``family``) simulates them; on an accelerator the refusal says to name a real cluster.
    """
    from verity.config import ConfigError, load_config

    try:
        load_config(list(overrides), config_file=config_file)
        return None
    except ConfigError as err:
        refusal = err
    # with a cluster to join the config loads, or its refusal is what the run would meet with one:
    # a setting out of range is named, not hidden behind the missing cluster
    probe = load_config([f"trainer.ray_address={PROBE_ADDRESS}", *overrides], config_file=config_file)
    shape = shape_of(probe)
    if shape is None:
        raise refusal
    if family != "cpu":
        raise ConfigError(
            f"{refusal} (verity-harness simulates {shape.nodes} nodes on a CPU only: on {family} "
            "devices pass trainer.ray_address of a real cluster)"
        ) from None
    return shape


def _reaper_script() -> str:
    spec = importlib.util.find_spec("verity.controller.reaper")
    assert spec is not None and spec.origin is not None
    return spec.origin


@contextlib.contextmanager
def _environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: unset) inside the block, restored after it."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def simulated_cluster(shape: SimulatedShape | None) -> Iterator[str | None]:
    """Start ``shape``'s nodes on this machine and yield the cluster's address; tear it all down after.

    ``shape`` None yields None and starts nothing. The driver does not join here: the run joins
    the address it is given (``trainer.ray_address``) and leaves it when it ends.
    """
    if shape is None:
        yield None
        return
    import ray
    from ray.cluster_utils import Cluster
    from verity.controller.cluster import LOCAL_WORKER_NICENESS, cluster_environment

    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="vh-sim-", dir="/tmp")  # short: Ray's socket paths live under it
    os.makedirs(os.path.join(temp_dir, "ray"))
    reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", _reaper_script(), temp_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives a kill of the harness's process group
        close_fds=True,
    )
    cluster = None
    try:
        with _environment({"RAY_TMPDIR": temp_dir, "RAY_USAGE_STATS_ENABLED": "0"}):
            # the nodes' processes inherit the reaper's marker (and SPT_NOENV, which keeps it readable)
            with _environment(cluster_environment(temp_dir)):
                cluster = Cluster(
                    initialize_head=True,
                    head_node_args={
                        "num_cpus": shape.cpus_per_node,
                        "temp_dir": temp_dir,
                        "include_dashboard": False,
                        # as a private cluster's: workers at the driver's CPU priority
                        "_system_config": {"worker_niceness": LOCAL_WORKER_NICENESS},
                    },
                )
                for _ in range(shape.nodes - 1):
                    cluster.add_node(num_cpus=shape.cpus_per_node)
                cluster.wait_for_nodes()
            print(
                f"verity-harness: simulated a Ray cluster of {shape.nodes} nodes x {shape.cpus_per_node} CPU(s) "
                f"on this machine at {cluster.address}",
                flush=True,
            )
            yield cluster.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.shutdown()
        with contextlib.suppress(OSError):
            reaper.stdin.close()  # the reaper kills whatever of the cluster is left, removes the folder
        with contextlib.suppress(subprocess.TimeoutExpired):
            reaper.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
