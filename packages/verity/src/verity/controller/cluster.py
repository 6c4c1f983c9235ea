"""Starting or joining Ray.

Without an address, :func:`init_ray` starts a private single-node cluster
(``address="local"``, its own temporary directory, no dashboard), so a run or a test
never joins someone else's cluster by accident. With an address (``"auto"``,
``"ray://host:10001"``, ``"10.0.0.1:6379"``) it joins that cluster (its workers' settings
are that cluster's).

A private cluster's workers run at the driver's CPU priority (:data:`LOCAL_WORKER_NICENESS`).
Ray's default starts them 15 nice levels lower, so on a machine shared with anything busy
they waited for every other process and a step took longer (``ci/reports/2026-12-06-docstring-figures.md``).

Nothing of a private cluster outlives its driver: every process of the cluster
carries ``VERITY_RAY_CLUSTER=<its temp dir>`` in its environment (and ``SPT_NOENV=1``,
so that Ray's renaming of its agents and workers leaves that environment readable, see
:func:`cluster_environment`), and a small reaper process (:mod:`verity.controller.reaper`)
waits on a pipe from the driver; when the driver shuts Ray down or dies (even by
``kill -9``) the reaper kills whatever of the cluster is left and removes its temporary
folder.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["init_ray", "shutdown_ray"]

# Unix socket paths under Ray's temp dir must stay below ~107 bytes.
_MAX_TEMP_DIR_LEN = 40

logger = logging.getLogger("verity.controller")


_created_temp_dirs: list[str] = []
_reapers: list[subprocess.Popen] = []
CLUSTER_MARKER = "VERITY_RAY_CLUSTER"


def _private_temp_dir() -> str:
    """A new short temp dir, removed when Ray is shut down via :func:`shutdown_ray` or at exit."""
    base = tempfile.gettempdir()
    if len(base) > _MAX_TEMP_DIR_LEN - 16 and os.path.isdir("/tmp"):
        base = "/tmp"
    path = tempfile.mkdtemp(prefix="verity-ray-", dir=base)
    if not _created_temp_dirs:
        # Registered before ray.init registers its own exit hook, so it runs after Ray stops.
        atexit.register(_remove_created_temp_dirs)
    _created_temp_dirs.append(path)
    return path


def _remove_created_temp_dirs() -> None:
    while _created_temp_dirs:
        shutil.rmtree(_created_temp_dirs.pop(), ignore_errors=True)


def _start_reaper(temp_dir: str, remove_dir: bool) -> subprocess.Popen:
    """Start the reaper of the private cluster living in ``temp_dir`` (see the module docstring)."""
    script = str(Path(__file__).with_name("reaper.py"))
    command = [sys.executable, "-I", "-S", script, temp_dir] + ([] if remove_dir else ["--keep-dir"])
    reaper = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the driver's process group: survives a group-wide kill
        close_fds=True,
    )
    _reapers.append(reaper)
    return reaper


def _stop_reapers() -> None:
    """Close the reapers' pipes: each kills what is left of its cluster and exits."""
    while _reapers:
        reaper = _reapers.pop()
        with contextlib.suppress(OSError):
            reaper.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            reaper.wait(timeout=10)


def cluster_environment(temp_dir: str) -> dict[str, str]:
    """The variables a cluster's processes are started with so that the reaper finds them all.

    ``VERITY_RAY_CLUSTER=temp_dir`` is the reaper's marker, read from ``/proc/PID/environ``.
    ``SPT_NOENV=1`` keeps that file intact: Ray renames its processes (``ray::DashboardAgent``,
    ``ray::RuntimeEnvAgent``, ``ray::<actor>``) with the ``setproctitle`` code it carries, which
    otherwise also writes over the start of the memory the environment was started in: in
    some runs that held the agents' marker, and the reaper missed them (Ray sets the
    variable for its workers, not for its agents).
    """
    return {CLUSTER_MARKER: temp_dir, "SPT_NOENV": "1"}


@contextlib.contextmanager
def _marked_environment(temp_dir: str) -> Iterator[None]:
    """:func:`cluster_environment` while the cluster's processes start (they inherit it)."""
    variables = cluster_environment(temp_dir)
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def init_ray(
    address: str | None = None,
    num_cpus: float | None = None,
    temp_dir: str | None = None,
    **kwargs: Any,
) -> str:
    """Start a private local Ray cluster, or join ``address``; return the cluster address.

    Idempotent: if Ray is already running in this process, returns its address.
    ``num_cpus`` and ``temp_dir`` (default: a new private directory) apply only to a
    local cluster; other keyword arguments go to ``ray.init``.
    """
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None or address == "local":
        if temp_dir is not None and len(temp_dir) > _MAX_TEMP_DIR_LEN:
            raise ValueError(
                f"init_ray: temp_dir {temp_dir!r} is {len(temp_dir)} characters; Ray's socket paths under it "
                f"must stay short, use at most {_MAX_TEMP_DIR_LEN}"
            )
        kwargs.setdefault("include_dashboard", False)
        system_config = dict(kwargs.get("_system_config") or {})
        system_config.setdefault("worker_niceness", LOCAL_WORKER_NICENESS)
        kwargs["_system_config"] = system_config
        # Ray enables token authentication for a new local cluster and warns that it did, on every
        # start; the choice is right for a private cluster, so the warning is only noise here
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        own_dir = temp_dir is None
        temp_dir = temp_dir or _private_temp_dir()
        _start_reaper(temp_dir, remove_dir=own_dir)
        try:
            with _marked_environment(temp_dir):
                _start_local(num_cpus, temp_dir, kwargs)
        except BaseException:
            _stop_reapers()
            raise
    else:
        if num_cpus is not None or temp_dir is not None:
            raise ValueError(
                "init_ray: num_cpus and temp_dir apply only when starting a local cluster, "
                f"not when joining {address!r}"
            )
        ray.init(address=address, **kwargs)
    return ray.get_runtime_context().gcs_address


#: nice levels a private cluster's workers add to the driver's (Ray's default is 15)
LOCAL_WORKER_NICENESS = 0

#: how often a local start is tried when the raylet does not register in time
LOCAL_START_ATTEMPTS = 3


def _start_local(num_cpus: float | None, temp_dir: str | None, kwargs: dict[str, Any]) -> None:
    """``ray.init`` of a private local cluster, tried again when a loaded machine is too slow.

    Ray gives a new raylet a fixed 30 s to register with the GCS; on a machine whose
    cores are all busy that can fail although nothing is wrong. Such a start is shut
    down and tried again (up to :data:`LOCAL_START_ATTEMPTS` times); any other error
    is raised at once.
    """
    import ray

    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            ray.init(address="local", num_cpus=num_cpus, _temp_dir=temp_dir or _private_temp_dir(), **kwargs)
            return
        except Exception as err:
            if "timed out during startup" not in str(err) or attempt == LOCAL_START_ATTEMPTS:
                raise
            logger.warning("Ray's local node did not register in time (busy machine?); starting it again")
            ray.shutdown()


def shutdown_ray() -> None:
    """Stop Ray in this process (and the local cluster if this process started it).

    Removes the private temp dir that :func:`init_ray` created, logs included.
    """
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _stop_reapers()
    _remove_created_temp_dirs()
