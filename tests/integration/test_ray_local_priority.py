"""A private local cluster's workers run at the driver's CPU priority, not Ray's 15 nice levels lower."""

from __future__ import annotations

import subprocess
import sys

DRIVER = """
import os, sys
import ray
from verity.controller import init_ray

os.nice(int(sys.argv[1]))  # the driver itself runs a little lower than its shell
init_ray(num_cpus=1, **({"_system_config": {"worker_niceness": int(sys.argv[2])}} if len(sys.argv) > 2 else {}))

@ray.remote
class Priority:
    def niceness(self):
        return os.nice(0)

print("NICE", os.nice(0), ray.get(Priority.remote().niceness.remote()), flush=True)
"""


def _driver_and_worker_niceness(*args: str) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, timeout=240, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("NICE")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    _, driver, worker = lines[-1].split()
    return int(driver), int(worker)


def test_local_cluster_workers_run_at_the_drivers_priority():
    driver, worker = _driver_and_worker_niceness("2")
    assert driver >= 2
    assert worker == driver  # Ray's default would be driver + 15


def test_a_niceness_the_caller_gives_is_kept():
    driver, worker = _driver_and_worker_niceness("1", "4")
    assert worker == min(driver + 4, 19)
