"""Errors raised by the controller; each message names what was asked and what was found."""

from __future__ import annotations

__all__ = [
    "ControllerError",
    "DispatchError",
    "ResourceUnavailableError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerMethodError",
    "WorkerTimeoutError",
]


class ControllerError(RuntimeError):
    """Base class of the controller's errors."""


class DispatchError(ControllerError, TypeError):
    """A group method was called with arguments its dispatch mode cannot distribute."""


class ResourceUnavailableError(ControllerError):
    """The Ray cluster cannot provide the resources a ResourcePool asked for."""


class WorkerError(ControllerError):
    """A worker failed while running a group method.

    ``group``, ``role``, ``method`` and ``rank`` say where; ``cause`` is the underlying
    exception (the remote exception when it could be carried back, else Ray's error).
    """

    def __init__(
        self,
        message: str,
        *,
        group: str,
        role: str,
        method: str,
        rank: int,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.group = group
        self.role = role
        self.method = method
        self.rank = rank
        self.cause = cause


class WorkerMethodError(WorkerError):
    """The worker's method raised an exception."""


class WorkerDiedError(WorkerError):
    """The worker's process died (crash, kill, out of memory) before answering."""


class WorkerTimeoutError(WorkerError):
    """The worker did not answer within the call's timeout."""
