"""Stop cleanly on SIGTERM: finish the current step, save a checkpoint, exit.

Schedulers (Slurm pre-emption, Kubernetes, ``timeout``) send SIGTERM and, after a
grace period, SIGKILL. The first SIGTERM only sets a flag; the training loop checks it
at the end of each RL step, saves a checkpoint and raises :class:`TrainingStopped`
(``verity train`` then exits with status 143 = 128 + SIGTERM). A second SIGTERM
while waiting restores the previous handling and re-delivers the signal: the process
dies at once, and the last complete checkpoint is still intact.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

logger = logging.getLogger("verity.checkpoint")

EXIT_CODE_STOPPED = 128 + signal.SIGTERM


class TrainingStopped(Exception):
    """The run stopped early on request (SIGTERM) after saving ``checkpoint`` at ``step``."""

    def __init__(self, step: int, checkpoint: str | None) -> None:
        super().__init__(
            f"stopped on SIGTERM after step {step}; checkpoint {checkpoint} "
            "(run again with trainer.resume=auto to continue)"
        )
        self.step = step
        self.checkpoint = checkpoint


class GracefulStop:
    """Catch SIGTERM while active (a context manager; only the main thread can install it).

    ``requested`` turns True at the first SIGTERM. Outside the main thread (e.g. a run
    started from a worker thread) it does nothing and ``requested`` stays False.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            logger.warning("second %s: stopping now", signal.Signals(signum).name)
            self.uninstall()
            os.kill(os.getpid(), signum)
            return
        self.requested = True
        logger.warning(
            "%s received: the run will save a checkpoint at the end of the current step and stop",
            signal.Signals(signum).name,
        )

    def install(self) -> GracefulStop:
        """Install the handler (remembering the previous one)."""
        if threading.current_thread() is threading.main_thread() and not self._installed:
            self._previous = signal.getsignal(self.signum)
            signal.signal(self.signum, self._handle)
            self._installed = True
        return self

    def uninstall(self) -> None:
        """Put the previous handler back."""
        if self._installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def __enter__(self) -> GracefulStop:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
