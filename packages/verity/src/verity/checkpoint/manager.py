"""Save and restore whole checkpoints: every trained role's shards plus the driver's state.

    manager = CheckpointManager(root, keep=2, groups={"actor": actor_group},
                                model_path=..., tokenizer_path=...)
    path = manager.save(step, trainer_state)        # atomic; prunes to the last `keep`
    state = manager.restore(path)                    # loads every role, returns TrainerState

A trained role's worker group must offer ``save_checkpoint(path)`` and
``load_checkpoint(path)`` as group methods dispatched to every rank (each rank writes
or reads its shards under ``path``; see :mod:`verity.checkpoint.sharded`).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verity.checkpoint.layout import TMP_SUFFIX, commit, prune, remove_unfinished, step_dir_name
from verity.checkpoint.state import TrainerState
from verity.testing.faults import maybe_crash

logger = logging.getLogger("verity.checkpoint")

HF_DIR = "hf"
PREPROCESSOR_CONFIG = "preprocessor_config.json"  # a vision-language model's image processor


class CheckpointManager:
    """Writes ``step_N`` checkpoints under ``root`` for the given worker groups.

    Args:
        root: the checkpoint folder (created if missing).
        keep: complete checkpoints kept after each save (0 keeps all).
        groups: trained role name -> worker group (``"actor"``, ``"critic"``, ...).
        model_path / tokenizer_path: HF folders whose config and tokenizer are copied
            into each checkpoint's ``hf/`` so it can be exported on its own.
    """

    def __init__(
        self,
        root: str | Path,
        keep: int,
        groups: Mapping[str, Any],
        model_path: str | None = None,
        tokenizer_path: str | None = None,
    ) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0 (0 keeps every checkpoint), got {keep}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.groups = dict(groups)
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self._hf_config: Any = None
        self._tokenizer: Any = None
        self.last_saved: Path | None = None

    def _write_hf_assets(self, folder: Path) -> None:
        """Model config, generation config, tokenizer files and (vision-language models) the image
        processor's ``preprocessor_config.json`` into ``folder`` (no weights)."""
        if self.model_path is None:
            return
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        if self._hf_config is None:
            self._hf_config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
        folder.mkdir(parents=True, exist_ok=True)
        self._hf_config.save_pretrained(folder)
        self._tokenizer.save_pretrained(folder)
        if (Path(self.model_path) / "generation_config.json").is_file():
            GenerationConfig.from_pretrained(self.model_path).save_pretrained(folder)
        processor = Path(self.model_path) / PREPROCESSOR_CONFIG
        if processor.is_file():
            shutil.copyfile(processor, folder / PREPROCESSOR_CONFIG)

    def save(self, step: int, state: TrainerState) -> Path:
        """Write checkpoint ``step_<step>`` atomically, point ``latest`` at it, prune old ones.

        Returns the committed folder. Leftovers of interrupted saves are removed first.
        """
        start = time.perf_counter()
        for stale in remove_unfinished(self.root):
            logger.info("removed an unfinished checkpoint: %s", stale)
        tmp = self.root / (step_dir_name(step) + TMP_SUFFIX)
        tmp.mkdir(parents=True)
        ranks: dict[str, int] = {}
        for role, group in self.groups.items():
            answers = group.save_checkpoint(str(tmp / role))  # one answer per rank
            ranks[role] = len(answers) if isinstance(answers, list) else 1
        self._write_hf_assets(tmp / HF_DIR)
        maybe_crash("save", step)
        state.roles = ranks
        state.step = step
        state.write(tmp)
        final = commit(tmp, self.root / step_dir_name(step))
        for old in prune(self.root, self.keep, protect=final):
            logger.info("removed old checkpoint %s (keeping the last %d)", old.name, self.keep)
        self.last_saved = final
        logger.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - start)
        return final

    def restore(self, path: str | Path) -> TrainerState:
        """Load every role's shards from checkpoint ``path`` into the groups; return the driver state.

        Raises ValueError when the checkpoint lacks a role this run trains.
        """
        folder = Path(path)
        state = TrainerState.read(folder)
        missing = [role for role in self.groups if role not in state.roles]
        if missing:
            raise ValueError(
                f"checkpoint {folder} holds roles {sorted(state.roles)} but this run trains {sorted(self.groups)}: "
                f"no saved state for {missing}"
            )
        start = time.perf_counter()
        for role, group in self.groups.items():
            group.load_checkpoint(str(folder / role))
        logger.info(
            "loaded checkpoint %s (step %d) in %.2f s", folder, state.step, time.perf_counter() - start
        )
        return state
