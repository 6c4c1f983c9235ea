"""The ranks of a tensor-parallel rollout replica decode in lockstep: checked before each decode.

Every rank of a replica runs its own decode loop (the HF engine) or scheduler (vLLM's external
launcher) and must make the same choices: the same prompts, sampling parameters and random
state. Ranks that disagree would wait on each other's collectives forever; comparing an
8-byte digest of those inputs first turns that hang into an error on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["check_replica_lockstep"]


def check_replica_lockstep(
    tp_mesh: Any, device: torch.device | str, parts: Iterable[bytes], engine: str
) -> None:
    """Raise ``RuntimeError`` on every rank of ``tp_mesh`` unless all ranks give the same ``parts``.

    ``parts``: the bytes of what must agree (prompt ids, sampling parameters, generator state),
    hashed to one 64-bit digest per rank; one all-gather of ``size`` int64 over the mesh's group,
    on ``device`` (the group's backend must reach it). ``engine`` names the engine in the error.
    """
    size = tp_mesh.size()
    if size == 1:
        return
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(part)
    mine = torch.tensor([int.from_bytes(digest.digest(), "little", signed=True)], device=device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=tp_mesh.get_group())
    if any(not torch.equal(other, mine) for other in every):
        raise RuntimeError(
            f"{engine}: the ranks of a tensor-parallel rollout replica were given different prompts, sampling "
            "parameters or seeds; every rank of a replica must generate the same batch in lockstep"
        )
