"""A private Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), joined by the test.

    with simulated_cluster(head={"num_cpus": 2}, nodes=[{"num_cpus": 2}]) as cluster:
        ...   # ray.init(address=cluster.address) already done; trainer.ray_address=cluster.address joins it too

Everything lives under a fresh temp folder (``RAY_TMPDIR`` pointed there while it runs), so the
test never joins or leaves behind anyone else's cluster. GPUs given as ``num_gpus`` are only
declared resources: nothing computes on them, they let a test check placement plans.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def simulated_cluster(head: dict[str, Any], nodes: list[dict[str, Any]]) -> Iterator[Any]:
    """Start a head node plus ``nodes`` (each ``Cluster.add_node`` keyword arguments), join it, tear it down."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="vr-sim-", dir="/tmp")  # short: Ray's socket paths live under it
    os.makedirs(os.path.join(temp_dir, "ray"))
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp_dir
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={**head, "temp_dir": temp_dir, "include_dashboard": False},
        )
        for node in nodes:
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        shutil.rmtree(temp_dir, ignore_errors=True)
