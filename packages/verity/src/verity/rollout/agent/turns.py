"""The rules of one trajectory's turns: what a request asks for, how a turn ends, how tools answer.

:class:`TurnRules` holds everything the agent loop decides per trajectory, apart from
*when* things happen (that is :mod:`verity.rollout.agent.scheduling`):

- :meth:`TurnRules.request` — the next generation request of a trajectory: its context
  (prompt + response so far) and its own token limit (what its turn and its budget
  allow, capped so the context fits ``max_model_len``);
- :meth:`TurnRules.take_tokens` — append a finished request's tokens and say whether the
  model turn is over, the budget is spent, or the ``max_model_len`` cap cut it short (the
  turn then continues in a new request);
- :meth:`TurnRules.end_turn` — parse the turn's calls and plan the answers (the calls to
  run, and the error answers known at once: parse errors, calls over
  ``max_parallel_calls``), or finish the trajectory (``answer``, ``max_turns``, ``budget``);
- :meth:`TurnRules.answer` — append the tool answers as the chat template renders them,
  each cut to ``max_tool_response_tokens``, all cut to the response budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verity.rollout.agent.config import AgentConfig
from verity.rollout.agent.executor import CallOutcome, CallRequest, error_answer
from verity.rollout.agent.render import ToolMessageRenderer
from verity.rollout.agent.tools import row_tool_kwargs
from verity.rollout.agent.trajectory import TrajectoryState
from verity.rollout.requests import GenerationRequest

__all__ = ["AnswerPlan", "TurnRules"]

TURN_OVER, CONTINUE, FINISHED = "turn_over", "continue", "finished"


@dataclass
class AnswerPlan:
    """The tool messages owed after one turn, in order: ``(tool name, call to run or answer known now)``."""

    slots: list[tuple[str, CallRequest | CallOutcome]] = field(default_factory=list)

    def calls(self) -> list[tuple[int, CallRequest]]:
        """``(slot, call)`` of the calls that must run."""
        return [(i, c) for i, (_, c) in enumerate(self.slots) if isinstance(c, CallRequest)]


class TurnRules:
    """Per-trajectory rules of the agent loop (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer.
        config: the :class:`AgentConfig`.
        parser: the tool-call parser (``text -> ParsedTurn``).
        renderer: renders tool messages to token ids.
        eos_token_ids: the tokens that end a model turn.
        budget: response tokens per trajectory (model and tool tokens).
        max_model_len: context + new tokens the engine accepts (None: no cap).
        ignore_eos: the sampling's ``ignore_eos`` (a stop token then ends no turn).
    """

    def __init__(
        self,
        tokenizer: Any,
        config: AgentConfig,
        parser: Any,
        renderer: ToolMessageRenderer,
        eos_token_ids: set[int],
        *,
        budget: int,
        max_model_len: int | None,
        ignore_eos: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.parser = parser
        self.renderer = renderer
        self.eos_token_ids = eos_token_ids
        self.budget = budget
        self.max_model_len = max_model_len
        self.ignore_eos = ignore_eos

    def turn_limit(self, state: TrajectoryState) -> int:
        """Tokens ``state`` may still write in its current turn (budget and ``max_turn_tokens``)."""
        left = self.budget - len(state.tokens)
        if self.config.max_turn_tokens:
            left = min(left, self.config.max_turn_tokens - len(state.turn_tokens))
        return left

    def request(self, state: TrajectoryState, request_id: int) -> GenerationRequest:
        """The next request of ``state``; ValueError when its context leaves no room under ``max_model_len``."""
        context = state.prompt + state.tokens
        limit = self.turn_limit(state)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - len(context))
        if limit < 1:
            raise ValueError(
                f"max_model_len={self.max_model_len}: a context of {len(context)} tokens "
                "leaves no room to generate; raise max_model_len or lower the budget"
            )
        return GenerationRequest(request_id, context, limit)

    def take_tokens(self, state: TrajectoryState, tokens: list[int], logprobs: list[float]) -> str:
        """Append a request's tokens (at most the turn limit); ``turn_over``, ``finished`` or ``continue``."""
        keep = max(0, min(len(tokens), self.turn_limit(state)))
        tokens = tokens[:keep]
        state.add_model(tokens, logprobs[:keep])
        if tokens and tokens[-1] in self.eos_token_ids and not self.ignore_eos:
            state.turn_over, state.stop_token = True, tokens[-1]
            return TURN_OVER
        if self.config.max_turn_tokens and len(state.turn_tokens) >= self.config.max_turn_tokens:
            state.turn_over = True
            return TURN_OVER
        if len(state.tokens) >= self.budget:
            self._close_turn(state, calls=[])
            state.finish("budget")
            return FINISHED
        return CONTINUE  # the max_model_len cap cut this turn short; it goes on in a new request

    def end_turn(self, state: TrajectoryState) -> AnswerPlan | None:
        """Close the ended turn; the answers it is owed, or None when the trajectory finished."""
        parsed = self.parser(self._turn_text(state))
        self._close_turn(state, parsed.calls)
        if parsed.attempted == 0:
            state.finish("answer")
            return None
        if state.turns >= self.config.max_turns:
            state.finish("max_turns")  # calls of the last allowed turn are not run
            return None
        if len(state.tokens) >= self.budget:
            state.finish("budget")
            return None
        state.tool_calls += parsed.attempted
        plan = AnswerPlan()
        for index, call in enumerate(parsed.calls):
            if index >= self.config.max_parallel_calls:
                limit = self.config.max_parallel_calls
                text = error_answer(f"at most {limit} tool call(s) per turn; this one was not run")
                plan.slots.append((call.name, CallOutcome(text, "too_many_calls")))
                continue
            kwargs = row_tool_kwargs(state.extra_info, call.name)
            plan.slots.append((call.name, CallRequest(call.name, call.arguments, kwargs)))
        for problem in parsed.errors:
            plan.slots.append(("parse", CallOutcome(error_answer(problem), "parse")))
        return plan

    def answer(self, state: TrajectoryState, named_outcomes: list[tuple[str, CallOutcome]]) -> bool:
        """Append the tool messages (in the plan's order); True when the trajectory goes on."""
        messages = []
        for name, outcome in named_outcomes:
            if not outcome.ok:
                state.tool_errors += 1
                state.error_kinds[outcome.status] += 1
            text = self._cut(outcome.text)
            messages.append({"role": "tool", "name": name, "content": text, "status": outcome.status})
        state.messages += messages
        stop_text = (
            self.tokenizer.decode([state.stop_token], skip_special_tokens=False)
            if state.stop_token is not None
            else None
        )
        rendered = self.renderer.encode(
            [{"role": m["role"], "name": m["name"], "content": m["content"]} for m in messages], stop_text
        )
        room = self.budget - len(state.tokens)
        state.add_tool(rendered[:room])
        if len(rendered) >= room:
            state.finish("budget")
            return False
        return True

    def _turn_text(self, state: TrajectoryState) -> str:
        tokens = state.turn_tokens
        if state.stop_token is not None:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _close_turn(self, state: TrajectoryState, calls: list[Any]) -> None:
        """Record the finished model turn as an assistant message."""
        message: dict[str, Any] = {"role": "assistant", "content": self._turn_text(state)}
        if calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        state.messages.append(message)
        state.turns += 1

    def _cut(self, text: str) -> str:
        """``text`` cut to ``max_tool_response_tokens`` tokens on the configured side."""
        limit = self.config.max_tool_response_tokens
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            return text
        side = self.config.tool_response_truncate_side
        if side == "left":
            kept = ids[-limit:]
            return "..." + self.tokenizer.decode(kept, skip_special_tokens=True)
        if side == "right":
            return self.tokenizer.decode(ids[:limit], skip_special_tokens=True) + "..."
        head, tail = ids[: limit // 2], ids[len(ids) - (limit - limit // 2) :]
        return (
            self.tokenizer.decode(head, skip_special_tokens=True)
            + "..."
            + self.tokenizer.decode(tail, skip_special_tokens=True)
        )
