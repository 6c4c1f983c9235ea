"""The no-grad passes of :class:`~verity.engines.fsdp2.FSDP2Engine`: log-probs and values, micro-batch by micro-batch.

:class:`FSDP2ScoringMixin` runs the model without a gradient over a mini-batch (the old
and reference log-probs of a PPO step, a critic's values). The rows go to the device once
per call (:func:`~verity.engines.micro_batches.on_device`), each micro-batch's window is
planned from the host copy (:func:`~verity.engines.micro_batch_groups.host_rows`), and the
answers come back to the host in one copy at the end, so the host never waits on the
device between micro-batches. Micro-batches cut by tokens take rows longest first
(:mod:`verity.engines.micro_batch_groups`); the answers are put back in the rows' order.
"""

from __future__ import annotations

from typing import Any

import torch

from verity.engines.micro_batch_groups import host_rows, restore_index, take_group
from verity.engines.micro_batches import (
    LOGPROB_KEYS,
    model_inputs,
    num_rows,
    on_device,
    validate_layout,
)

__all__ = ["FSDP2ScoringMixin"]


class FSDP2ScoringMixin:
    """``compute_logprobs`` and ``compute_values`` for an engine with ``_module``, ``device``,
    ``_micro_ranges``, ``_autocast``, ``logprob_chunk_tokens``, ``compiled_head``, ``packed`` and
    the scoring functions ``_logprobs_fn`` / ``_values_fn`` (padded or packed per micro-batch,
    :mod:`verity.engines.packed`, or their sequence-parallel forms,
    :mod:`verity.engines.ulysses_scoring`; :func:`verity.engines.ulysses_engine.sequence_parallel_scoring`)."""

    packed: bool = False

    def _no_grad_passes(
        self, batch: Any, micro_batch_size: int, forward: Any
    ) -> tuple[list[Any], torch.Tensor | None]:
        """Run ``forward(model_inputs)`` on each micro-batch: ``(the answers of the real ones, restore)``.

        ``restore``: the index that puts the answers, concatenated, back in the rows' order (None:
        they are). Every rank runs the same number of passes (FSDP2 all-gathers in each); a rank
        with fewer rows repeats a one-row pass whose answer is dropped.
        """
        ranges, max_count = self._micro_ranges(batch, num_rows(batch), micro_batch_size)
        local_count = len(ranges)
        resident = on_device(batch, num_rows(batch), self.device)
        self._module.eval()
        answers = []
        with torch.no_grad():
            for i in range(max_count):
                rows = ranges[i] if i < local_count else torch.zeros(1, dtype=torch.long)
                micro = model_inputs(take_group(resident, rows, self.device))
                with self._autocast():
                    answer = forward(micro, host_rows(batch, rows))
                if i < local_count:
                    answers.append(answer)
        return answers, restore_index(ranges)

    def compute_logprobs(
        self,
        batch: Any,
        micro_batch_size: int,
        temperature: float = 1.0,
        *,
        compute_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See :meth:`TrainingEngine.compute_logprobs`; returns float32 CPU tensors ``[B, R]``."""
        validate_layout(batch, LOGPROB_KEYS)

        def forward(micro: dict[str, torch.Tensor], layout: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            logprobs, entropy = self._logprobs_fn(
                self._module,
                micro,
                temperature=temperature,
                compute_entropy=compute_entropy,
                chunk_tokens=self.logprob_chunk_tokens,
                compiled_head=self.compiled_head,
                layout=layout,
            )
            return logprobs.float(), (entropy.float() if entropy is not None else None)

        # the answers stay on the device until one copy back
        parts, restore = self._no_grad_passes(batch, micro_batch_size, forward)
        logprobs = _in_order(torch.cat([lp for lp, _ in parts]).cpu(), restore)
        entropy_out = _in_order(torch.cat([e for _, e in parts]).cpu(), restore) if compute_entropy else None
        return logprobs, entropy_out

    def compute_values(self, batch: Any, micro_batch_size: int) -> torch.Tensor:
        """Values of the response tokens under a value model (a critic): float32 CPU ``[B, R]``, no grad.

        The model must have a scalar head (see :mod:`verity.engines.values`); the value
        of response token ``j`` is read at position ``P-1+j``. ``batch`` as for
        :meth:`compute_logprobs`.
        """
        validate_layout(batch, LOGPROB_KEYS)

        def forward(micro: dict[str, torch.Tensor], layout: Any) -> torch.Tensor:
            return self._values_fn(self._module, micro, layout=layout).float()

        parts, restore = self._no_grad_passes(batch, micro_batch_size, forward)
        return _in_order(torch.cat(parts).cpu(), restore)


def _in_order(answers: torch.Tensor, restore: torch.Tensor | None) -> torch.Tensor:
    """``answers`` ``[B, ...]`` in the micro-batches' order, put back in the rows' order."""
    return answers if restore is None else answers[restore]
