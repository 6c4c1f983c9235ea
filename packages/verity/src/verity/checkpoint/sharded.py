"""The worker side of a checkpoint: each rank writes its own shards of a training engine.

Inside a worker group every rank calls :func:`save_engine` (a collective) with the
same folder; ``torch.distributed.checkpoint`` (DCP) writes one file per rank plus one
``.metadata`` file describing how the shards tile the full tensors. Loading
(:func:`load_engine`) reads whatever shards each rank of the *current* group needs, so
a checkpoint written by N workers loads into M workers (DCP reshards).

A role's folder::

    actor/
      dcp/           .metadata, __0_0.distcp, __1_0.distcp, ...   (model, optimizer, LR schedule, step)
      rng/rank_0.json                                             (each rank's RNG states)
      meta.json      {"world_size": 2, "engine": "FSDP2Engine"}   (written by rank 0; plus the engine's
                     ``checkpoint_meta()``, e.g. ``"adapter"``: a LoRA run's rank, targets, base model)

Engines provide ``state_dict_for_checkpoint()`` (model and optimizer state as sharded
``DTensor`` state dicts, the LR schedule, the optimizer step count) and
``load_checkpoint_state(state)``; :class:`verity.engines.FSDP2Engine` does.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verity.checkpoint.layout import write_file_atomic
from verity.checkpoint.state import capture_rng, restore_rng

DCP_DIR = "dcp"
RNG_DIR = "rng"
META_FILE = "meta.json"


@contextlib.contextmanager
def _single_process_quiet(distributed: bool) -> Iterator[None]:
    """Hide DCP's warning that it runs without a process group when that is intended."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _engine_meta(engine: Any) -> dict[str, Any]:
    meta = getattr(engine, "checkpoint_meta", None)
    return dict(meta()) if callable(meta) else {}


#: adapter settings that decide the saved tensors' names and shapes
_ADAPTER_KEYS = ("type", "rank", "target_modules", "exclude_modules")


def _check_same_adapter(folder: Path, saved: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    """``ValueError`` when the checkpoint's adapters (or their absence) differ from the engine's."""
    if saved is None and current is None:
        return
    if saved is None or current is None:
        have = "LoRA adapters" if saved is not None else "a full model"
        want = "LoRA adapters" if current is not None else "a full model"
        raise ValueError(
            f"{folder}: the checkpoint holds {have} but this engine trains {want} (actor.lora.rank must match)"
        )
    differ = {k: (saved.get(k), current.get(k)) for k in _ADAPTER_KEYS if saved.get(k) != current.get(k)}
    if differ:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in differ.items())
        raise ValueError(f"{folder}: the checkpoint's adapters differ from this engine's ({listed})")


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / RNG_DIR / f"rank_{rank}.json"


def save_engine(folder: str | Path, engine: Any, *, rank: int, world_size: int) -> dict[str, Any]:
    """Write ``engine``'s sharded state and this rank's RNG states into ``folder`` (call on every rank).

    Returns ``{"rank", "bytes"}``: this rank's share of the bytes written.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    base = Path(folder)
    (base / RNG_DIR).mkdir(parents=True, exist_ok=True)
    state = engine.state_dict_for_checkpoint()
    distributed = dist.is_available() and dist.is_initialized()
    with _single_process_quiet(distributed):
        dcp.save(state, checkpoint_id=str(base / DCP_DIR), no_dist=not distributed)
    write_file_atomic(_rng_file(base, rank), json.dumps(capture_rng()))
    if rank == 0:
        meta = {"world_size": world_size, "engine": type(engine).__name__, **_engine_meta(engine)}
        write_file_atomic(base / META_FILE, json.dumps(meta))
    written = sum(p.stat().st_size for p in (base / DCP_DIR).glob(f"__{rank}_*"))
    return {"rank": rank, "bytes": written}


def load_engine(folder: str | Path, engine: Any, *, rank: int, world_size: int) -> dict[str, Any]:
    """Load ``engine``'s state from ``folder`` (call on every rank); restore this rank's RNG states.

    The RNG states are restored only when the checkpoint was written by the same number
    of ranks (otherwise rank ``r`` of the new group has no counterpart; it keeps its
    own seeding). Returns ``{"rank", "saved_world_size", "rng_restored"}``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    base = Path(folder)
    if not (base / DCP_DIR / ".metadata").is_file():
        raise FileNotFoundError(f"{base}: no DCP checkpoint here (expected {base / DCP_DIR / '.metadata'})")
    meta = json.loads((base / META_FILE).read_text()) if (base / META_FILE).is_file() else {}
    saved_world = int(meta.get("world_size", world_size))
    _check_same_adapter(base, meta.get("adapter"), _engine_meta(engine).get("adapter"))
    state = engine.state_dict_for_checkpoint()
    distributed = dist.is_available() and dist.is_initialized()
    with _single_process_quiet(distributed):
        dcp.load(state, checkpoint_id=str(base / DCP_DIR), no_dist=not distributed)
    engine.load_checkpoint_state(state)
    rng_path = _rng_file(base, rank)
    restored = saved_world == world_size and rng_path.is_file()
    if restored:
        restore_rng(json.loads(rng_path.read_text()))
    return {"rank": rank, "saved_world_size": saved_world, "rng_restored": restored}
