"""vLLM as a tensor-parallel replica of the caller's ranks: the pieces around vLLM's external launcher.

:class:`~verity.rollout.vllm_rollout.VLLMRollout` with a ``tp_mesh`` runs in-process on every rank
of an initialised torch process group (``distributed_executor_backend="external_launcher"``);
this module checks the mesh, hands vLLM the torchrun variables it reads, gives each start-up
its own shared-memory name, and unlinks the segments and broadcast buffers vLLM would leave
in ``/dev/shm`` when a worker is killed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from verity.rollout.options import VLLMOptions
from verity.rollout.process_guard import SHM_DIR, shm_segments

__all__ = [
    "check_tp_mesh",
    "external_launcher_ident",
    "job_token",
    "launcher_env",
    "unlink_broadcast_buffers",
    "unlink_shm_segments",
]


def check_tp_mesh(tp_mesh: Any, options: VLLMOptions) -> tuple[int, int]:
    """``(size, this rank's place)`` of a replica mesh vLLM's external launcher can serve, else ValueError."""
    if options.tensor_parallel_size > 1:
        raise ValueError(
            f"rollout.vllm.tensor_parallel_size = {options.tensor_parallel_size}: the engine already spans "
            "the rollout.tensor_parallel_size ranks of its replica; leave rollout.vllm.tensor_parallel_size at 1"
        )
    if options.in_process is False:
        raise ValueError(
            "rollout.vllm.in_process = false: a tensor-parallel replica of the actor's ranks runs vLLM inside "
            "those ranks' processes; leave it null"
        )
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "VLLMRollout(tp_mesh=...): the default torch process group must be initialised first"
        )
    size, rank = tp_mesh.size(), dist.get_rank()
    first = rank - rank % size
    ranks = [int(r) for r in tp_mesh.mesh.flatten().tolist()]
    if tp_mesh.ndim != 1 or ranks != list(range(first, first + size)) or dist.get_world_size() % size:
        raise ValueError(
            f"VLLMRollout(tp_mesh=...): vLLM's replicas are {size} consecutive ranks of the default process "
            f"group (rank {rank}: {list(range(first, first + size))}), got the mesh over ranks {ranks}"
        )
    return size, tp_mesh.get_local_rank()


def launcher_env() -> dict[str, str]:
    """The torchrun variables vLLM's external launcher reads, from the default process group."""
    rank = torch.distributed.get_rank()
    return {
        "RANK": str(rank),
        "LOCAL_RANK": os.environ.get("LOCAL_RANK", str(rank)),
        "WORLD_SIZE": str(torch.distributed.get_world_size()),
    }


def unlink_shm_segments(token: str) -> None:
    """Remove the names of vLLM's CPU shared-memory segments of this start-up from ``/dev/shm``.

    Every rank of the replica has mapped every segment once the engine is built (vLLM's start-up
    ends with a barrier after the ranks joined them), and a mapping outlives its name. vLLM
    would unlink them only in a destructor at interpreter exit, which a killed or ``os._exit``-ed
    worker never runs; without a name nothing is left behind.
    """
    for name in shm_segments():
        if f"verity{token}" in name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR / name)


def unlink_broadcast_buffers() -> None:
    """Unlink the ``psm_*`` ring buffers this rank created for vLLM's group broadcasts (all ranks attached).

    vLLM unlinks them when the buffer object is collected, which a Ray worker killed at the end of a
    run never gets to (24 MiB a TP group was left in ``/dev/shm``); the mappings live on until close.
    """
    from vllm.distributed import parallel_state
    from vllm.distributed.parallel_state import GroupCoordinator

    for group in list(vars(parallel_state).values()):
        broadcaster = getattr(group, "mq_broadcaster", None) if isinstance(group, GroupCoordinator) else None
        buffer = getattr(broadcaster, "buffer", None)
        if buffer is not None and getattr(buffer, "is_creator", False):
            with contextlib.suppress(FileNotFoundError):
                buffer.shared_memory.unlink()  # also forgets it in multiprocessing's resource tracker
            buffer.is_creator = False  # its finalizer then only unmaps it


def job_token() -> str:
    """A random identifier of this engine's start-up, the same on every rank (a collective: rank 0's)."""
    import uuid

    token = [uuid.uuid4().hex[:12]]
    torch.distributed.broadcast_object_list(token, src=0)
    return str(token[0])


@contextlib.contextmanager
def external_launcher_ident(token: str) -> Iterator[None]:
    """Make vLLM's external launcher name its CPU shared-memory segments after ``token``.

    The launcher's init method is ``env://`` and vLLM's CPU worker names its tensor-parallel
    segments after ``init_method.split(":")[-1]`` — ``//`` for every job on the host, so a second
    job (or a crashed run's leftovers) fails with ``create shm in SHMManager failed. errno: 17``.
    The process group exists already, so the init method is never dialled; it only carries the name.
    """
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    original = ExecutorWithExternalLauncher.__dict__["_distributed_args"]

    def _distributed_args(self: Any) -> tuple[str, int, int]:
        return f"tcp://127.0.0.1:0_verity{token}", int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])

    ExecutorWithExternalLauncher._distributed_args = _distributed_args
    try:
        yield
    finally:
        ExecutorWithExternalLauncher._distributed_args = original
