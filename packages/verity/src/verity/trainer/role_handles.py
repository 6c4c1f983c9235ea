"""What the driver calls on each role: typed handles for the trainer, its stages and recovery.

A role's handle is a worker group, a colocated role's view of one
(:class:`verity.controller.worker_group.RoleView`) or the object a role's ``handle`` factory
builds (:class:`verity.trainer.async_rollout.AsyncRollout`). Every method below is a group
call: the batch is split over the role's data-parallel ranks and the answers come back
merged, as the worker's ``@register`` declares. Each batch argument and answer is a
:class:`verity.batch.Batch` of ``B`` rows; shapes are those of the batch schema
(``[B, P + R]`` sequences, ``[B, R]`` per-token values).

The protocols are structural: a plug-in's role needs no base class, only the methods
the stages it adds call (``ctx.role(name)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from verity.batch import Batch


class WorkerGroupHandle(Protocol):
    """A worker group as recovery and the stage guard see it."""

    name: str

    def worker_info(self) -> list[dict[str, Any]]:
        """Per rank: ``pid``, ``ip``, ``node_id``, ``niceness``, ``roles``."""
        ...

    def memory_peaks(self) -> dict[str, tuple[int | None, int]]:
        """Each ``<role>/<method>``'s memory peak since the last call: ``(device bytes or None, host bytes)``."""
        ...


@runtime_checkable
class GroupView(Protocol):
    """A handle that lives in a worker group it does not own (a colocated role, the async rollout)."""

    @property
    def group(self) -> Any:
        """The :class:`WorkerGroupHandle` the role's ranks run in."""
        ...


def worker_group_of(handle: Any) -> WorkerGroupHandle:
    """The worker group behind ``handle``: its ``group`` for a view, else the handle itself."""
    return handle.group if isinstance(handle, GroupView) else handle


class CheckpointedRole(Protocol):
    """A trained role: every rank saves and loads its shards under ``path`` (one answer per rank)."""

    def save_checkpoint(self, path: str) -> Any: ...

    def load_checkpoint(self, path: str) -> Any: ...


class ActorHandle(CheckpointedRole, Protocol):
    """The actor with its rollout and reference (:class:`verity.workers.actor_rollout.ActorRolloutRefWorker`)."""

    def generate(self, batch: Batch) -> Batch:
        """One response per (repeated) prompt row: ``responses``, ``response_mask`` ``[B, R]``, ..."""
        ...

    def compute_log_prob(self, batch: Batch) -> Batch:
        """The actor's ``old_logprobs`` and ``entropy`` ``[B, R]``."""
        ...

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """The reference policy's ``ref_logprobs`` ``[B, R]``."""
        ...

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs on the rows, then the rollout's weights refreshed; the update's metrics."""
        ...

    def publish_weights(self) -> dict[str, Any]:
        """The policy's weights put in Ray's object store for a rollout in other processes:
        ``refs``, ``bytes``, ``seconds`` (``trainer.mode=async``)."""
        ...


class CriticHandle(CheckpointedRole, Protocol):
    """The value model (:class:`verity.workers.critic.CriticWorker`)."""

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` ``[B, R]``."""
        ...

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Value-loss epochs on the rows; the update's metrics."""
        ...


class RewardModelHandle(Protocol):
    """A learned reward model (:class:`verity.workers.reward_model.RewardModelWorker`)."""

    def compute_rm_score(self, batch: Batch) -> Batch:
        """``rm_scores`` ``[B]``."""
        ...


class AsyncRolloutHandle(CheckpointedRole, Protocol):
    """The ``rollout`` role of ``trainer.mode=async`` (:class:`verity.trainer.async_rollout.AsyncRollout`)."""

    @property
    def pending_step(self) -> int | None:
        """The step whose batch is in flight, or None."""
        ...

    def submit(self, step: int, rows: Batch) -> None:
        """Start generating ``rows`` for ``step``."""
        ...

    def take(self, step: int) -> Batch:
        """The generated batch of ``step`` (waits for it)."""
        ...

    def sync_from(self, actor: ActorHandle, version: int) -> dict[str, float]:
        """Load the actor's weights of policy ``version``; the sync's metrics."""
        ...


StepEndHook = Callable[[int, Any], None]
"""Called by the loop after each step as ``hook(step, result)`` (``result``: the run's results so far)."""
