"""Stop cleanly on SIGTERM or Ctrl-C (SIGINT): finish the current step, save a checkpoint, exit.

Schedulers (Slurm pre-emption, Kubernetes, ``timeout``) send SIGTERM and, after a
grace period, SIGKILL; a person at a terminal presses Ctrl-C. The first such signal
only sets a flag; the training loop checks it at the end of each RL step, saves a
checkpoint and raises :class:`TrainingStopped` (``verity train`` then exits with
128 + the signal number: 143 for SIGTERM, 130 for SIGINT, and prints the command that
resumes the run). A second signal while waiting restores the previous handling and
re-delivers the signal: the process stops at once (a second Ctrl-C raises
``KeyboardInterrupt``, which ``verity train`` reports in one line, exit 130), and the
last complete checkpoint is still intact.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

logger = logging.getLogger("verity.checkpoint")

EXIT_CODE_STOPPED = 128 + signal.SIGTERM
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code_for(signum: int) -> int:
    """The shell convention for a process stopped by ``signum``: 128 + its number."""
    return 128 + int(signum)


def signal_label(signum: int) -> str:
    """``"SIGTERM"``, or ``"SIGINT (Ctrl-C)"``."""
    name = signal.Signals(signum).name
    return f"{name} (Ctrl-C)" if signum == signal.SIGINT else name


class TrainingStopped(Exception):
    """The run stopped early on request after saving ``checkpoint`` at ``step``.

    ``signum``: the signal that asked for it (SIGTERM or SIGINT); ``exit_code``: 128 + it.
    """

    def __init__(self, step: int, checkpoint: str | None, signum: int = signal.SIGTERM) -> None:
        super().__init__(
            f"stopped on {signal_label(signum)} after step {step}; checkpoint {checkpoint} "
            "(run again with trainer.resume=auto to continue)"
        )
        self.step = step
        self.checkpoint = checkpoint
        self.signum = int(signum)
        self.exit_code = exit_code_for(signum)


class GracefulStop:
    """Catch SIGTERM and SIGINT while active (a context manager; only the main thread can install it).

    ``requested`` turns True at the first signal and ``received`` holds its number.
    Outside the main thread (e.g. a run started from a worker thread) it does nothing
    and ``requested`` stays False.
    """

    def __init__(self, signums: int | Sequence[int] = STOP_SIGNALS) -> None:
        self.signums = (signums,) if isinstance(signums, int) else tuple(signums)
        self.requested = False
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            logger.warning("second %s: stopping now", signal_label(signum))
            self.uninstall()
            if signum == signal.SIGINT:
                # what Python's own Ctrl-C handler does, even when the process started with SIGINT
                # ignored (launched in the background by a shell), where re-sending it would do nothing
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        self.requested = True
        self.received = signum
        again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        logger.warning(
            "%s received: the run will save a checkpoint at the end of the current step and stop "
            "(%s again stops at once)",
            signal_label(signum),
            again,
        )

    def install(self) -> GracefulStop:
        """Install the handlers (remembering the previous ones)."""
        if threading.current_thread() is threading.main_thread() and not self._installed:
            for signum in self.signums:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handle)
            self._installed = True
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        if self._installed:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            self._installed = False

    def __enter__(self) -> GracefulStop:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
