"""Batches of prompts for generation, with a seeded sampler that resumes exactly where it stopped.

:class:`PromptDataLoader` draws ``batch_size`` prompts at a time from a
:class:`~verity.data.verl_dataset.PromptDataset` and returns a ``verity.batch.Batch``:

- tensors ``input_ids`` ``[B, P]`` (left-padded with the tokenizer's pad id),
  ``attention_mask`` ``[B, P]`` (1 on real tokens) and ``position_ids`` ``[B, P]``
  (``cumsum(attention_mask) - 1`` clipped at 0), all int64; ``P`` is the longest prompt
  of the batch, or ``pad_to`` when given;
- per-sample lists ``data_source``, ``ground_truth``, ``extra_info``, ``prompt_text``,
  ``raw_prompt`` and ``uid`` (the prompt's row number in the dataset, as text);
- with images (:mod:`verity.data.multimodal`), per-sample ``pixel_values``
  (``[patches, C*T*P*P]`` float32 per row) and ``image_grid_thw`` (``[images, 3]`` int64 per row).

:class:`ResumableSampler` shuffles each epoch with a permutation seeded by
``(seed, epoch)``, so the order is reproducible, and its ``state_dict`` (epoch and
position in the epoch) restores the exact next batch after a restart.

``batch_meta`` is set on every batch's ``meta``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from verity.data.verl_dataset import PromptDataset, PromptRecord


def collate_prompts(records: Sequence[PromptRecord], pad_token_id: int, pad_to: int | None = None) -> Any:
    """Left-pad ``records`` into one prompt batch (see the module docstring for its keys)."""
    from verity.batch import Batch

    if not records:
        raise ValueError("collate_prompts: needs at least one record")
    longest = max(len(r.input_ids) for r in records)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(
            f"pad_to: {pad_to} is shorter than the longest prompt of the batch ({longest} tokens)"
        )
    pad = int(pad_token_id)
    # one tensor from padded lists, the mask from the lengths: a slice assignment per row is slower
    # (ci/reports/2026-12-06-docstring-figures.md)
    input_ids = torch.tensor(
        [[pad] * (width - len(r.input_ids)) + list(r.input_ids) for r in records], dtype=torch.long
    ).reshape(len(records), width)
    lengths = torch.tensor([len(r.input_ids) for r in records], dtype=torch.long)
    attention_mask = (torch.arange(width) >= width - lengths[:, None]).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    per_row = {
        "data_source": [r.data_source for r in records],
        "ground_truth": [r.ground_truth for r in records],
        "extra_info": [r.extra_info for r in records],
        "prompt_text": [r.prompt_text for r in records],
        "raw_prompt": [r.raw_prompt for r in records],
        "uid": [str(r.row) for r in records],
    }
    if any(r.pixel_values is not None for r in records):
        # per-row image tensors, unpadded: rows differ in their numbers of patches and images
        per_row["pixel_values"] = [_or_empty(r.pixel_values, (0, 0), torch.float32) for r in records]
        per_row["image_grid_thw"] = [_or_empty(r.image_grid_thw, (0, 3), torch.long) for r in records]
    return Batch.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}, per_row
    )


def _or_empty(value: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype) if value is None else value


class ResumableSampler:
    """Index batches over ``num_samples`` items, epoch after epoch.

    With ``shuffle``, epoch ``e`` visits the items in the permutation drawn by
    ``numpy.random.default_rng([seed, e])``; otherwise in order. With ``drop_last`` an
    epoch yields ``num_samples // batch_size`` full batches; without it a last, smaller batch.
    """

    def __init__(
        self, num_samples: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if num_samples < (batch_size if drop_last else 1):
            raise ValueError(
                f"batch_size: {batch_size} prompts per batch but the dataset has only {num_samples}"
                + (" (drop_last=True would yield no batch)" if drop_last else "")
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order: np.ndarray | None = None

    def batches_per_epoch(self) -> int:
        """Batches in one epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
            else:
                self._order = np.arange(self.num_samples)
        return self._order

    def epoch_finished(self) -> bool:
        """Whether the current epoch has no batch left."""
        left = self.num_samples - self.position
        return left <= 0 or (self.drop_last and left < self.batch_size)

    def advance_epoch_if_finished(self) -> None:
        """Move to the start of the next epoch when the current one has no batch left."""
        if self.epoch_finished():
            self.epoch += 1
            self.position = 0
            self._order = None

    def next_indices(self) -> list[int]:
        """The next batch's item indices (starting a new epoch when the current one is used up)."""
        self.advance_epoch_if_finished()
        order = self._epoch_order()
        chosen = order[self.position : self.position + self.batch_size]
        self.position += len(chosen)
        return [int(i) for i in chosen]

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "seed", "num_samples", "batch_size", "shuffle", "drop_last"}``."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; ValueError when it was saved over a different dataset size."""
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"sampler state: saved over {state['num_samples']} prompts, this dataset has {self.num_samples}"
            )
        self.seed = int(state["seed"])
        self.batch_size = int(state.get("batch_size", self.batch_size))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.drop_last = bool(state.get("drop_last", self.drop_last))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None


class PromptDataLoader:
    """Prompt batches from a :class:`PromptDataset` (see the module docstring).

    ``iter(loader)`` yields the batches left in the current epoch; :meth:`next_batch`
    never ends (it crosses epochs). ``state_dict``/``load_state_dict`` save and restore
    the position for checkpoint resumption.
    """

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        pad_to: int | None = None,
        batch_meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.pad_to = pad_to
        # set on every batch's meta
        self.batch_meta = dict(batch_meta or {})
        self.sampler = ResumableSampler(len(dataset), batch_size, shuffle, seed, drop_last)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based), unless the current one is finished."""
        return self.sampler.epoch

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch()

    def next_batch(self) -> Any:
        """The next prompt batch (a ``verity.batch.Batch``)."""
        indices = self.sampler.next_indices()
        batch = collate_prompts([self.dataset[i] for i in indices], self.dataset.pad_token_id, self.pad_to)
        batch.meta.update(self.batch_meta)
        return batch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.advance_epoch_if_finished()
        while not self.sampler.epoch_finished():
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state (epoch, position, seed, ...)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.sampler.load_state_dict(state)


def build_prompt_loader(
    files: str | Sequence[str],
    tokenizer: Any,
    *,
    batch_size: int,
    max_prompt_length: int,
    truncation: str = "error",
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    max_samples: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> PromptDataLoader:
    """A loader over verl-schema ``files`` (the run config's ``data`` section maps onto these arguments).

    For validation pass ``shuffle=False, drop_last=False`` (and a ``batch_size`` no larger
    than the dataset, or use ``min(batch_size, len(loader.dataset))``).
    """
    dataset = PromptDataset(
        files,
        tokenizer,
        max_prompt_length=max_prompt_length,
        truncation=truncation,
        chat_template_kwargs=chat_template_kwargs,
        max_samples=max_samples,
    )
    return PromptDataLoader(
        dataset, min(batch_size, len(dataset)) if not drop_last else batch_size, shuffle, seed, drop_last
    )
