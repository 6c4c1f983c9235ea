"""The outside view of an FSDP2 engine's state: checkpoints, gradients, sizes.

:class:`FSDP2StateMixin` is the part of :class:`~verity.engines.fsdp2.FSDP2Engine` that
reads or restores its state rather than computing with it: the DCP state dicts
(sharded ``DTensor`` entries under full sharding, whole tensors replicated — DCP
reshards between the two on load), full gradients for checks, the trained-parameter
count and the optimizer's footprint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = ["FSDP2StateMixin"]


class FSDP2StateMixin:
    """Checkpoint and inspection methods over ``_module``, ``optimizer``, ``lr_scheduler``, ``global_step``."""

    _module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    global_step: int

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:  # pragma: no cover
        raise NotImplementedError

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) gradient of every parameter that has one, on CPU (collective).

        For checks and diagnostics; gathers the whole model's gradients at once.
        """
        out = {}
        for name, param in self._module.named_parameters():
            if param.grad is None:
                continue
            grad = param.grad
            if hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            out[name] = grad.detach().float().cpu()
        return out

    def trainable_parameters(self) -> int:
        """Number of trained parameters, at full (unsharded) size."""
        return sum(p.numel() for p in self._module.parameters() if p.requires_grad)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (AdamW moments and step counts) summed over every rank (collective).

        The size is fixed once every state exists (after the first step), so a nonzero
        answer is kept and later calls need no collective.
        """
        if getattr(self, "_optimizer_state_bytes", 0):
            return self._optimizer_state_bytes
        local = 0
        for state in self.optimizer.state.values() if self.optimizer is not None else []:
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    local_value = value.to_local() if hasattr(value, "to_local") else value
                    local += local_value.numel() * local_value.element_size()
        self._optimizer_state_bytes = int(self._all_reduce([float(local)])[0])
        return self._optimizer_state_bytes

    # ------------------------------------------------------------- checkpoint
    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """``{"model", "optimizer", "lr_scheduler", "global_step"}``; model/optimizer as the ranks hold them.

        ``DTensor`` shards under full sharding, whole tensors replicated. Save with
        ``torch.distributed.checkpoint.save(state, checkpoint_id=dir)`` on every rank.
        """
        return self._capture_state(StateDictOptions(full_state_dict=False))

    def _capture_state(self, options: StateDictOptions) -> dict[str, Any]:
        """Model, optimizer (when there is one), LR schedule and step, read with ``options``."""
        state: dict[str, Any] = {"global_step": self.global_step}
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self._module, self.optimizer, options=options)
            state["optimizer"] = optim_sd
            state["lr_scheduler"] = self.lr_scheduler.state_dict() if self.lr_scheduler else {}
        else:
            model_sd = get_model_state_dict(self._module, options=options)
        state["model"] = model_sd
        return state

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict_for_checkpoint` (filled in place by ``dcp.load``)."""
        if "model" not in state:
            raise KeyError("checkpoint state has no 'model' entry")
        self._restore_state(state, StateDictOptions(full_state_dict=False))

    def _restore_state(self, state: Mapping[str, Any], options: StateDictOptions) -> None:
        """Model, optimizer (when both sides have one), LR schedule and step from ``state``."""
        if self.optimizer is not None and "optimizer" in state:
            set_state_dict(
                self._module,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )
            if self.lr_scheduler is not None and state.get("lr_scheduler"):
                self.lr_scheduler.load_state_dict(dict(state["lr_scheduler"]))
        else:
            set_model_state_dict(self._module, state["model"], options=options)
        self.global_step = int(state.get("global_step", 0))
