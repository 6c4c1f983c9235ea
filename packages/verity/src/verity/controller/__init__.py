"""verity.controller: the single controller's view of Ray.

* :func:`init_ray` starts a private local cluster (or joins a given one);
* :class:`ResourcePool` reserves slots (placement-group bundles) on one or more nodes;
* :class:`Worker` is the base class of every role; :func:`register` declares how a
  worker method is dispatched to the ranks and how answers are collected;
* :class:`WorkerGroup` runs one actor per slot and exposes each registered method as
  one group call; :func:`colocate` puts several roles in the same processes.
"""

from __future__ import annotations

from verity.controller.cluster import init_ray, shutdown_ray
from verity.controller.dispatch import Collect, Dispatch, DPLayout, MethodSpec, register, registered_methods
from verity.controller.errors import (
    ControllerError,
    DispatchError,
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerError,
    WorkerMethodError,
    WorkerTimeoutError,
)
from verity.controller.host import ColocatedRoles, RoleSpec, colocate, role
from verity.controller.resource_pool import ResourcePool
from verity.controller.worker import Worker
from verity.controller.worker_group import GroupCall, GroupMethod, RoleView, WorkerGroup

__all__ = [
    "Collect",
    "ColocatedRoles",
    "ControllerError",
    "DPLayout",
    "Dispatch",
    "DispatchError",
    "GroupCall",
    "GroupMethod",
    "MethodSpec",
    "ResourcePool",
    "ResourceUnavailableError",
    "RoleSpec",
    "RoleView",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerMethodError",
    "WorkerTimeoutError",
    "colocate",
    "init_ray",
    "register",
    "registered_methods",
    "role",
    "shutdown_ray",
]
