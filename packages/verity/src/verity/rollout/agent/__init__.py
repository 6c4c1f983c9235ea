"""verity.rollout.agent: multi-turn rollouts with tool calls, around any rollout engine.

``rollout.agent.enabled=true`` wraps the run's rollout engine (``hf``, ``vllm``, ...) in
:class:`~verity.rollout.agent.loop.AgentRollout` (through the rollout-wrapper seam of
:mod:`verity.rollout.registry`): the model writes, its tool calls are parsed
(:mod:`~verity.rollout.agent.parsers`), run with deadlines
(:mod:`~verity.rollout.agent.executor`), answered through the chat template
(:mod:`~verity.rollout.agent.render`), and generation goes on. Tool tokens are context,
not trained: ``response_mask`` covers the model's tokens only. Built-in tools:
``calculator`` and ``python`` (the code sandbox). See ``docs/agent-loop.md``.
"""

from __future__ import annotations

from verity.rollout.agent.config import AgentConfig, ToolConfig
from verity.rollout.agent.parsers import TOOL_PARSERS, ParsedTurn, ToolCall, register_tool_parser
from verity.rollout.agent.tools import TOOLS, Tool, ToolError, register_tool

__all__ = [
    "TOOLS",
    "TOOL_PARSERS",
    "AgentConfig",
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolConfig",
    "ToolError",
    "register_tool",
    "register_tool_parser",
]
