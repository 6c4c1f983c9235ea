"""Keeping an inference engine from changing, or outliving, the process that owns it.

Two jobs, both for engines that are libraries with process-wide side effects
(vLLM, SGLang):

- :func:`preserved_process_state` — a context manager around an engine's start-up
  that puts back what the engine changed for the whole process: the global RNGs
  (Python, NumPy, torch CPU and accelerator), ``torch.set_num_threads`` (vLLM's CPU
  worker replaces it with a no-op), the intra-op thread count, the CPU affinity, and
  environment variables it was asked to set only for the start-up.
- :class:`OrphanReaper` — a small watchdog process for engines that start child
  processes (vLLM's multi-process mode, SGLang): it remembers the children and the
  shared-memory segments that appeared during start-up and, if the owner dies
  without shutting the engine down (SIGKILL, OOM), kills those children and
  removes the segments nobody maps any more. It runs in its own session, so the
  signal that kills the owner's process group does not kill it.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")


@contextlib.contextmanager
def preserved_process_state(env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Run the block with ``env`` set, then restore RNGs, torch threads, affinity and environment.

    ``env``: variables set for the block only (their old values, or absence, come back).
    """
    py_state = random.getstate()
    np_state = np.random.get_state()
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    saved_env = {key: os.environ.get(key) for key in (env or {})}
    os.environ.update(env or {})
    try:
        with torch.random.fork_rng(devices=_accelerator_devices()):
            yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        random.setstate(py_state)
        np.random.set_state(np_state)


def _accelerator_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


def shm_segments() -> set[str]:
    """Names of the shared-memory segments in ``/dev/shm`` now (empty where there is none)."""
    try:
        return {entry.name for entry in SHM_DIR.iterdir()}
    except OSError:
        return set()


def child_processes() -> list[tuple[int, float]]:
    """``(pid, create_time)`` of every descendant of this process."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            out.append((child.pid, child.create_time()))
    return out


class OrphanReaper:
    """Watches the owner; when it is gone, kills the engine's children and unlinks its segments.

    ``children``: ``(pid, create_time)`` pairs (the create time guards against a
    reused pid); ``segments``: names under ``/dev/shm``. :meth:`stop` ends the
    watchdog once the engine was shut down properly.
    """

    def __init__(self, children: list[tuple[int, float]], segments: set[str], poll_s: float = 0.5) -> None:
        import psutil

        owner = f"{os.getpid()}:{psutil.Process().create_time()!r}"
        # run the file itself, not `-m verity.rollout...`: importing the package would load
        # torch and transformers, many seconds before the watch starts
        script = str(Path(__file__).with_name("orphan_reaper.py"))
        args = [sys.executable, script, "--owner", owner]
        args += ["--poll", str(poll_s)]
        for pid, created in children:
            args += ["--child", f"{pid}:{created!r}"]
        for name in sorted(segments):
            args += ["--segment", name]
        self.process = subprocess.Popen(
            args, start_new_session=True, stdin=subprocess.DEVNULL, close_fds=True
        )

    def stop(self) -> None:
        """End the watchdog (the engine was shut down by its owner)."""
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
