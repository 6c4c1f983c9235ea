"""The agent loop: multi-turn generation with tool calls around any rollout engine.

:class:`AgentRollout` is itself a :class:`~verity.rollout.base.RolloutEngine` that wraps
another one (``hf``, ``vllm``, ``sglang`` or a plug-in's) and uses only its interface::

    repeat until every row is finished:
        1. generate: one engine call for all unfinished rows, each row's context being
           its prompt + its response so far (left-padded, as any prompt);
        2. for each row whose model turn ended (stop token, or max_turn_tokens):
           parse its tool calls (rollout.agent.tool_parser);
           no call -> finished ("answer"); the max_turns-th turn -> finished ("max_turns");
        3. run all rows' calls together (ToolExecutor: deadlines, errors as answers);
        4. append each row's tool answers as the chat template renders them (ToolMessageRenderer),
           cut to max_tool_response_tokens each and to the response budget.

**Budget.** ``max_new_tokens`` (``data.max_response_length`` in training) counts every
response token, the model's and the tools'; a row whose budget runs out is finished
("budget"), also in the middle of a tool answer. Each engine call asks for the largest
number of tokens any unfinished row may still write in its turn (capped so the longest
context fits ``max_model_len``) and each row keeps what it may; cutting a sampled
sequence at ``k`` tokens is exactly sampling at most ``k`` tokens, so this changes no
distribution. A row cut short by the ``max_model_len`` cap continues its turn in the
next call.

**Output** (keys of ``verity.rollout.base``, plus the agent's): ``responses`` holds
model and tool tokens interleaved; ``response_mask`` is 1 on the model's tokens only, so
the tool tokens get no policy gradient and no KL or entropy term;
``attention_mask[:, P:]`` is 1 on both (the tool tokens are context); ``rollout_logprobs``
are the sampler's log-probs of the model's tokens (0 on tool tokens). Per row:
``num_turns``, ``tool_calls``, ``tool_errors`` ([B] int64) and ``trajectory`` (a dict:
the turns as chat messages with the calls and the answers, counters, why it stopped;
:meth:`TrajectoryState.record`). Positions are ``cumsum(attention_mask) - 1`` in the
engine calls and in the trainer alike, so the trainer's log-prob of every model token
is computed on the same context the sampler saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch

from verity.batch import Batch
from verity.rollout.agent.config import AgentConfig
from verity.rollout.agent.executor import CallOutcome, CallRequest, ToolExecutor, error_answer
from verity.rollout.agent.parsers import get_tool_parser
from verity.rollout.agent.render import ToolMessageRenderer
from verity.rollout.agent.tools import resolve_tools, row_tool_kwargs
from verity.rollout.agent.trajectory import TrajectoryState, assemble
from verity.rollout.base import RolloutEngine
from verity.rollout.batch_io import build_rollout_output, read_prompt_rows, resolve_sampling
from verity.rollout.prompts import left_pad
from verity.rollout.sampling import SamplingParams

__all__ = ["AgentRollout"]


class AgentRollout(RolloutEngine):
    """Multi-turn rollouts with tools around ``engine`` (see the module docstring).

    Args:
        engine: any rollout engine; its ``name`` stays the run's recorded backend.
        tokenizer: the policy's tokenizer (chat template, stop and pad tokens).
        config: the :class:`AgentConfig` (``rollout.agent``); validated here.
        max_model_len: prompt + response tokens the engine accepts (None: no cap).
    """

    def __init__(
        self, engine: RolloutEngine, tokenizer: Any, config: AgentConfig, *, max_model_len: int | None = None
    ) -> None:
        config.validate()
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = max_model_len
        self.wrappers = (*engine.wrappers, "agent")
        self.parser = get_tool_parser(config.tool_parser)
        self.renderer = ToolMessageRenderer(tokenizer)
        self.executor = ToolExecutor(resolve_tools(config), workers=config.tool_workers)
        eos = engine.eos_token_ids or [tokenizer.eos_token_id]
        self.eos_token_ids = {int(i) for i in eos if i is not None}
        pad = engine.pad_token_id
        self.pad_token_id = int(
            pad if pad is not None else (tokenizer.pad_token_id or min(self.eos_token_ids))
        )

    # ------------------------------------------------------------------ delegation
    @property
    def name(self) -> str:  # type: ignore[override]
        """The wrapped engine's name (what the run records as the rollout backend)."""
        return self.engine.name

    @property
    def serving_dtype(self) -> str | None:
        """The wrapped engine's serving dtype."""
        return self.engine.serving_dtype

    @property
    def serving_attention(self) -> str | None:
        """The wrapped engine's attention kernel."""
        return self.engine.serving_attention

    @property
    def sampling(self) -> SamplingParams:  # type: ignore[override]
        """The wrapped engine's default sampling parameters."""
        return self.engine.sampling

    @property
    def tensor_parallel_size(self) -> int:  # type: ignore[override]
        """The wrapped engine's tensor-parallel size (the weight sync sends it slices when > 1)."""
        return self.engine.tensor_parallel_size

    @property
    def receives_slices(self) -> bool:  # type: ignore[override]
        """Whether the wrapped engine takes only its tensor-parallel slices from the weight sync."""
        return self.engine.receives_slices

    def weight_bytes(self) -> int | None:
        """The wrapped engine's weight bytes on its device, where it counts them."""
        count = getattr(self.engine, "weight_bytes", None)
        return int(count()) if callable(count) else None

    def set_seed(self, seed: int) -> None:
        """Restart the wrapped engine's random stream."""
        self.engine.set_seed(seed)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """New weights go to the wrapped engine."""
        return self.engine.load_weights(named_tensors)

    def sleep(self) -> None:
        """Free the wrapped engine's memory."""
        self.engine.sleep()

    def wake(self) -> None:
        """Bring the wrapped engine's memory back."""
        self.engine.wake()

    @property
    def needs_weight_sync(self) -> bool:
        """Whether the wrapped engine waits for a weight sync (it released its weights while asleep)."""
        return self.engine.needs_weight_sync

    def close(self) -> None:
        """Stop the tool processes and close the wrapped engine (when it can be closed)."""
        self.executor.close()
        self.engine.close()

    # ------------------------------------------------------------------ the loop
    def generate(self, batch: Batch | Mapping[str, Any], params: SamplingParams | None = None) -> Batch:
        """Multi-turn responses for left-padded prompts (keys and shapes in the module docstring)."""
        params = resolve_sampling(batch, self.sampling, params)
        rows = read_prompt_rows(batch, params.n)
        budget = params.max_new_tokens
        mask = rows.prompt_mask.bool().cpu()
        ids = rows.prompt_ids.cpu()
        extras = rows.non_tensors.get("extra_info") or [None] * ids.shape[0]
        states = [
            TrajectoryState(prompt=ids[i][mask[i]].tolist(), extra_info=extras[i])
            for i in range(ids.shape[0])
        ]
        while any(not s.done for s in states):
            active = [s for s in states if not s.done]
            self._model_step(active, params, budget)
            self._tool_step([s for s in active if s.turn_over], budget)
        responses, response_mask, attention, logprobs = assemble(states, budget, self.pad_token_id)
        out = build_rollout_output(rows, responses, response_mask, logprobs, response_attention=attention)
        out["num_turns"] = torch.tensor([s.turns for s in states], dtype=torch.long)
        out["tool_calls"] = torch.tensor([s.tool_calls for s in states], dtype=torch.long)
        out["tool_errors"] = torch.tensor([s.tool_errors for s in states], dtype=torch.long)
        # tool-answer tokens: attended in the response window but not the model's (not trained)
        out["tool_tokens"] = (attention.long().sum(-1) - response_mask.long().sum(-1)).cpu()
        out["response_attention"] = attention.long().cpu()  # what the reward decodes: model and tool tokens
        out.non_tensors["trajectory"] = [s.record() for s in states]
        return out

    def _turn_limit(self, state: TrajectoryState, budget: int) -> int:
        """Tokens ``state`` may still write in its current turn."""
        left = budget - len(state.tokens)
        if self.config.max_turn_tokens:
            left = min(left, self.config.max_turn_tokens - len(state.turn_tokens))
        return left

    def _model_step(self, active: list[TrajectoryState], params: SamplingParams, budget: int) -> None:
        """One engine call for every active row; each row keeps at most its own limit."""
        limits = [self._turn_limit(s, budget) for s in active]
        contexts = [s.prompt + s.tokens for s in active]
        new_tokens = max(limits)
        if self.max_model_len is not None:
            new_tokens = min(new_tokens, self.max_model_len - max(len(c) for c in contexts))
        if new_tokens < 1:
            raise ValueError(
                f"max_model_len={self.max_model_len}: a context of {max(len(c) for c in contexts)} tokens "
                "leaves no room to generate; raise max_model_len or lower the budget"
            )
        input_ids, attention_mask = left_pad(contexts, self.pad_token_id)
        out = self.engine.generate(
            {"input_ids": input_ids, "attention_mask": attention_mask},
            replace(params, n=1, max_new_tokens=new_tokens),
        )
        responses, lengths = out["responses"].cpu(), out["response_mask"].cpu().sum(-1)
        logprobs = out["rollout_logprobs"].cpu()
        for row, (state, limit) in enumerate(zip(active, limits, strict=True)):
            keep = min(int(lengths[row]), limit)
            tokens = responses[row, :keep].tolist()
            state.add_model(tokens, logprobs[row, :keep].tolist())
            if tokens and tokens[-1] in self.eos_token_ids and not params.ignore_eos:
                state.turn_over, state.stop_token = True, tokens[-1]
            elif self.config.max_turn_tokens and len(state.turn_tokens) >= self.config.max_turn_tokens:
                state.turn_over = True
            elif len(state.tokens) >= budget:
                self._close_turn(state, calls=[])
                state.finish("budget")
            # else: the max_model_len cap cut this row short; its turn continues in the next call

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

    def _tool_step(self, ended: list[TrajectoryState], budget: int) -> None:
        """Parse the ended turns, run their calls together, append the answers."""
        requests: list[CallRequest] = []
        plans: list[tuple[TrajectoryState, list[tuple[str, int | CallOutcome]]]] = []
        for state in ended:
            parsed = self.parser(self._turn_text(state))
            self._close_turn(state, parsed.calls)
            if parsed.attempted == 0:
                state.finish("answer")
                continue
            if state.turns >= self.config.max_turns:
                state.finish("max_turns")  # calls of the last allowed turn are not run
                continue
            if len(state.tokens) >= budget:
                state.finish("budget")
                continue
            state.tool_calls += parsed.attempted
            answers: list[tuple[str, int | CallOutcome]] = []
            for index, call in enumerate(parsed.calls):
                if index >= self.config.max_parallel_calls:
                    limit = self.config.max_parallel_calls
                    text = error_answer(f"at most {limit} tool call(s) per turn; this one was not run")
                    answers.append((call.name, CallOutcome(text, "too_many_calls")))
                    continue
                answers.append((call.name, len(requests)))
                requests.append(
                    CallRequest(call.name, call.arguments, row_tool_kwargs(state.extra_info, call.name))
                )
            for problem in parsed.errors:
                answers.append(("parse", CallOutcome(error_answer(problem), "parse")))
            plans.append((state, answers))
        outcomes = self.executor.run(requests) if requests else []
        for state, answers in plans:
            messages = []
            for name, answer in answers:
                outcome = outcomes[answer] if isinstance(answer, int) else answer
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
            room = budget - len(state.tokens)
            state.add_tool(rendered[:room])
            if len(rendered) >= room:
                state.finish("budget")

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

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.executor.close()
