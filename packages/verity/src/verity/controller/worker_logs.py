"""Where the engines' own log lines go in a worker process.

vLLM logs every engine event at INFO (``Successfully reset prefix cache``, once per rank
and step) and megatron-core warns about ``CUDA_DEVICE_MAX_CONNECTIONS``, a CUDA setting
that means nothing on a CPU run. Ray forwards a worker's stdout/stderr to the driver's
console, so without this they print between the run's progress lines.

:func:`setup_worker_logging` runs in each worker (:meth:`WorkerHost.setup`): the
``vllm`` and ``megatron`` loggers write INFO and up to
``<trainer.output_dir>/logs/worker-<group>-<rank>.log`` and only WARNING and up to the
console (stderr, which Ray forwards, folding repeats across ranks into one line); on a
CPU run the ``CUDA_DEVICE_MAX_CONNECTIONS`` advice is filtered.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

__all__ = ["ENGINE_LOGGERS", "LOG_DIR_ENV", "setup_worker_logging", "worker_log_path"]

#: the libraries whose INFO lines go to the worker's log file only
ENGINE_LOGGERS = ("vllm", "megatron")
#: set by the trainer for its worker groups: the folder of the workers' log files
LOG_DIR_ENV = "VERITY_WORKER_LOG_DIR"
#: megatron-core's advice for CUDA streams: irrelevant on CPU
CUDA_CONNECTIONS_WARNING = r".*CUDA_DEVICE_MAX_CONNECTIONS.*"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def worker_log_path(log_dir: str | os.PathLike, group: str, rank: int | str) -> Path:
    """``<log_dir>/worker-<group>-<rank>.log`` (``+`` of colocated groups kept as is)."""
    safe = "".join(c if c.isalnum() or c in "+-_." else "_" for c in group)
    return Path(log_dir) / f"worker-{safe}-{rank}.log"


def setup_worker_logging(
    log_dir: str | os.PathLike | None, group: str, rank: int | str, on_cpu: bool
) -> Path | None:
    """Route the engines' loggers: INFO to the worker's log file (when ``log_dir``), WARNING to stderr.

    Returns the log file's path (None without ``log_dir``). Safe to call twice.
    """
    # vLLM installs its own INFO handler on stdout at import unless told not to; ours replace it
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    path = None
    if log_dir:
        path = worker_log_path(log_dir, group, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
    for name in ENGINE_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        for handler in list(logger.handlers):
            if getattr(handler, "_verity_worker_log", False):
                logger.removeHandler(handler)
                handler.close()
            elif not isinstance(handler, logging.FileHandler):  # an engine's own console handler
                handler.setLevel(max(handler.level, logging.WARNING))
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        console._verity_worker_log = True  # type: ignore[attr-defined]
        logger.addHandler(console)
        if path is not None:
            file_handler = logging.FileHandler(path, encoding="utf-8")
            file_handler.setLevel(logging.INFO)
            file_handler.setFormatter(logging.Formatter(_FORMAT))
            file_handler._verity_worker_log = True  # type: ignore[attr-defined]
            logger.addHandler(file_handler)
    if on_cpu:
        warnings.filterwarnings("ignore", message=CUDA_CONNECTIONS_WARNING)
    return path
