"""One-step off-policy training (``trainer.mode=async``): the next batch is generated while this one trains.

The ``rollout`` role runs in a worker group of its own (``rollout.n_workers`` Ray
actors, their own resource pool; :class:`~verity.workers.rollout_worker.RolloutWorker`).
At step :math:`t` (1-based) the stage plan does::

    generate      take B_t (generated during step t-1 by policy version t-2; at step 1 generated now
                  by version 0), then submit the prompts of step t+1 to the rollout group (no wait)
    reward ... update_actor      on B_t, while the rollout group samples B_{t+1} with version t-1
    rollout_sync  the actor publishes version t in buckets through Ray's object store; the rollout
                  group loads them once B_{t+1} is done (a Ray actor runs one call at a time)

so every batch after the first is trained one update after the policy that generated
it (staleness 1, by construction: one batch in flight). Each row
carries ``policy_version`` (the updates its generating weights had), and the step logs
``async/staleness_mean`` / ``async/staleness_max`` (the trainer's version before the
update minus the rows' versions), ``async/weight_sync_seconds`` (publish on the actor's
rank 0 plus the slowest rollout rank's load) and ``async/weight_sync_bytes``.

The batch in flight at the end of a step is part of every checkpoint (``rollout/in_flight.pt``,
written by :class:`AsyncRollout.save_checkpoint`): a resumed run trains exactly the batch the
uninterrupted run would have, and its rollout receives the restored actor's weights before
generating anything, as the uninterrupted run's had after the same step.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from verity.batch import Batch, materialize, register_key
from verity.controller.balanced_call import BalancedGroupCall
from verity.trainer.role_handles import ActorHandle
from verity.trainer.stages import Stage, StepContext, replica_rows_metrics, training_rows
from verity.workers.registry import RoleDef, register_role
from verity.workers.rollout_worker import RolloutWorker

__all__ = ["AsyncRollout", "generate_ahead", "plan_async", "rollout_sync"]

logger = logging.getLogger(__name__)

IN_FLIGHT_FILE = "in_flight.pt"

register_key(
    "policy_version",
    ("B",),
    "int",
    "trainer.mode=async: optimizer updates the weights that generated the row had had",
)


class AsyncRollout:
    """What the driver holds for the ``rollout`` role: the worker group, the batch in flight, the weights' version.

    Attributes:
        group: the rollout :class:`~verity.controller.WorkerGroup`.
        version: the policy version the rollout group holds (``None`` until this process first syncs it).
    """

    def __init__(self, cfg: Any, group: Any) -> None:
        self.cfg = cfg
        self.group = group
        self.version: int | None = None
        self._pending: tuple[int, int, Any] | None = None  # (step, policy version, GroupCall or Batch)

    def init_model(self) -> list[dict[str, Any]]:
        """Build every rank's rollout engine; their facts."""
        return self.group.init_model()

    @property
    def pending_step(self) -> int | None:
        """The step whose batch is in flight (or done and not yet taken), or ``None``."""
        return None if self._pending is None else self._pending[0]

    def submit(self, step: int, rows: Batch) -> None:
        """Start generating ``rows`` (step ``step``'s batch) with the weights held now; returns at once."""
        if self._pending is not None:
            raise RuntimeError(
                f"step {self._pending[0]}'s batch is still in flight; cannot start step {step}'s"
            )
        if self.version is None:
            raise RuntimeError("the rollout group's weights were never synced from the actor")
        self._pending = (step, self.version, self.group.generate.submit(rows))

    def _resolve(self) -> tuple[int, int, Batch]:
        assert self._pending is not None
        step, version, call = self._pending
        batch = call if isinstance(call, Batch) else call.result()
        self._pending = (step, version, batch)
        return step, version, batch

    def take(self, step: int) -> Batch:
        """Wait for step ``step``'s batch and return it with ``policy_version [B]``."""
        if self._pending is None or self._pending[0] != step:
            raise RuntimeError(f"no batch in flight for step {step} (in flight: step {self.pending_step})")
        _, version, batch = self._resolve()
        self._pending = None
        batch["policy_version"] = torch.full((len(batch),), version, dtype=torch.long)
        return batch

    def sync_from(self, actor: ActorHandle, version: int) -> dict[str, float]:
        """Publish the actor's weights (policy ``version``) and load them into every rollout rank.

        Waits for the load, hence for a generation in flight before it. Returns the
        ``async/weight_sync_*`` metrics.
        """
        published = actor.publish_weights()
        if self._pending is not None and isinstance(self._pending[2], BalancedGroupCall):
            # a load-balanced generation hands out chunks until its last: none may run with the new
            # weights (an equal split's calls are queued on each worker ahead of the load already)
            self._resolve()
        answers = self.group.load_weights(published["refs"], version)
        self.version = int(version)
        loaded = [float(a["bytes"]) for a in answers]
        if any(b != published["bytes"] for b in loaded):
            raise RuntimeError(
                f"weight sync incomplete: published {published['bytes']:.0f} bytes, rollout ranks loaded {loaded}"
            )
        out = {
            "async/weight_sync_seconds": float(published["seconds"])
            + max(float(a["seconds"]) for a in answers),
            "async/weight_sync_bytes": float(published["bytes"]),
            "async/rollout_version": float(version),
        }
        held = [a["weight_bytes"] for a in answers if a.get("weight_bytes") is not None]
        if held:  # the rollout rank holding the most (a tensor-parallel replica's ranks hold a slice each)
            out["async/rollout_weight_bytes"] = float(max(held))
        return out

    # ---------------------------------------------------------------- checkpoint
    def save_checkpoint(self, path: str) -> list[dict[str, Any]]:
        """Write the batch in flight (waiting for it) to ``path/in_flight.pt``; one answer (the driver's)."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        if self._pending is None:
            return [{"in_flight_step": None}]
        step, version, batch = self._resolve()
        # resident rows live in this Ray session's object store: the file gets whole rows (fetched
        # through the driver, once per checkpoint), so a resumed run, in a new session, can train them
        whole = materialize(batch)
        torch.save({"step": step, "version": version, "batch": whole}, folder / IN_FLIGHT_FILE)
        return [{"in_flight_step": step}]

    def load_checkpoint(self, path: str) -> list[dict[str, Any]]:
        """Restore the batch in flight from ``path`` (the weights come from the actor at the next step)."""
        file = Path(path) / IN_FLIGHT_FILE
        self._pending = None
        self.version = None
        if not file.is_file():
            logger.warning(
                "%s holds no batch in flight (the run had finished there): the next step's batch is "
                "generated now by the restored policy, so that one step trains on-policy "
                "(async/staleness_mean 0), where a run that never stopped would train a one-step-stale "
                "batch; from the step after, it is one step stale again",
                path,
            )
            return [{"in_flight_step": None}]
        saved = torch.load(file, weights_only=False)
        self._pending = (int(saved["step"]), int(saved["version"]), saved["batch"])
        return [{"in_flight_step": int(saved["step"])}]


def generate_ahead(ctx: StepContext, prompts: Batch) -> Batch:
    """Take this step's batch from the rollout group and start the next step's (see the module docstring).

    ``prompts`` are the prompts the loop drew for this step; with a batch already in flight
    for this step (every step but a fresh run's first) they become the next step's.
    """
    rollout: AsyncRollout = ctx.role("rollout")
    started = time.perf_counter()
    if rollout.version is None:  # first step of this process: the rollout gets the actor's weights
        ctx.metrics.update(rollout.sync_from(ctx.actor, ctx.step - 1))
    last = ctx.step >= ctx.cfg.trainer.total_steps
    upcoming: Batch | None = prompts
    if rollout.pending_step != ctx.step:
        if rollout.pending_step is not None:
            raise RuntimeError(f"step {ctx.step}: the batch in flight is step {rollout.pending_step}'s")
        rollout.submit(ctx.step, training_rows(ctx.cfg, prompts, ctx.step))
        upcoming = None if last else ctx.loader.next_batch()
    batch = rollout.take(ctx.step)
    ctx.metrics.update(replica_rows_metrics(batch))
    if not last and upcoming is not None:
        rollout.submit(ctx.step + 1, training_rows(ctx.cfg, upcoming, ctx.step + 1))
    staleness = (ctx.step - 1) - batch["policy_version"].float()
    ctx.metrics["async/staleness_mean"] = float(staleness.mean())
    ctx.metrics["async/staleness_max"] = float(staleness.max())
    ctx.metrics["async/generate_wait_s"] = time.perf_counter() - started
    return batch


def rollout_sync(ctx: StepContext, batch: Batch) -> Batch:
    """Send the updated actor's weights (version ``step``) to the rollout group."""
    ctx.metrics.update(ctx.role("rollout").sync_from(ctx.actor, ctx.step))
    return batch


def plan_async(cfg: Any, plan: Any) -> None:
    """Stage planner: in ``trainer.mode=async`` generate ahead and sync weights after the update."""
    if cfg.trainer.mode != "async":
        return
    plan.replace("generate", Stage("generate", generate_ahead))
    plan.hold(
        "generate",
        "trainer.mode=async generates the next batch ahead in the rollout worker group; "
        "a planner that replaces generation (e.g. DAPO's dynamic sampling) does not combine "
        "with it yet: use trainer.mode=sync, or switch that planner off",
    )
    plan.insert_after("update_actor", Stage("rollout_sync", rollout_sync))


register_role(
    RoleDef(
        "rollout",
        RolloutWorker,
        enabled=lambda cfg: cfg.trainer.mode == "async",
        placement=lambda cfg: ("separate", cfg.rollout.n_workers),
        section="rollout",  # rollout.nnodes
        handle=AsyncRollout,
        trained=True,  # checkpointed: the batch in flight
        order=5,
    )
)
