"""The agent loop's settings: config section ``rollout.agent`` (off by default).

Plain dataclasses with no heavy imports, so the run config can hold them and check
them (:meth:`AgentConfig.validate`) before any worker starts. A tool is declared in
the form verl's tool config files use::

    rollout:
      agent:
        enabled: true
        max_turns: 3
        tools:
          - class_name: calculator              # a built-in tool, or an import path
            tool_schema: {}                     # {}: the built-in tool's own schema
          - class_name: my_package.tools.Search # pkg.module.Class, pkg.module:Class or :function
            config: {index: /data/index}        # given to the class's constructor
            timeout_s: 30
            max_concurrent: 4                   # calls of it running at once (null: tool_workers only)
            tool_schema:                        # the OpenAI function schema
              type: function
              function:
                name: search
                description: Search the corpus.
                parameters:
                  type: object
                  properties: {query: {type: string, description: what to look for}}
                  required: [query]

``tool_config_path`` reads the ``tools:`` list of such a YAML file (verl's
``tool_config_path``) and adds it to ``tools``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TRUNCATE_SIDES", "AgentConfig", "ToolConfig"]

TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass
class ToolConfig:
    """One tool: its implementation, its settings and its OpenAI function schema."""

    # a built-in tool (calculator | python) or an import path: pkg.module.Class, pkg.module:Class, pkg.module:function
    class_name: str = ""
    config: dict[str, Any] = field(
        default_factory=dict
    )  # the tool's own settings (its constructor's argument)
    # the OpenAI function schema {type: function, function: {name, description, parameters}}; {}: a built-in's own
    tool_schema: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None  # seconds one call may take; null: rollout.agent.tool_timeout_s
    # calls of this tool running at once per rollout worker (more wait in a queue); null: only the tool_workers cap
    max_concurrent: int | None = None


@dataclass
class AgentConfig:
    """The multi-turn agent loop around the rollout engine (``docs/agent-loop.md``)."""

    enabled: bool = False  # run the agent loop: the model's tool calls are executed and answered
    max_turns: int = 4  # model turns per response; tool calls written in the last turn are not run
    max_turn_tokens: int = 0  # tokens one model turn may write; 0: a turn ends at EOS or the response budget
    max_parallel_calls: int = 1  # tool calls run per model turn; further calls get an error message
    tool_parser: str = (
        "hermes"  # how tool calls are read from the model's text (verity.rollout.agent.parsers)
    )
    tools: list[ToolConfig] = field(default_factory=list)  # the tools the model may call
    tool_config_path: str | None = None  # a YAML file with a verl-style `tools:` list, added to `tools`
    tool_timeout_s: float = (
        10.0  # seconds one tool call may take before it is killed and answered with an error
    )
    # processes per rollout worker that run tool calls, so also its cap on calls running at once
    # (more wait in a queue); 0: in-process, one at a time, no time limit
    tool_workers: int = 1
    max_tool_response_tokens: int = 256  # a longer tool answer is cut to this many tokens
    tool_response_truncate_side: str = (
        "middle"  # which part of a long tool answer is dropped: left | right | middle
    )
    tools_in_prompt: bool = (
        True  # give the tool schemas to the chat template (tools=...) when prompts are rendered
    )

    def tool_configs(self) -> list[ToolConfig]:
        """``tools`` plus the tools of ``tool_config_path`` (in that order)."""
        tools = [t if isinstance(t, ToolConfig) else ToolConfig(**dict(t)) for t in self.tools]
        if self.tool_config_path:
            tools += read_tool_config_file(self.tool_config_path)
        return tools

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range (tools: see :func:`resolve_tools`).

        With ``enabled``, every tool is resolved: its schema parsed and its implementation
        imported, so a typo fails here rather than in a worker.
        """
        ints = {
            "max_turns": (self.max_turns, 1),
            "max_turn_tokens": (self.max_turn_tokens, 0),
            "max_parallel_calls": (self.max_parallel_calls, 1),
            "tool_workers": (self.tool_workers, 0),
            "max_tool_response_tokens": (self.max_tool_response_tokens, 1),
        }
        for name, (value, low) in ints.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s: expected > 0 seconds, got {self.tool_timeout_s!r}")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(
                f"tool_response_truncate_side: expected one of {'|'.join(TRUNCATE_SIDES)}, "
                f"got {self.tool_response_truncate_side!r}"
            )
        from verity.registry import UnknownNameError
        from verity.rollout.agent.parsers import TOOL_PARSERS

        try:
            TOOL_PARSERS.get(self.tool_parser)
        except UnknownNameError as err:
            raise ValueError(f"tool_parser: {err}") from None
        if not self.enabled:
            return
        from verity.rollout.agent.tools import resolve_tools

        specs = resolve_tools(self)
        if not specs:
            raise ValueError(
                "tools: the agent loop is enabled but no tool is declared (tools or tool_config_path)"
            )


def read_tool_config_file(path: str) -> list[ToolConfig]:
    """The ``tools:`` list of a verl-style tool config YAML, as :class:`ToolConfig` entries.

    Raises ValueError naming the file when it is missing, not YAML, or not of that form.
    """
    from pathlib import Path

    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"tool_config_path: {path!r} is not a file")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"tool_config_path: {path!r} is not valid YAML: {err}") from None
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"tool_config_path: {path!r} must hold a mapping with a 'tools:' list")
    out = []
    known = {"class_name", "config", "tool_schema", "timeout_s", "max_concurrent"}
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - known:
            extra = sorted(set(entry) - known) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(
                f"tool_config_path: {path!r} tools[{index}]: expected keys {sorted(known)}, got {extra}"
            )
        out.append(
            ToolConfig(
                class_name=str(entry.get("class_name", "")),
                config=dict(entry.get("config") or {}),
                tool_schema=dict(entry.get("tool_schema") or {}),
                timeout_s=entry.get("timeout_s"),
                max_concurrent=entry.get("max_concurrent"),
            )
        )
    return out
