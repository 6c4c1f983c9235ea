"""The watchdog process of :class:`verity.rollout.process_guard.OrphanReaper`.

    python .../verity/rollout/orphan_reaper.py --owner PID:CREATE_TIME [--child PID:CREATE_TIME ...] [--segment NAME ...]

Polls the owner every ``--poll`` seconds. Once the owner no longer exists, it
sends SIGKILL to each child that still exists with the same create time (so a
reused pid is left alone), waits for them to go, then unlinks each named
``/dev/shm`` segment that no living process maps. SIGTERM ends it without
touching anything (the owner shut its engine down itself). It imports only the
standard library and psutil, so it runs as a plain script and starts in well under a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def _alive(pid: int, created: float | None = None) -> bool:
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return created is None or abs(process.create_time() - created) < 1e-3
    except psutil.Error:
        return False


def mapped_segments(pids: list[int] | None = None) -> set[str]:
    """Names of the /dev/shm files that the processes ``pids`` (default: every readable one) map now.

    Mappings of files already unlinked (``(deleted)``) are left out: nothing is left to remove.
    """
    names: set[str] = set()
    paths = (
        [Path(f"/proc/{pid}/maps") for pid in pids] if pids is not None else Path("/proc").glob("[0-9]*/maps")
    )
    for maps in paths:
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            parts = line.split(None, 5)
            path = parts[5] if len(parts) == 6 else ""
            if path.startswith("/dev/shm/") and not path.endswith(" (deleted)"):
                names.add(path[len("/dev/shm/") :])
    return names


def reap(children: list[tuple[int, float]], segments: list[str]) -> tuple[int, int]:
    """Kill the surviving children, then unlink the segments nobody maps any more; returns (killed, unlinked).

    The segments are the given ones plus every one the surviving children map
    right before they are killed.
    """
    survivors = [pid for pid, created in children if _alive(pid, created)]
    segments = sorted(set(segments) | mapped_segments(survivors))
    killed = 0
    for pid, created in children:
        if _alive(pid, created):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    deadline = time.monotonic() + 10
    while any(_alive(pid, created) for pid, created in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    mapped = mapped_segments()
    unlinked = 0
    for name in segments:
        if name in mapped or "/" in name:
            continue
        try:
            (SHM_DIR / name).unlink()
            unlinked += 1
        except OSError:
            pass
    return killed, unlinked


def _pid_and_time(item: str) -> tuple[int, float]:
    pid, _, created = item.partition(":")
    return int(pid), float(created)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--owner", required=True, help="PID:CREATE_TIME of the owning process")
    parser.add_argument("--child", action="append", default=[])
    parser.add_argument("--segment", action="append", default=[])
    parser.add_argument("--poll", type=float, default=0.5)
    args = parser.parse_args(argv)
    owner_pid, owner_created = _pid_and_time(args.owner)
    children = [_pid_and_time(item) for item in args.child]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while _alive(owner_pid, owner_created):
        time.sleep(args.poll)
    reap(children, args.segment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
