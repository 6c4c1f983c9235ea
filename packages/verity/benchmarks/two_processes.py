"""Run a benchmark body in two spawned processes and keep the slower one's figure.

The CPU benchmarks that compare data-parallel layouts (``bench_sharding.py``,
``bench_micro_batch_tokens.py``) time a train step in two processes, as verity's two
workers run, sharing a file store for an optional gloo group.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def slower_rank_seconds(target: Callable[..., None], *args: Any) -> float:
    """Spawn ``target(rank, store_file, *args, answers)`` for ranks 0 and 1; the larger answer.

    ``target`` must be importable (a module-level function) and put ``(rank, seconds)``
    on ``answers``. ``store_file`` is a fresh path for ``init_method=f"file://{store_file}"``.
    Raises ``RuntimeError`` naming the exit code when a process fails.
    """
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        procs = [ctx.Process(target=target, args=(r, store, *args, answers)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(
                    f"{getattr(target, '__name__', target)}{args}: a rank exited with code {p.exitcode}"
                )
    return max(answers.get()[1] for _ in range(2))
