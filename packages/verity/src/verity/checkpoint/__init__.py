"""verity.checkpoint: exact, atomic checkpoints of a run; resume; export to Hugging Face format.

* :mod:`~verity.checkpoint.layout` — ``step_N`` folders, the ``latest`` pointer, atomic commit, pruning;
* :mod:`~verity.checkpoint.sharded` — each worker rank writes/reads its engine shards with
  ``torch.distributed.checkpoint`` (reshards to any number of workers);
* :mod:`~verity.checkpoint.state` — the driver's state (step, sampler position, KL coefficient,
  RNG states, tracking run id, metrics so far, config and its hash);
* :mod:`~verity.checkpoint.manager` — :class:`CheckpointManager` saves/restores whole checkpoints;
* :mod:`~verity.checkpoint.resume` — ``trainer.resume=auto|off|<path>``, decided before workers start;
* :mod:`~verity.checkpoint.hooks` — the step-end hook: save policy, SIGTERM;
* :mod:`~verity.checkpoint.export` — :func:`export_hf` (``verity export``).

Fault injection for recovery tests lives in :mod:`verity.testing.faults`.

See ``docs/checkpoints.md``.
"""

from __future__ import annotations

from verity.checkpoint.layout import find_latest, is_complete, list_checkpoints
from verity.checkpoint.signals import EXIT_CODE_STOPPED, GracefulStop, TrainingStopped
from verity.checkpoint.state import TrainerState

__all__ = [
    "EXIT_CODE_STOPPED",
    "GracefulStop",
    "TrainerState",
    "TrainingStopped",
    "find_latest",
    "is_complete",
    "list_checkpoints",
]
