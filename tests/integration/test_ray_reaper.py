"""Nothing of a private Ray cluster outlives its driver, even after `kill -9` of the driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from verity.controller.reaper import cluster_processes

DRIVER = """
import os, time
import ray
from verity.controller import init_ray

init_ray(num_cpus=1)

@ray.remote
class Echo:
    def pid(self):
        return os.getpid()

actor = Echo.remote()
ray.get(actor.pid.remote())
from verity.controller.cluster import _created_temp_dirs

print("TEMP", _created_temp_dirs[-1], flush=True)
time.sleep(600)
"""


def test_driver_killed_with_sigkill_leaves_no_ray_process_and_no_temp_dir():
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = ""
        deadline = time.monotonic() + 240
        while not line.startswith("TEMP") and time.monotonic() < deadline:
            line = driver.stdout.readline()
            assert line or driver.poll() is None, "the driver exited before its cluster started"
        temp_dir = line.split(maxsplit=1)[1].strip()
        started = cluster_processes(temp_dir)
        assert len(started) >= 3, started  # GCS, raylet, agents, the actor's worker...
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 60
        left = cluster_processes(temp_dir)
        while (left or Path(temp_dir).exists()) and time.monotonic() < deadline:
            time.sleep(0.2)
            left = cluster_processes(temp_dir)
        names = [
            Path(f"/proc/{pid}/cmdline").read_bytes()[:60] for pid in left if Path(f"/proc/{pid}").exists()
        ]
        assert left == [], names
        assert not Path(temp_dir).exists()
    finally:
        if driver.poll() is None:
            driver.kill()
