"""Run a test's worker on several local processes (gloo over TCP) and collect what each rank saved."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for the process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_and_load(worker, world: int, out_dir: str) -> list[dict]:
    """``mp.spawn`` ``worker(rank, port, out_dir)`` on ``world`` processes; then load ``out_dir/rank{r}.pt`` of each rank.

    ``worker`` must be a module-level function (spawned children import it by name).
    """
    mp.spawn(worker, args=(free_port(), out_dir), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
