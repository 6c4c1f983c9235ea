"""The tensors of an HF checkpoint folder, read one at a time from its safetensors files.

A folder holds either one ``model.safetensors`` or shards named by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``). A
safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets counted from the
end of the header) and the tensors' bytes. :class:`CheckpointFiles` parses every header
up front — so a missing shard, a broken index or a truncated file is refused in one
sentence before anything is built — and :meth:`CheckpointFiles.read` reads one tensor
with plain file reads into a fresh buffer: host memory holds that tensor only, never
the whole file (no memory map whose pages stay resident).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CheckpointError", "CheckpointFiles", "TensorEntry", "has_safetensors"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint folder whose files cannot be what its index or headers say."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, dtype, shape and byte range in that file (absolute offsets)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in the file."""
        return self.end - self.begin


def has_safetensors(folder: str | Path) -> bool:
    """Whether ``folder`` holds an HF checkpoint in safetensors form (one file or an index)."""
    path = Path(folder)
    return (path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file()


class CheckpointFiles:
    """Every tensor of the safetensors checkpoint in ``folder``, by name.

    Raises :class:`CheckpointError` naming the folder and the file when the index is not
    valid JSON or names a shard that is not there, when a header cannot be parsed, when a
    tensor's byte range does not fit its dtype and shape or lies past the end of its
    file, or when the index names a tensor its shard does not hold.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.entries: dict[str, TensorEntry] = {}
        index = self.folder / INDEX_FILE
        if index.is_file():
            shards = self._shards_from_index(index)
        elif (self.folder / SINGLE_FILE).is_file():
            shards = {SINGLE_FILE: None}
        else:
            raise CheckpointError(
                f"{self.folder}: no {SINGLE_FILE} and no {INDEX_FILE}; expected an HF checkpoint in safetensors form"
            )
        for shard, expected in shards.items():
            found = self._read_header(self.folder / shard)
            if expected is not None:
                absent = sorted(expected - set(found))
                if absent:
                    raise CheckpointError(
                        f"{index}: names {len(absent)} tensor(s) in {shard} that the file does not hold "
                        f"(first: {absent[0]!r})"
                    )
            self.entries.update(found)

    def _shards_from_index(self, index: Path) -> dict[str, set[str]]:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {err}"
            ) from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
        shards: dict[str, set[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(str(shard), set()).add(name)
        missing = sorted(s for s in shards if not (self.folder / s).is_file())
        if missing:
            raise CheckpointError(
                f"{index} names shard file(s) the folder does not have: {', '.join(missing)}"
            )
        return shards

    def _read_header(self, file: Path) -> dict[str, TensorEntry]:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file} is not a safetensors file: {size} bytes, no header")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise CheckpointError(
                    f"{file} is not a safetensors file: header of {length} bytes in a {size}-byte file"
                )
            try:
                header = json.loads(f.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise CheckpointError(f"{file}: the safetensors header is not valid JSON ({err})") from None
        start = 8 + length
        out: dict[str, TensorEntry] = {}
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _DTYPES[spec["dtype"]]
                shape = tuple(int(d) for d in spec["shape"])
                begin, end = (int(x) for x in spec["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(
                    f"{file}: tensor {name!r} has a malformed header entry ({err})"
                ) from None
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize or start + end > size:
                raise CheckpointError(
                    f"{file}: tensor {name!r} ({spec['dtype']} {list(shape)}) does not fit its byte range "
                    f"[{begin}, {end}) in a file of {size} bytes (truncated or corrupt)"
                )
            out[name] = TensorEntry(file, dtype, shape, start + begin, start + end)
        return out

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        """Every tensor name, in the files' order."""
        return list(self.entries)

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on CPU in its stored dtype (a fresh buffer of exactly its bytes)."""
        entry = self.entries[name]
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
        with entry.file.open("rb") as f:
            f.seek(entry.begin)
            read = f.readinto(buffer.numpy())
        if read != entry.nbytes:
            raise CheckpointError(f"{entry.file}: tensor {name!r} ended after {read} of {entry.nbytes} bytes")
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return buffer.view(entry.dtype).reshape(entry.shape)
