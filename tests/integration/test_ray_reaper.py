"""Nothing of a private Ray cluster outlives its driver, even after `kill -9` of the driver.

The run's processes are found as the driver's process tree, not by the reaper's own marker:
Ray's agents once lost that marker (their renaming wrote over ``/proc/PID/environ``) and
lived on for a minute without a test noticing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from verity.controller.reaper import cluster_processes

#: seconds after the driver's `kill -9` by which every process it started must be gone
GONE_WITHIN_S = 30

DRIVER = """
import os, subprocess, sys, time
import ray
from verity.controller import init_ray

init_ray(num_cpus=1)

@ray.remote
class Echo:
    def pid(self):
        return os.getpid()

    def start_child(self):
        # a child with an environment of its own (no marker), in a session of its own
        self.child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", "import time; time.sleep(600)"],
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
        )
        return self.child.pid

actor = Echo.remote()
ray.get(actor.pid.remote())
child = ray.get(actor.start_child.remote())
from verity.controller.cluster import _created_temp_dirs

print("TEMP", child, _created_temp_dirs[-1], flush=True)
time.sleep(600)
"""


def _table() -> dict[int, tuple[int, int, str]]:
    """``{pid: (ppid, start time, state)}`` of the processes on this machine."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table[int(entry)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def _tree(root: int) -> dict[int, int]:
    """``{pid: start time}`` of the live descendants of ``root``."""
    table = _table()
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, start, state) in table.items():
            if ppid == parent and pid not in found and state != "Z":
                found[pid] = start
                todo.append(pid)
    return found


def _alive(known: dict[int, int]) -> dict[int, int]:
    """Those of ``known`` still running (same pid and start time, not a zombie)."""
    table = _table()
    alive = {}
    for pid, start in known.items():
        if pid in table and table[pid][1] == start and table[pid][2] != "Z":
            alive[pid] = start
    return alive


def _environ_overwritten(pid: int) -> bool:
    """Whether the memory ``pid``'s environment started in has been written over (runs of NULs)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return b"\0\0" in b"\0" + environ.rstrip(b"\0")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _title(pid: int) -> str:
    """``ray::DashboardAgent``, or a command's first 80 characters."""
    return _cmdline(pid).strip()[:80]


def test_driver_killed_with_sigkill_leaves_no_ray_process_and_no_temp_dir():
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    started: dict[int, int] = {}
    temp_dir = None
    try:
        line = ""
        deadline = time.monotonic() + 240
        while not line.startswith("TEMP") and time.monotonic() < deadline:
            line = driver.stdout.readline()
            assert line or driver.poll() is None, "the driver exited before its cluster started"
        _, child, temp_dir = line.split(maxsplit=2)
        temp_dir = temp_dir.strip()
        # wait until Ray's agents have renamed themselves (what overwrote the marker)
        wanted = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}
        started = _tree(driver.pid)
        while not wanted <= {_title(pid) for pid in started} and time.monotonic() < deadline:
            time.sleep(0.2)
            started = _tree(driver.pid)
        started[int(child)] = _table()[int(child)][1]  # the worker's child in a session of its own
        titles = {pid: _title(pid) for pid in started}
        assert wanted <= set(titles.values()), titles
        # every Ray process of the run is one the reaper recognises (all but the reaper itself
        # and the worker's child, which have no marker), its environment intact
        ray_processes = {
            pid for pid in started if pid != int(child) and "controller/reaper.py" not in _cmdline(pid)
        }
        marked = set(cluster_processes(temp_dir))
        assert [titles[pid] for pid in ray_processes if _environ_overwritten(pid)] == []
        assert [titles[pid] for pid in ray_processes - marked] == []
        assert len(marked) >= 5, titles  # GCS, raylet, agents, the actor's worker...

        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        killed = time.monotonic()
        left = _alive(started)
        while (left or Path(temp_dir).exists()) and time.monotonic() - killed < GONE_WITHIN_S:
            time.sleep(0.1)
            left = _alive(started)
        elapsed = time.monotonic() - killed
        print(f"{len(started) - len(left)}/{len(started)} processes gone {elapsed:.1f} s after the kill -9")
        assert left == {}, [f"{pid}: {titles[pid]}" for pid in left]
        assert cluster_processes(temp_dir) == []
        assert not Path(temp_dir).exists()
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in _alive(started):  # after a failed check: leave nothing behind (the reaper included)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
