"""Handing the trainer's weights to a running vLLM engine.

vLLM repacks its linear layers after loading (on CPU the weights are re-laid for
its kernels), so copying into ``model.parameters()`` after start-up is wrong. What
works, in vLLM 0.32, is the worker's ``reload_weights(weights_iterator=...,
is_checkpoint_format=True)``: it takes checkpoint-named full tensors, buffers each
layer until all of its weights arrived, then runs the same processing as at load
time and copies the result into the kernel tensors in place.

Two details that matter:

- With tied embeddings vLLM still keeps a separate (processed) ``lm_head``; a sync
  stream built from ``named_parameters()`` carries the shared tensor only once, as
  ``model.embed_tokens.weight``. :func:`with_tied_lm_head` sends it a second time
  as ``lm_head.weight`` (without it the engine's outputs matched neither the old
  nor the new weights).
- In vLLM's multi-process mode the tensors must cross a process boundary;
  :class:`VerityWorkerExtension` (given to vLLM as ``worker_extension_cls``) takes
  them as one safetensors blob (:func:`to_safetensors_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"


def with_tied_lm_head(
    named_tensors: Iterable[tuple[str, torch.Tensor]], tied: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream unchanged; when ``tied``, the embedding is also sent as ``lm_head.weight``.

    The copy follows the embedding at once (no extra tensor is held back); a later
    ``lm_head.weight`` in the stream is then dropped, so it is never sent twice.
    """
    sent_head = False
    for name, tensor in named_tensors:
        if name == LM_HEAD_NAME:
            if tied and sent_head:
                continue
            sent_head = True
        yield name, tensor
        if tied and name == EMBED_NAME and not sent_head:
            sent_head = True
            yield LM_HEAD_NAME, tensor


def to_safetensors_bytes(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[bytes, int]:
    """``(safetensors blob, tensor count)`` of the stream (tensors moved to CPU, made contiguous).

    A tensor whose storage an earlier one already uses is copied: ``to("cpu").contiguous()``
    returns a CPU tensor itself, and safetensors refuses tensors that share memory (the
    embedding that :func:`with_tied_lm_head` also sends as ``lm_head.weight``).
    """
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in named_tensors:
        cpu = tensor.detach().to("cpu").contiguous()
        storage = cpu.untyped_storage().data_ptr()
        if storage in storages:
            cpu = cpu.clone()
        else:
            storages.add(storage)
        tensors[name] = cpu
    return save(tensors), len(tensors)


class VerityWorkerExtension:
    """Methods vLLM mixes into its workers (``worker_extension_cls``); ``self`` is a vLLM worker."""

    def verity_reload_weights(self, blob: bytes) -> int:
        """Load a safetensors blob of checkpoint-named full tensors in place; returns the tensor count."""
        from safetensors.torch import load

        tensors = load(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(tensors)
