"""The agent loop: multi-turn generation with tool calls around any rollout engine.

:class:`AgentRollout` is itself a :class:`~verity.rollout.base.RolloutEngine` that wraps
another one (``hf``, ``vllm``, ``sglang`` or a plug-in's) and uses only its interface. Each
row is a trajectory that advances on its own, request by request, through the engine's
:meth:`~verity.rollout.base.RolloutEngine.request_scheduler` (continuous batching)::

    every trajectory, independently, until it is finished:
        1. its context (prompt + response so far) is added to the scheduler as a request,
           asking for what its turn may still write;
        2. when the request finishes and the model turn ended (stop token, or
           max_turn_tokens), its tool calls are parsed (rollout.agent.tool_parser):
           no call -> finished ("answer"); the max_turns-th turn -> finished ("max_turns");
        3. its calls start at once (ToolExecutor: caps, queue, deadlines, errors as
           answers) while the engine goes on decoding the other trajectories;
        4. when all its answers are back they are appended as the chat template renders
           them (ToolMessageRenderer), cut to max_tool_response_tokens each and to the
           response budget, and its next request is added at once.

The event loop is :mod:`~verity.rollout.agent.scheduling` (with the turn-synchronous
``barrier`` policy it keeps for comparison and for ``tensor_parallel_size > 1``); the
per-trajectory rules are :class:`~verity.rollout.agent.turns.TurnRules`.

**Budget.** ``max_new_tokens`` (``data.max_response_length`` in training) counts every
response token, the model's and the tools'; a row whose budget runs out is finished
("budget"), also in the middle of a tool answer. Each request asks for what its row may
still write in its turn, capped so its context fits ``max_model_len`` (a context that
leaves no room raises ValueError); a turn cut short by that cap continues in a new
request. An engine may sample more and cut (cutting a sampled sequence at ``k`` tokens
is exactly sampling at most ``k`` tokens, so this changes no distribution).

**Output** (keys of ``verity.rollout.base``, plus the agent's): ``responses`` holds
model and tool tokens interleaved; ``response_mask`` is 1 on the model's tokens only, so
the tool tokens get no policy gradient and no KL or entropy term;
``attention_mask[:, P:]`` is 1 on both (the tool tokens are context); ``rollout_logprobs``
are the sampler's log-probs of the model's tokens (0 on tool tokens). Per row:
``num_turns``, ``tool_calls``, ``tool_errors`` ([B] int64), ``tool_wait_s`` and
``tool_queue_s`` ([B] float32 seconds: waiting for the row's tool answers, of which
queued behind busy workers), the call's ``agent_engine_busy_fraction``,
``agent_requests_in_flight_mean`` and ``agent_requests_in_flight_max`` ([B] float32, the
same on every row of one call, so rows of several workers concatenate) and
``trajectory`` (a dict: the turns as chat messages with the calls and the answers,
counters, why it stopped; :meth:`TrajectoryState.record`). Positions are
``cumsum(attention_mask) - 1`` in the engine and in the trainer alike, so the trainer's
log-prob of every model token is computed on the same context the sampler saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch

from verity.batch import Batch
from verity.rollout.agent.config import AgentConfig
from verity.rollout.agent.executor import ToolExecutor
from verity.rollout.agent.parsers import get_tool_parser
from verity.rollout.agent.render import ToolMessageRenderer
from verity.rollout.agent.scheduling import REQUEST_LEVEL, TURN_BARRIER, LoopStats, run_trajectories
from verity.rollout.agent.tools import resolve_tools
from verity.rollout.agent.trajectory import TrajectoryState, assemble
from verity.rollout.agent.turns import TurnRules
from verity.rollout.base import RolloutEngine
from verity.rollout.batch_io import build_rollout_output, read_prompt_rows, resolve_sampling
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
        self.last_stats: LoopStats | None = None  # what the last generate measured
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
        return self.generate_with_policy(batch, params, self._policy())

    def _policy(self) -> str:
        """``barrier`` when the engine's tensor-parallel ranks must step alike, else ``request``."""
        return TURN_BARRIER if self.engine.tensor_parallel_size > 1 else REQUEST_LEVEL

    def generate_with_policy(
        self, batch: Batch | Mapping[str, Any], params: SamplingParams | None, policy: str
    ) -> Batch:
        """:meth:`generate` with an explicit scheduling ``policy`` (``request`` | ``barrier``).

        The ``barrier`` (turn-synchronous) policy is internal: it is here for the benchmark
        and the tests that compare both (see :mod:`verity.rollout.agent.scheduling`).
        """
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
        rules = TurnRules(
            self.tokenizer,
            self.config,
            self.parser,
            self.renderer,
            self.eos_token_ids,
            budget=budget,
            max_model_len=self.max_model_len,
            ignore_eos=params.ignore_eos,
        )
        scheduler = self.engine.request_scheduler(replace(params, n=1))
        try:
            stats = run_trajectories(states, scheduler, self.executor, rules, policy)
        finally:
            scheduler.close()
        self.last_stats = stats
        responses, response_mask, attention, logprobs = assemble(states, budget, self.pad_token_id)
        out = build_rollout_output(rows, responses, response_mask, logprobs, response_attention=attention)
        out["num_turns"] = torch.tensor([s.turns for s in states], dtype=torch.long)
        out["tool_calls"] = torch.tensor([s.tool_calls for s in states], dtype=torch.long)
        out["tool_errors"] = torch.tensor([s.tool_errors for s in states], dtype=torch.long)
        # tool-answer tokens: attended in the response window but not the model's (not trained)
        out["tool_tokens"] = (attention.long().sum(-1) - response_mask.long().sum(-1)).cpu()
        out["response_attention"] = attention.long().cpu()  # what the reward decodes: model and tool tokens
        out["tool_wait_s"] = torch.tensor(stats.tool_wait_s, dtype=torch.float32)
        out["tool_queue_s"] = torch.tensor(stats.tool_queue_s, dtype=torch.float32)
        rows_of_call = len(states)
        for key, value in (
            ("agent_engine_busy_fraction", stats.busy_fraction),
            ("agent_requests_in_flight_mean", stats.in_flight_mean),
            ("agent_requests_in_flight_max", float(stats.in_flight_max)),
        ):
            out[key] = torch.full((rows_of_call,), value, dtype=torch.float32)
        out.non_tensors["trajectory"] = [s.record() for s in states]
        return out

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.executor.close()
