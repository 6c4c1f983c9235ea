"""Loading HF checkpoints quietly: no per-process progress bars from every worker.

``from_pretrained`` draws a "Loading weights" bar; with N workers (and every role in
them) a run prints N colored bars per role at start. Weights load in well under a
second for the models where the bar would help least, so it is switched off while
verity loads a checkpoint, and restored after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["quiet_loading"]


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Within the block, transformers shows no progress bars and only errors."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
