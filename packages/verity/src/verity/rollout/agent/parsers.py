"""Reading tool calls from the text of one model turn: a registry of parsers, ``hermes`` by default.

A parser is a function ``parse(text) -> ParsedTurn``: the calls found (name + JSON
arguments) and the malformed attempts (each answered with an error message and
counted as a failed call). ``rollout.agent.tool_parser`` names one; a plug-in adds its
own with :func:`register_tool_parser`.

``hermes`` — the format of Qwen2.5/Qwen3 and Hermes models (and verl's default)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

Every ``<tool_call>...</tool_call>`` block is one call; its body must be a JSON object
with a string ``name`` and an object ``arguments`` (a JSON string holding an object is
accepted too; missing ``arguments`` means ``{}``). An opening tag without its closing
tag is a malformed call. Text outside the blocks is ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verity.registry import Registry

__all__ = [
    "TOOL_PARSERS",
    "ParsedTurn",
    "ToolCall",
    "get_tool_parser",
    "parse_hermes",
    "register_tool_parser",
]


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's ``name`` and its ``arguments`` (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """The calls found in one turn, and the malformed attempts (one message each, for the model)."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def attempted(self) -> int:
        """Calls the model tried to make, well-formed or not."""
        return len(self.calls) + len(self.errors)


ToolParser = Callable[[str], ParsedTurn]
TOOL_PARSERS: Registry[ToolParser] = Registry("tool-call parser")


def register_tool_parser(name: str, parser: ToolParser) -> None:
    """Make ``parser(text) -> ParsedTurn`` available as ``rollout.agent.tool_parser: <name>``."""
    TOOL_PARSERS.add(name, parser)


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name`` (``UnknownNameError`` lists the known ones)."""
    return TOOL_PARSERS.get(name)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)


def _call_from_json(body: str) -> ToolCall | str:
    """A call from the JSON body of one block, or the problem as text."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as err:
        return f"the tool call is not valid JSON ({err.msg} at character {err.pos})"
    if not isinstance(data, dict):
        return f"the tool call must be a JSON object with 'name' and 'arguments', got {type(data).__name__}"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return "the tool call has no 'name' string"
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f"the arguments of {name!r} are a string that is not a JSON object"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name, arguments)


def parse_hermes(text: str) -> ParsedTurn:
    """The ``<tool_call>{json}</tool_call>`` calls of ``text`` (see the module docstring)."""
    turn = ParsedTurn()
    for match in _BLOCK.finditer(text):
        found = _call_from_json(match.group(1).strip())
        if isinstance(found, ToolCall):
            turn.calls.append(found)
        else:
            turn.errors.append(found)
    rest = _BLOCK.sub("", text)
    if _OPEN in rest:
        turn.errors.append(f"a {_OPEN} is not closed by {_CLOSE}")
    return turn


register_tool_parser("hermes", parse_hermes)
