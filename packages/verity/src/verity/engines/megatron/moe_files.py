"""A mixture-of-experts checkpoint folder read one expert at a time.

transformers keeps a Qwen3-MoE layer's experts in memory as two 3-D tensors
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``), but
``save_pretrained`` writes them (and hub checkpoints hold them) one expert at a time:

    model.layers.{i}.mlp.experts.{e}.gate_proj.weight   [I, H]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight     [I, H]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight   [H, I]

:class:`ExpertTensors` answers the in-memory names from such files: ``expert_slice``
reads only the one expert a Megatron parameter holds (so an EP rank reads only its own
experts), ``[...]`` the whole stack. A folder that already holds the 3-D names is read
as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def per_expert_names(fused: str, expert: int) -> tuple[str, ...]:
    """The file names that hold expert ``expert`` of the in-memory tensor ``fused`` (gate before up)."""
    match = _FUSED.match(fused)
    if match is None:
        raise KeyError(f"{fused!r} is not a mixture-of-experts tensor")
    prefix, kind = match.group(1), match.group(2)
    if kind == "gate_up_proj":
        return (f"{prefix}.{expert}.gate_proj.weight", f"{prefix}.{expert}.up_proj.weight")
    return (f"{prefix}.{expert}.down_proj.weight",)


def expected_file_shapes(
    hf_shapes: Mapping[str, tuple[int, ...]], names: set[str]
) -> dict[str, tuple[int, ...]]:
    """Every tensor a folder must hold, with its shape: ``hf_shapes``, with each 3-D expert tensor the
    folder does not hold under its own name replaced by its per-expert tensors."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in hf_shapes.items():
        if _FUSED.match(name) is None or name in names:
            out[name] = tuple(shape)
            continue
        experts, rows, cols = shape
        for e in range(experts):
            parts = per_expert_names(name, e)
            for part in parts:
                out[part] = (rows // len(parts), cols)
    return out


class ExpertTensors(Mapping[str, torch.Tensor]):
    """The in-memory names of a model over files that may hold its experts one by one (see the module)."""

    def __init__(self, files: Mapping[str, torch.Tensor], num_experts: int) -> None:
        self.files = files
        self.num_experts = num_experts

    def expert_slice(self, fused: str, expert: int) -> torch.Tensor:
        """``fused[expert]`` (``[2I, H]`` or ``[H, I]``), reading only that expert's tensors."""
        if fused in self.files:
            return self.files[fused][expert]
        parts = [self.files[n] for n in per_expert_names(fused, expert)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.files or _FUSED.match(name) is None:
            return self.files[name]
        return torch.stack([self.expert_slice(name, e) for e in range(self.num_experts)])

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str) and _FUSED.match(name) is not None:
            return name in self.files or per_expert_names(name, 0)[0] in self.files
        return name in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)
