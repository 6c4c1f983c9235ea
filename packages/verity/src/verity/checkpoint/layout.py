"""Where checkpoints live on disk, which ones are complete, and how they are committed.

A run's checkpoint folder (default ``<trainer.output_dir>/checkpoints``)::

    checkpoints/
      latest                 text file naming the newest complete checkpoint ("step_6")
      step_4/                a complete checkpoint
        trainer_state.json   the driver's state (written last, before the rename)
        hf/                  model config + tokenizer (for export without the original folder)
        actor/               one folder per trained role (see verity.checkpoint.sharded)
      step_6/
      step_8.tmp/            a save in progress (or interrupted): never read

A save writes everything into ``step_N.tmp/`` and then renames it to ``step_N/``
(one ``rename`` on one filesystem is atomic), then replaces ``latest`` by
write-to-temp + ``os.replace``. A crash at any moment leaves either the old or the
new checkpoint complete, never a half-written one under a final name.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

from verity.tracking.summary import atomic_write_text

LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
TMP_SUFFIX = ".tmp"  # also the suffix of atomic_write_text's temp files, which prune and cleanup recognise
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """``step_<step>`` (no zero padding; listing sorts by the number, not the name)."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
    return f"step_{step}"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step of a ``step_N`` folder name, or None for any other name (``step_N.tmp`` included)."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a committed checkpoint: a ``step_N`` folder holding ``trainer_state.json``."""
    p = Path(path)
    return step_of(p) is not None and (p / STATE_FILE).is_file()


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest step first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [(step_of(p), p) for p in base.iterdir() if p.is_dir() and is_complete(p)]
    return sorted((s, p) for s, p in found if s is not None)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (renames, new files) to disk; a no-op where unsupported."""
    with contextlib.suppress(OSError):
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_file_atomic(path: str | os.PathLike[str], data: str) -> None:
    """Write ``data`` to ``path`` atomically (:func:`verity.tracking.summary.atomic_write_text`), then
    fsync the folder so the rename itself survives a crash."""
    fsync_dir(atomic_write_text(path, data).parent)


def read_latest(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint named by ``root/latest`` if it is complete, else None."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    candidate = Path(root) / name
    return candidate if name and is_complete(candidate) else None


def find_latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root``.

    ``latest`` is trusted when it names a complete checkpoint and no complete one has a
    higher step (a crash between the rename and the pointer update leaves ``latest``
    one behind); otherwise the highest complete ``step_N`` wins. None when there is none.
    """
    listed = list_checkpoints(root)
    newest = listed[-1][1] if listed else None
    pointed = read_latest(root)
    if pointed is None:
        return newest
    if newest is not None and step_of(newest) > step_of(pointed):  # type: ignore[operator]
        return newest
    return pointed


def commit(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> Path:
    """Rename a finished ``step_N.tmp`` to ``step_N`` and point ``latest`` at it.

    An existing ``step_N`` (a step saved again after resuming from an earlier
    checkpoint) is first renamed aside and removed only after the new one is in place.
    """
    tmp, final = Path(tmp), Path(final)
    fsync_dir(tmp)
    aside = None
    if final.exists():
        aside = final.with_name(final.name + ".old" + TMP_SUFFIX)
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    write_file_atomic(final.parent / LATEST_FILE, final.name + "\n")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def remove_unfinished(root: str | os.PathLike[str]) -> list[Path]:
    """Delete leftovers of interrupted saves (``*.tmp`` folders and files) under ``root``."""
    base = Path(root)
    removed = []
    if not base.is_dir():
        return removed
    for p in base.iterdir():
        if p.name.endswith(TMP_SUFFIX):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
            removed.append(p)
    return removed


def prune(root: str | os.PathLike[str], keep: int, protect: Path | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints so that ``keep`` remain (``keep <= 0``: keep all).

    Each is renamed to ``step_N.deleting.tmp`` before its files go, so an interrupted
    delete never leaves a damaged folder under a checkpoint's name. ``protect`` (the one just written) is never deleted. Returns the deleted paths.
    """
    if keep <= 0:
        return []
    listed = [p for _, p in list_checkpoints(root)]
    doomed = listed[:-keep] if len(listed) > keep else []
    removed = []
    for p in doomed:
        if protect is not None and p.resolve() == protect.resolve():
            continue
        # rename first: a crash mid-delete must not leave a half-deleted step_N that looks complete
        doomed_tmp = p.with_name(p.name + ".deleting" + TMP_SUFFIX)
        os.rename(p, doomed_tmp)
        shutil.rmtree(doomed_tmp, ignore_errors=True)
        removed.append(p)
    return removed
