"""One response being built turn by turn, and the batch tensors made from finished ones.

A response is a sequence of segments: model turns (written by the policy: trained,
with the sampler's log-probs) and tool answers (written by the template and the
tools: in the context, never trained). :class:`TrajectoryState` holds the tokens, the
per-token *model* flags and log-probs, the chat messages of the turns, and the
counters; :func:`assemble` turns a list of them into the right-padded ``[B, R]``
tensors of the rollout's output.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TrajectoryState", "assemble"]


@dataclass
class TrajectoryState:
    """The response of one row so far (see the module docstring).

    ``tokens`` / ``model`` / ``logprobs``: one entry per response token (``model`` 1 for
    policy tokens, 0 for tool-answer tokens; log-prob 0 on the latter). ``turn_start``:
    where the current model turn began in ``tokens``. ``stop``: why it ended (``answer``:
    a turn without tool calls; ``max_turns``; ``budget``: the response budget ran out).
    """

    prompt: list[int]
    extra_info: Any = None
    tokens: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_start: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    error_kinds: Counter = field(default_factory=Counter)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turn_over: bool = False
    stop_token: int | None = None
    stop: str | None = None

    @property
    def done(self) -> bool:
        """True once the response is finished."""
        return self.stop is not None

    @property
    def turn_tokens(self) -> list[int]:
        """The tokens of the current model turn."""
        return self.tokens[self.turn_start :]

    def add_model(self, tokens: list[int], logprobs: list[float]) -> None:
        """Append tokens the policy wrote, with their log-probs."""
        self.tokens += tokens
        self.model += [1] * len(tokens)
        self.logprobs += logprobs

    def add_tool(self, tokens: list[int]) -> None:
        """Append template/tool tokens (not trained, log-prob 0) and start a new model turn after them."""
        self.tokens += tokens
        self.model += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.turn_start = len(self.tokens)
        self.turn_over = False
        self.stop_token = None

    def finish(self, why: str) -> None:
        """Mark the response finished (``why``: see the class docstring)."""
        self.stop = why
        self.turn_over = False

    def record(self) -> dict[str, Any]:
        """The trajectory as the batch's per-row ``trajectory`` field (documented in docs/agent-loop.md)."""
        model_tokens = sum(self.model)
        return {
            "messages": [dict(m) for m in self.messages],
            "num_turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "error_kinds": dict(self.error_kinds),
            "stop": self.stop,
            "model_tokens": model_tokens,
            "tool_tokens": len(self.tokens) - model_tokens,
        }


def assemble(
    states: list[TrajectoryState], width: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(responses, response_mask, response_attention, logprobs)``, each ``[B, width]``.

    ``responses`` int64 right-padded with ``pad_token_id``; ``response_mask`` int64, 1 on
    policy tokens only; ``response_attention`` int64, 1 on every real response token
    (policy and tool); ``logprobs`` float32, 0 off the policy tokens. Raises ValueError
    when a response is longer than ``width``.
    """
    rows = len(states)
    responses = torch.full((rows, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    logprobs = torch.zeros((rows, width), dtype=torch.float32)
    for row, state in enumerate(states):
        length = len(state.tokens)
        if length > width:
            raise ValueError(f"row {row}: {length} response tokens, more than the budget {width}")
        if length:
            responses[row, :length] = torch.tensor(state.tokens, dtype=torch.long)
            response_mask[row, :length] = torch.tensor(state.model, dtype=torch.long)
            attention[row, :length] = 1
            logprobs[row, :length] = torch.tensor(state.logprobs, dtype=torch.float32)
    return responses, response_mask, attention, logprobs
