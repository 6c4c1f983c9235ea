"""Run a test's worker on several local processes (gloo over TCP) and collect what each rank saved."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for the process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_then_exit(rank: int, worker, port: int, out_dir: str) -> None:
    """``worker(rank, port, out_dir)``, then leave the process without the interpreter's teardown.

    A rank whose work is done and saved can still abort while the interpreter tears down
    ("terminate called without an active exception", SIGABRT: a native thread still running
    when its owner is destroyed at exit; seen about once in 50 spawns on a busy 2-core
    machine, after ``destroy_process_group`` had returned). ``os._exit(0)`` skips that
    teardown, so a finished rank always exits 0. A worker that raises does not get here:
    ``mp.spawn`` reports its exception as before.
    """
    worker(rank, port, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_and_load(worker, world: int, out_dir: str) -> list[dict]:
    """``mp.spawn`` ``worker(rank, port, out_dir)`` on ``world`` processes; then load ``out_dir/rank{r}.pt`` of each rank.

    ``worker`` must be a module-level function (spawned children import it by name).
    """
    mp.spawn(_run_then_exit, args=(worker, free_port(), out_dir), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
