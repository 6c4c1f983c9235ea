"""What happens at the end of every RL step: checkpoint policy, SIGTERM/Ctrl-C stop.

:class:`CheckpointHook` is called by the training loop after a step's metrics are
logged (and its evaluation, when due, and after :class:`verity.tracking.metrics_file.MetricsFile`
appended the step to ``metrics.jsonl``), with the step number and the run's results so far. It

1. saves a checkpoint every ``trainer.checkpoint.every`` steps, after the last step
   (``trainer.checkpoint.save_final``) and at the step where a SIGTERM or SIGINT was noticed;
2. after a SIGTERM/SIGINT save, raises :class:`~verity.checkpoint.signals.TrainingStopped`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import verity
from verity.checkpoint.manager import CheckpointManager
from verity.checkpoint.signals import GracefulStop, TrainingStopped
from verity.checkpoint.state import TrainerState, capture_rng
from verity.config.schema import VerityConfig
from verity.testing.faults import maybe_crash


class CheckpointHook:
    """The loop's step-end callback ``hook(step, result)`` (see the module docstring).

    Args:
        cfg: the run config.
        manager: writes the checkpoints.
        loader: the training prompt loader (``state_dict()``).
        kl_controller: object with a ``value`` attribute, or None.
        tracker: the run's tracker (for its run id and tracking URI), or None.
        stop: the SIGTERM flag.
        cfg_dict / cfg_hash: the config as a plain dict and its hash.
        wall_seconds_before: training time spent before this process (when resumed).
    """

    def __init__(
        self,
        cfg: VerityConfig,
        *,
        manager: CheckpointManager,
        loader: Any,
        kl_controller: Any | None,
        tracker: Any | None,
        stop: GracefulStop,
        cfg_dict: dict[str, Any],
        cfg_hash: str,
        model_path: str = "",
        wall_seconds_before: float = 0.0,
    ) -> None:
        self.cfg = cfg
        self.manager = manager
        self.loader = loader
        self.kl_controller = kl_controller
        self.tracker = tracker
        self.stop = stop
        self.cfg_dict = cfg_dict
        self.cfg_hash = cfg_hash
        self.model_path = model_path
        self.wall_seconds_before = wall_seconds_before
        self._started = time.perf_counter()

    def trainer_state(self, step: int, result: Any) -> TrainerState:
        """The driver's state after ``step`` (histories copied, RNG captured now)."""
        return TrainerState(
            step=step,
            total_steps=self.cfg.trainer.total_steps,
            dataloader=self.loader.state_dict(),
            kl_coef=None if self.kl_controller is None else float(self.kl_controller.value),
            run_id=getattr(self.tracker, "run_id", None),
            tracking_uri=getattr(self.tracker, "tracking_uri", None),
            config_hash=self.cfg_hash,
            config=self.cfg_dict,
            history=[dict(row) for row in result.history],
            validation=[dict(row) for row in result.validation],
            wall_seconds=self.wall_seconds_before + (time.perf_counter() - self._started),
            rng=capture_rng(),
            model_path=self.model_path,
            working_dir=os.getcwd(),
            verity_version=verity.__version__,
        )

    def save(self, step: int, result: Any) -> Path:
        """Save checkpoint ``step_<step>`` now; logs ``timing/checkpoint_s`` to the tracker.

        The tracker's buffered metrics are written first, so that the MLflow run holds every
        step up to the checkpoint (a resume replays only the steps after it).
        """
        start = time.perf_counter()
        if self.tracker is not None and hasattr(self.tracker, "flush"):
            self.tracker.flush()
        path = self.manager.save(step, self.trainer_state(step, result))
        if self.tracker is not None:
            self.tracker.log_metrics({"timing/checkpoint_s": time.perf_counter() - start}, step=step)
            if hasattr(self.tracker, "flush"):
                self.tracker.flush()
        return path

    def __call__(self, step: int, result: Any) -> None:
        """Save when due (see the module docstring); stop after a signal's save; planted crash point."""
        t = self.cfg.trainer
        every = t.checkpoint.every
        last = step >= t.total_steps
        due = (every > 0 and step % every == 0) or (last and t.checkpoint.save_final) or self.stop.requested
        path = self.save(step, result) if due else None
        if self.stop.requested and not last:
            raise TrainingStopped(step, str(path), getattr(self.stop, "received", None) or signal.SIGTERM)
        maybe_crash("step_end", step)
