"""Host-memory offload for the FSDP2 engine: parameters through FSDP2's policy, optimizer state by hand.

Two settings of a role's ``fsdp2`` section (``actor.fsdp2``, ``critic.fsdp2``; the frozen
reference policy has its own ``actor.reference.offload_params``), both for an accelerator
(CUDA, ROCm, NPU): on the CPU every tensor already lives in host memory, so the config check
and :func:`check_offload` refuse them there.

``offload_params`` (:func:`offload_policy`) hands ``fully_shard`` a
``CPUOffloadPolicy``: each rank's shard of the float32 master parameters and of their
gradients lives in pinned host memory. Before a layer's all-gather its shard is copied to
the device; after backward its reduce-scattered gradient shard is copied back to the host;
the optimizer step (the fused CPU AdamW kernel) runs on the CPU, so AdamW's moments are
created and stay on the host as well. It needs FSDP2 sharding (a process group and
``sharding="full"``): the policy is a property of ``fully_shard``.

``offload_optimizer`` (:class:`OptimizerStateOffload`) keeps the parameters on the device
and moves every tensor of ``optimizer.state`` (AdamW's ``exp_avg``, ``exp_avg_sq`` and, for
the fused kernel, ``step``) to host memory when an update phase ends (one RL step's epochs,
:meth:`verity.engines.base.TrainingEngine.update_finished`) and back to the device where it
was before the next optimizer step, so the rollout and the log-prob passes between updates
have that memory.

What moves, per trained parameter (``W`` data-parallel ranks, float32 master weights)::

    offload_params     4 B parameter shard + 4 B gradient shard + 8 B AdamW moments = 16 B / W
                       device -> host for the whole run
    offload_optimizer  8 B AdamW moments / W (/ 1 under sharding=replicate), device -> host
                       between update phases

What it costs: ``offload_params`` copies each parameter shard host -> device once per
forward pass and once more per backward pass with ``reshard_after_forward`` (4 B / W per
parameter each, at the host link's bandwidth ``B``), the gradient shard device -> host once
per micro-batch (4 B / W), and runs AdamW on the CPU (the fused kernel reads parameter,
gradient and both moments and writes three back: 28 B / W of host-memory traffic per
parameter and step). ``offload_optimizer`` copies ``8 B x N / W`` each way once per
update phase: ``2 x 8 x N / W / B`` seconds per RL step. ``docs/engines.md`` ("Offload")
states the same with the numbers not yet measured on a GPU in this project.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

__all__ = [
    "OptimizerStateOffload",
    "check_offload",
    "host_collectives_backend",
    "move_optimizer_state",
    "offload_policy",
    "restore_optimizer_state",
]

HOST = torch.device("cpu")

# (id(parameter), state key) -> the device the state tensor was on before it moved
StateOrigins = dict[tuple[int, str], torch.device]


def check_offload(
    device: torch.device,
    *,
    offload_params: bool,
    offload_optimizer: bool,
    sharding: str,
    has_optimizer: bool,
    cuda_graphs: bool = False,
) -> None:
    """Raise ``ValueError`` naming the setting when the offload settings cannot apply to this engine.

    ``device``: where the engine computes. ``offload_params`` needs an accelerator, a process
    group and ``sharding="full"`` (FSDP2's policy), and no CUDA graphs; ``offload_optimizer``
    needs an accelerator and an optimizer, and adds nothing to ``offload_params`` (whose
    optimizer state is on the host already).
    """
    for name, value in (("offload_params", offload_params), ("offload_optimizer", offload_optimizer)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        if value and device.type == "cpu":
            raise ValueError(
                f"{name}=True moves tensors from an accelerator to host memory, and this engine computes "
                "on the CPU, where they already are; set it to False"
            )
    if offload_params and offload_optimizer:
        raise ValueError(
            "offload_params=True already keeps the AdamW state in host memory (the optimizer steps on the "
            "CPU); set offload_optimizer=False"
        )
    if offload_params:
        if sharding != "full":
            raise ValueError(
                f"offload_params=True is FSDP2's offload policy for sharded layers, and sharding={sharding!r} "
                "keeps a whole copy on every device; use sharding='full'"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "offload_params=True needs FSDP2 sharding, which needs a torch.distributed process group "
                "(one rank is enough); none is initialised in this process"
            )
        if cuda_graphs:
            raise ValueError(
                "offload_params=True with cuda_graphs=True: the graphs replay fixed device addresses of "
                "weights that offload keeps in host memory; switch one off"
            )
    if offload_optimizer and not has_optimizer:
        raise ValueError("offload_optimizer=True on an engine without an optimizer (inference only)")


def offload_policy(offload_params: bool) -> OffloadPolicy:
    """What ``fully_shard(offload_policy=...)`` gets: host-resident pinned shards, or none."""
    return CPUOffloadPolicy(pin_memory=True) if offload_params else OffloadPolicy()


def host_collectives_backend(dist_backend: str, device_type: str) -> str:
    """A process-group backend string that also runs collectives on host tensors.

    Under ``offload_params`` the parameter and gradient shards are host tensors on a
    device mesh: the gradient-norm reduction, full-tensor gathers and checkpoint reads
    then issue collectives on CPU tensors, which NCCL/HCCL cannot run. ``"nccl"`` on
    ``cuda`` becomes ``"cpu:gloo,cuda:nccl"`` (each device type its backend); ``gloo`` stays.
    """
    if dist_backend == "gloo" or device_type == "cpu" or ":" in dist_backend:
        return dist_backend
    return f"cpu:gloo,{device_type}:{dist_backend}"


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict, str]]:
    """``(parameter, its state dict, key)`` for every tensor value of ``optimizer.state``."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield param, state, key


def _wait(devices: set[torch.device]) -> None:
    """Block until the copies queued on these accelerator devices are done (host reads are then safe)."""
    for device in devices:
        if device.type == "cpu":
            continue
        runtime = getattr(torch, device.type, None)
        if runtime is not None and hasattr(runtime, "synchronize"):
            runtime.synchronize(device)


@torch.no_grad()
def move_optimizer_state(
    optimizer: torch.optim.Optimizer, device: torch.device | str = HOST
) -> tuple[StateOrigins, int]:
    """Move every tensor of ``optimizer.state`` to ``device``; non-tensor values stay as they are.

    Returns ``(origins, bytes)``: where each moved tensor was (for
    :func:`restore_optimizer_state`) and the bytes moved (local bytes of ``DTensor`` shards).
    ``DTensor`` shards move their local tensor and keep their mesh and placements (as FSDP2's
    own offloaded parameters do). Copies are issued ``non_blocking`` and waited for once at
    the end, so the moved tensors may be read as soon as this returns.
    """
    target = torch.device(device)
    origins: StateOrigins = {}
    moved = 0
    sources: set[torch.device] = set()
    for param, state, key in _state_tensors(optimizer):
        value = state[key]
        if value.device != target:  # recorded to come back; .to() of a tensor already there is itself
            origins[(id(param), key)] = value.device
            sources.add(value.device)
            moved += _local_bytes(value)
        state[key] = value.to(target, non_blocking=True)
    _wait(sources | {target})
    return origins, moved


@torch.no_grad()
def restore_optimizer_state(optimizer: torch.optim.Optimizer, origins: StateOrigins) -> int:
    """Move each state tensor named in ``origins`` back to its device; returns the bytes moved.

    Tensors not named (state created since, or restored by a checkpoint load) stay where they
    are. Host -> device copies are ``non_blocking``: they are ordered before the optimizer's
    kernels on the device's stream.
    """
    moved = 0
    for param, state, key in _state_tensors(optimizer):
        where = origins.get((id(param), key))
        value = state[key]
        if where is None or value.device == where:
            continue
        state[key] = value.to(where, non_blocking=True)
        moved += _local_bytes(value)
    return moved


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class OptimizerStateOffload:
    """Keeps an optimizer's state in host memory between update phases (``fsdp2.offload_optimizer``).

    :meth:`to_host` after an update phase, :meth:`to_device` before an optimizer step (a
    no-op while the state is already there). ``bytes_moved`` counts every byte copied either
    way since construction, for tests and metrics.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, host: torch.device | str = HOST) -> None:
        self.optimizer = optimizer
        self.host = torch.device(host)
        self._origins: StateOrigins = {}
        self.bytes_moved = 0

    @property
    def on_host(self) -> bool:
        """Whether the state moved to the host by :meth:`to_host` has not come back yet."""
        return bool(self._origins)

    def to_host(self) -> int:
        """Move every state tensor to host memory (waits for the copies); returns the bytes moved."""
        origins, moved = move_optimizer_state(self.optimizer, self.host)
        self._origins.update(origins)
        self.bytes_moved += moved
        return moved

    def to_device(self) -> int:
        """Move the state back where :meth:`to_host` found it; returns the bytes moved (0: nothing was away)."""
        if not self._origins:
            return 0
        moved = restore_optimizer_state(self.optimizer, self._origins)
        self._origins = {}
        self.bytes_moved += moved
        return moved
