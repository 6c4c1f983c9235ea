"""Kill what a private Ray cluster leaves behind when its driver dies, and remove its folder.

Started by :func:`verity.controller.init_ray` for a private cluster, as
``python -I -S reaper.py TEMP_DIR [--keep-dir]`` in a session of its own, with a pipe from the
driver on stdin (standard library only; it imports nothing from verity). It blocks
reading that pipe; the read returns when the driver closes it or dies, however it
dies (``kill -9`` included). Then it kills every process whose environment carries
``VERITY_RAY_CLUSTER=TEMP_DIR`` — the cluster's GCS, raylet, dashboard and runtime-env
agents and workers all inherit it from the driver — and removes ``TEMP_DIR``.

The marker is read from ``/proc/PID/environ``: the memory a process's environment was
started in. Ray renames its agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) with
the ``setproctitle`` code it carries, which by default writes over the start of that memory
too; the raylet passes its environment to the agents in an order that changes from run to
run, so in some runs the marker was overwritten and the agents lived on about a minute.
The cluster is therefore started with
``SPT_NOENV=1`` as well, which confines the new title to the command line's memory
(:func:`verity.controller.cluster.cluster_environment`).

Why: Ray ties the GCS and the raylet to the driver's life (``PR_SET_PDEATHSIG``), but
its agents notice the raylet's death and then wait on the dead GCS for about a
minute before exiting, and the driver's own temporary folder is never removed.
"""

import contextlib
import os
import shutil
import signal
import sys
import time

MARKER = "VERITY_RAY_CLUSTER"


def cluster_processes(temp_dir, exclude=()):
    """Pids of live processes whose environment has ``VERITY_RAY_CLUSTER=temp_dir``."""
    needle = f"{MARKER}={temp_dir}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read() + b"\0"
            with open(f"/proc/{entry}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and (b"\0" + needle in b"\0" + environ):
            found.append(int(entry))
    return found


def reap(temp_dir, grace_s=2.0, exclude=(), remove_dir=True):
    """SIGTERM the cluster's processes, SIGKILL those left after ``grace_s``; remove ``temp_dir``.

    Returns the number of processes that were still alive.
    """
    me = {os.getpid(), *exclude}
    alive = cluster_processes(temp_dir, me)
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = alive
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = cluster_processes(temp_dir, me)
    for _ in range(20):
        left = cluster_processes(temp_dir, me)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    if remove_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return len(alive)


def main():
    temp_dir = sys.argv[1]
    keep_dir = "--keep-dir" in sys.argv[2:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the driver
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    reap(temp_dir, remove_dir=not keep_dir)


if __name__ == "__main__":
    main()
