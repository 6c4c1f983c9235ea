"""Wire checkpoints, resume, SIGTERM handling and stage time limits into one run.

:func:`~verity.launch.run.run_training` calls, in order:

1. :func:`plan_resume` before anything starts (checks ``trainer.resume``, reads the
   checkpoint's driver state: the run id to continue, the config it ran with);
2. :func:`open_tracker` to continue the checkpoint's MLflow run (or start one);
3. :func:`prepare_recovery` once the worker groups are up and before the trainer is built:
   loads the checkpoint into the groups and the driver (sampler position, KL coefficient,
   RNG states, metrics so far), builds the step-end hooks
   (:class:`~verity.tracking.metrics_file.MetricsFile`, then
   :class:`~verity.checkpoint.hooks.CheckpointHook`) and the
   :class:`~verity.trainer.stage_guard.StageGuard` that the trainer's hooks carry, and
   writes ``workers.json`` (pid and node of every worker rank, for ``py-spy dump`` or
   ``kill`` by hand).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verity.checkpoint.hooks import CheckpointHook
from verity.checkpoint.manager import CheckpointManager
from verity.checkpoint.replay import ReplayAwareTracker, logged_points
from verity.checkpoint.resume import (
    checkpoint_root,
    require_same_config,
    resolve_resume,
    warn_on_config_change,
)
from verity.checkpoint.signals import GracefulStop
from verity.checkpoint.state import TrainerState, restore_rng
from verity.config.schema import VerityConfig
from verity.tracking.metrics_file import MetricsFile
from verity.trainer.loop import RunStart, TrainResult
from verity.trainer.role_handles import CheckpointedRole, StepEndHook, worker_group_of
from verity.trainer.stage_guard import StageGuard

logger = logging.getLogger("verity.trainer")

WORKERS_FILE = "workers.json"


@dataclass
class ResumePlan:
    """Where a run starts: ``checkpoint`` (None: fresh) and its driver ``state``."""

    checkpoint: Path | None
    state: TrainerState | None


def plan_resume(cfg: VerityConfig, cfg_dict: dict[str, Any] | None = None) -> ResumePlan:
    """Resolve ``trainer.resume`` and read the chosen checkpoint's driver state (no workers needed).

    With ``trainer.resume=auto`` the checkpoint must have been saved with the same config
    as ``cfg_dict`` (:func:`~verity.checkpoint.resume.require_same_config`).
    """
    path = resolve_resume(cfg)
    if path is None:
        return ResumePlan(None, None)
    state = TrainerState.read(path)
    if cfg.trainer.resume == "auto" and cfg_dict is not None:
        require_same_config(state.config, cfg_dict, path)
    logger.info("resuming from %s (step %d of %d)", path, state.step, cfg.trainer.total_steps)
    return ResumePlan(path, state)


METRICS_BUFFER_SECONDS = 2.0
"""A training run's tracker writes metrics to MLflow at most this often (and at every checkpoint)."""


def open_tracker(cfg: VerityConfig, out_dir: Path, plan: ResumePlan, **kwargs: Any) -> Any:
    """A :class:`verity.tracking.Tracker` continuing the checkpoint's run when its store holds it.

    Metrics are buffered for up to :data:`METRICS_BUFFER_SECONDS` (``Tracker(buffer_seconds=...)``).
    ``kwargs`` go to the Tracker (experiment, tracking_uri, run_name, tags). A resumed
    run whose tracking store does not hold the saved run id (another store) starts a
    new MLflow run, with a warning.
    """
    from verity.tracking import Tracker

    kwargs.setdefault("buffer_seconds", METRICS_BUFFER_SECONDS)
    run_id = plan.state.run_id if plan.state is not None else None
    if run_id:
        try:
            return Tracker(out_dir, run_id=run_id, **kwargs)
        except ValueError as err:
            logger.warning("cannot continue MLflow run %s (%s); starting a new run", run_id, err)
    return Tracker(out_dir, **kwargs)


def write_workers_file(out_dir: Path, groups: dict[str, Any]) -> Path:
    """``workers.json``: per group, each rank's pid, node IP, node id and CPU niceness."""
    data: dict[str, Any] = {}
    seen: set[int] = set()
    for handle in groups.values():
        group = worker_group_of(handle)
        if id(group) in seen:
            continue
        seen.add(id(group))
        data[group.name] = [
            {
                "rank": rank,
                "pid": info["pid"],
                "ip": info["ip"],
                "node_id": info["node_id"],
                "niceness": info["niceness"],
                "roles": info["roles"],
            }
            for rank, info in enumerate(group.worker_info())
        ]
    path = out_dir / WORKERS_FILE
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


@dataclass
class RunRecovery:
    """What :func:`prepare_recovery` gives the run: where the loop starts and the hooks it built.

    Attributes:
        start: the steps the checkpoint holds and their metrics (0 and empty when fresh).
        tracker: the run's tracker; a resumed run's skips the points its MLflow run already holds.
        step_end: the step-end hooks, in order: ``metrics.jsonl``, then the checkpoint hook.
        stage_guard: the time limit on every stage.
    """

    start: RunStart
    tracker: Any | None
    step_end: tuple[StepEndHook, ...]
    stage_guard: StageGuard


def prepare_recovery(
    cfg: VerityConfig,
    *,
    plan: ResumePlan,
    groups: dict[str, CheckpointedRole],
    workers: dict[str, Any] | None = None,
    loader: Any,
    kl_controller: Any | None,
    tracker: Any | None,
    stop: GracefulStop,
    out_dir: Path,
    cfg_dict: dict[str, Any],
    cfg_hash: str,
    model_path: str,
    tokenizer_path: str,
) -> RunRecovery:
    """Restore ``plan``'s checkpoint into the groups, ``loader`` and ``kl_controller``; build the hooks.

    ``groups``: trained role name -> handle offering ``save_checkpoint`` / ``load_checkpoint``
    (``{"actor": actor}`` or with ``"critic"``). ``workers``: every role's handle (default:
    ``groups``), for ``workers.json`` and the stage guard. ``loader``: the training prompt
    loader (its sampler position is restored). Call it before building the trainer, with
    the objects the trainer will hold.
    """
    workers = dict(workers or groups)
    write_workers_file(out_dir, workers)
    manager = CheckpointManager(
        checkpoint_root(cfg), cfg.trainer.checkpoint.keep, groups, model_path, tokenizer_path
    )
    start_step, result, wall_before = 0, TrainResult(), 0.0
    if plan.checkpoint is not None and plan.state is not None:
        state = manager.restore(plan.checkpoint)
        warn_on_config_change(state.config, cfg_dict, plan.checkpoint)
        loader.load_state_dict(state.dataloader)
        if kl_controller is not None and state.kl_coef is not None:
            kl_controller.value = float(state.kl_coef)
        restore_rng(state.rng)
        start_step = state.step
        result = TrainResult(
            history=[dict(r) for r in state.history],
            validation=[dict(r) for r in state.validation],
            wall_seconds=state.wall_seconds,
        )
        wall_before = state.wall_seconds
        if tracker is not None and tracker.run_id == state.run_id:
            tracker = ReplayAwareTracker(tracker, logged_points(tracker.tracking_uri, state.run_id))
    metrics_file = MetricsFile(out_dir)
    metrics_file.start(result.history)
    hook = CheckpointHook(
        cfg,
        manager=manager,
        loader=loader,
        kl_controller=kl_controller,
        tracker=tracker,
        stop=stop,
        cfg_dict=cfg_dict,
        cfg_hash=cfg_hash,
        model_path=model_path,
        wall_seconds_before=wall_before,
    )
    unique = {id(worker_group_of(h)): worker_group_of(h) for h in workers.values()}
    guard = StageGuard(cfg.trainer.stage_timeout_s, {g.name: g for g in unique.values()})
    return RunRecovery(RunStart(start_step, result), tracker, (metrics_file, hook), guard)
