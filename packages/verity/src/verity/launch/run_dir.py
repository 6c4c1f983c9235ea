"""One run per output folder: a lock, a readable run name, and moving an old run aside.

- :func:`claim_output_dir` takes an exclusive lock on ``<output_dir>/.verity.lock``
  for the whole run (``fcntl.flock``: the kernel drops it when the process dies, so a
  crashed run never leaves a stale lock). A second run into the same folder fails at
  once, naming the holder's pid, host and start time. A run that fails before its
  training starts removes the lock file, and the folder if it made it and it is empty.
- :func:`move_aside` moves a previous run's outputs (and its checkpoints) into a new
  sibling folder ``<output_dir>.moved-<time>``, so a fresh start never mixes with an
  older run and nothing already written is lost.
- :func:`run_name` gives an MLflow run a name a person can read: experiment, date
  and time, and the first characters of the config hash.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "LOCK_FILE",
    "OutputClaim",
    "OutputDirBusyError",
    "claim_output_dir",
    "move_aside",
    "previous_outputs",
    "run_name",
]

LOCK_FILE = ".verity.lock"

#: files and folders a run leaves in its output folder (what makes a folder "used")
RUN_OUTPUTS = (
    "summary.json",
    "metrics.jsonl",
    "validation.jsonl",
    "mlflow.db",
    "checkpoints",
    "workers.json",
)


class OutputDirBusyError(RuntimeError):
    """Another live run holds the output folder."""


class OutputClaim:
    """The held lock of an output folder (what :func:`claim_output_dir` yields).

    ``lock``: the lock file. Set ``training_started`` when the run's training begins: a run
    that fails before then removes its lock, and the folder when the claim made it and
    nothing else is in it, so a run rejected before training leaves nothing behind.
    """

    def __init__(self, lock: Path) -> None:
        self.lock = lock
        self.training_started = False


@contextlib.contextmanager
def claim_output_dir(out_dir: Path) -> Iterator[OutputClaim]:
    """Hold the output folder's lock while the block runs; :class:`OutputDirBusyError` if another run has it.

    If the block raises before ``claim.training_started`` is set, the lock file is removed,
    and so are the folders this call created, when they are empty.
    """
    made = _missing_folders(out_dir)
    handle, path = _lock(out_dir)
    claim = OutputClaim(path)
    try:
        handle.seek(0)
        handle.truncate()
        started = dt.datetime.now().astimezone().isoformat(timespec="seconds")
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}))
        handle.flush()
        yield claim
    except BaseException:
        if not claim.training_started:  # rejected before training: leave nothing behind
            with contextlib.suppress(OSError):
                path.unlink()  # while still held: a run waiting on this file re-checks it (see _lock)
            for folder in made:  # deepest first; rmdir leaves a folder that holds anything
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise
    finally:
        handle.close()  # releases the lock


def _missing_folders(out_dir: Path) -> list[Path]:
    """``out_dir`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    folder = out_dir.absolute()
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _lock(out_dir: Path) -> tuple[Any, Path]:
    """Make the folder, open its lock file and take the lock; ``(open file, lock path)``.

    A run that fails before training removes its lock file while holding it, so a lock
    taken on a file that has since left the folder is dropped and taken again on the new one.
    """
    import fcntl

    path = out_dir / LOCK_FILE
    for _ in range(100):
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # what the config check cannot see ahead (/proc, a read-only mount)
            from verity.config.errors import ConfigError

            raise ConfigError(
                f"trainer.output_dir {str(out_dir)!r} cannot be created: {err.strerror or err}"
            ) from None
        try:
            handle = open(path, "a+")  # noqa: SIM115 - held open for the whole run
        except FileNotFoundError:  # the folder was removed by a run that failed meanwhile
            continue
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _describe_holder(handle.read())
            handle.close()
            raise OutputDirBusyError(
                f"trainer.output_dir {str(out_dir)!r} is in use by another run ({holder}); "
                "wait for it, or give this run another trainer.output_dir"
            ) from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(handle.fileno()).st_ino:
            return handle, path
        handle.close()  # the file was removed (and maybe made anew) while this run opened it
    raise OutputDirBusyError(f"trainer.output_dir {str(out_dir)!r}: could not take its lock; try again")


def _describe_holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def previous_outputs(out_dir: Path, checkpoint_root: Path) -> list[Path]:
    """What an earlier run left: its output files in ``out_dir`` and a non-empty checkpoint folder."""
    found = [out_dir / name for name in RUN_OUTPUTS if (out_dir / name).exists() and name != "checkpoints"]
    if checkpoint_root.is_dir() and any(checkpoint_root.iterdir()):
        found.append(checkpoint_root)
    return found


def move_aside(out_dir: Path, checkpoint_root: Path) -> Path | None:
    """Move a previous run's outputs into ``<out_dir>.moved-<time>/``; return it (None if nothing to move).

    Everything in ``out_dir`` except the lock moves; a checkpoint folder outside
    ``out_dir`` moves in as ``checkpoints`` (``checkpoints.<its name>`` if that is taken).
    """
    from verity.tracking.mlflow_tracker import release_embedded_store

    if not previous_outputs(out_dir, checkpoint_root):
        return None
    release_embedded_store(out_dir)  # this process may hold the old store open (several runs in one process)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = out_dir.parent / f"{out_dir.name}.moved-{stamp}"
    suffix = 1
    while target.exists():
        target = out_dir.parent / f"{out_dir.name}.moved-{stamp}-{suffix}"
        suffix += 1
    target.mkdir(parents=True)
    for entry in sorted(out_dir.iterdir()):
        if entry.name != LOCK_FILE:
            shutil.move(str(entry), str(target / entry.name))
    outside = checkpoint_root.resolve()
    if outside.is_dir() and not outside.is_relative_to(out_dir.resolve()) and any(outside.iterdir()):
        name = "checkpoints" if not (target / "checkpoints").exists() else f"checkpoints.{outside.name}"
        shutil.move(str(outside), str(target / name))
    return target


def run_name(experiment: str, cfg_hash: str, now: dt.datetime | None = None) -> str:
    """``<experiment>-<YYYYmmdd-HHMMSS>-<hash[:8]>``, e.g. ``quickstart-20261123-142501-1f3a9c2e``."""
    now = now or dt.datetime.now()
    return f"{experiment}-{now.strftime('%Y%m%d-%H%M%S')}-{cfg_hash[:8]}"
