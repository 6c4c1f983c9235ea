"""Every node of a run must see the same ``trainer.output_dir``: checked before any worker starts.

Checkpoints and exports are written by the workers, on their own nodes, into the folder the
driver names. On a cluster without a shared file system each node would write a private
copy, and a resume would find half a checkpoint. So before the pools start, one small task
on each node the plan uses (other than the driver's) writes a marker file with a token into
``<output_dir>/.verity-nodes/``; the driver reads each marker back and stops with one sentence
naming the first node whose marker it cannot read. The markers are removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verity.controller.placement import NodeInfo

# Only the standard library at module level: a node's marker task imports this module in a
# fresh Ray worker, where importing verity.config (torch, Hydra) is slow enough, on a busy
# machine, to eat the check's time limit (ci/reports/2026-12-06-docstring-figures.md).

__all__ = ["MARKER_DIR", "check_shared_output_dir", "write_marker"]

MARKER_DIR = ".verity-nodes"


def write_marker(folder: str, name: str, token: str) -> str:
    """Write ``token`` to ``folder/name`` on this node; return this node's host name (for the message)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(token)
    return socket.gethostname()


def _on_node(node_id: str, folder: str, name: str, token: str, timeout_s: float) -> str:
    """:func:`write_marker` as a Ray task pinned to ``node_id``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(write_marker)
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return ray.get(task.options(scheduling_strategy=strategy).remote(folder, name, token), timeout=timeout_s)


def check_shared_output_dir(
    output_dir: str | os.PathLike,
    nodes: Sequence[NodeInfo],
    timeout_s: float = 60.0,
    writer: Callable[[str, str, str, str, float], str] | None = None,
) -> None:
    """Raise :class:`ConfigError` unless a marker written on each of ``nodes`` reads back here.

    ``output_dir`` is the driver's absolute path; ``writer(node_id, folder, name, token, timeout_s)``
    writes on that node (default: a Ray task pinned to it; tests pass their own).
    """
    from verity.config.errors import ConfigError

    writer = writer or _on_node
    folder = Path(output_dir).expanduser().absolute() / MARKER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    try:
        for node in nodes:
            token = secrets.token_hex(8)
            name = f"{node.node_id[:16]}-{token}"
            try:
                host = writer(node.node_id, str(folder), name, token, timeout_s)
            except Exception as err:  # the node could not write there at all
                first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                raise ConfigError(
                    f"trainer.output_dir={output_dir}: node {node.label} could not write into {folder} ({first}); "
                    "every node of the run must reach the same folder (a shared file system, docs/multi-node.md)"
                ) from None
            marker = folder / name
            seen = marker.read_text() if marker.is_file() else None
            if seen != token:
                raise ConfigError(
                    f"trainer.output_dir={output_dir}: node {node.label} (host {host}) wrote a marker into {folder} "
                    "that this driver cannot read back, so the nodes do not share that folder; put "
                    "trainer.output_dir on a file system every node mounts at the same path (docs/multi-node.md)"
                )
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(folder)
