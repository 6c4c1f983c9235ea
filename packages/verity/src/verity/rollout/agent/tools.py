"""Tools: what a tool is, the built-in ones by name, and resolving the configured tools.

A tool is either

- a class ``Tool(config: dict)`` with ``execute(self, arguments: dict, **row_kwargs) -> str``
  (subclass :class:`Tool` or not; a class attribute ``default_schema`` gives its OpenAI
  function schema when the config leaves ``tool_schema`` empty), or
- a function ``fn(arguments: dict, **row_kwargs) -> str`` (its ``tool_schema`` is required
  and its ``config`` must be empty).

``arguments`` are the JSON arguments the model wrote, already checked against the
schema; ``row_kwargs`` are the row's own settings for this tool, taken from the data set
as verl's multi-turn data sets carry them::

    extra_info = {"tools_kwargs": {"<tool name>": {"create_kwargs": {...}, "execute_kwargs": {...}}}}

(``create_kwargs`` and ``execute_kwargs`` are merged, ``execute_kwargs`` winning; verity's
tools are stateless per call, so there is no separate create/release step.) A tool
answers with text. To answer with an error the model should see, it raises
:class:`ToolError`; any other exception, a non-text result, a crash of its process or a
call that outlives its timeout is answered with an error message too, and counted
(:mod:`verity.rollout.agent.executor`).

Built-in tools (:data:`TOOLS`, names usable as ``class_name``): ``calculator``
(:mod:`verity.rollout.agent.calculator`) and ``python`` (:mod:`verity.rollout.agent.python_tool`).
A plug-in adds its own with :func:`register_tool`.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from verity.registry import Registry
from verity.rollout.agent.tool_schema import ToolSchema

__all__ = [
    "TOOLS",
    "Tool",
    "ToolError",
    "ToolSpec",
    "register_tool",
    "resolve_tools",
    "row_tool_kwargs",
]


class ToolError(Exception):
    """Raised by a tool to answer the model with an error message (the exception's text)."""


class Tool:
    """Base class of tools (optional): keeps ``config`` and declares ``execute``."""

    #: the tool's OpenAI function schema, used when the config gives none
    default_schema: dict[str, Any] | None = None

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    def execute(self, arguments: dict[str, Any], **row_kwargs: Any) -> str:
        """Run one call; return the answer text (raise :class:`ToolError` for an error answer)."""
        raise NotImplementedError


TOOLS: Registry[str] = Registry("tool")
"""Built-in and plug-in tools by short name -> import path (``pkg.module:Class``)."""


def register_tool(name: str, target: str) -> None:
    """Make the tool at import path ``target`` (``pkg.module:Class``) usable as ``class_name: <name>``."""
    TOOLS.add(name, target)


register_tool("calculator", "verity.rollout.agent.calculator:Calculator")
register_tool("python", "verity.rollout.agent.python_tool:PythonTool")


@dataclass(frozen=True)
class ToolSpec:
    """A resolved tool: its name (from its schema), schema, implementation path, settings and timeout.

    Picklable; the process that runs a call builds the tool from it (:func:`build_tool`).
    """

    name: str
    schema: ToolSchema
    target: str  # "pkg.module:Attribute"
    config: dict[str, Any]
    timeout_s: float
    max_concurrent: int | None = None  # calls of this tool running at once per rollout worker; None: no own cap

    def key(self) -> str:
        """What identifies the built tool inside one process (implementation and settings)."""
        return json.dumps([self.target, self.config], sort_keys=True, default=str)


def _normalise_target(class_name: str) -> str:
    """``pkg.module:Attr`` from a registered name, ``pkg.module:Attr`` or ``pkg.module.Attr``."""
    if class_name in TOOLS.names():
        return TOOLS.get(class_name)
    if ":" in class_name:
        return class_name
    module, _, attr = class_name.rpartition(".")
    if not module or not attr:
        raise ValueError(
            f"class_name {class_name!r}: expected a built-in tool ({', '.join(TOOLS.names())}) "
            "or an import path pkg.module.Class / pkg.module:Class / pkg.module:function"
        )
    return f"{module}:{attr}"


def import_target(target: str) -> Any:
    """The object at ``pkg.module:Attr`` (ImportError / AttributeError naming it)."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_tools(agent: Any) -> list[ToolSpec]:
    """The tools of an :class:`~verity.rollout.agent.config.AgentConfig`, each resolved and checked.

    Each implementation is imported; a class without ``execute`` or a function with
    settings is refused; each schema is parsed (a built-in's ``default_schema`` when the
    config gives none). Raises ValueError naming ``tools[i]`` and the problem, or a
    duplicate tool name.
    """
    specs: list[ToolSpec] = []
    for index, tool in enumerate(agent.tool_configs()):
        where = f"tools[{index}]"
        if not tool.class_name:
            raise ValueError(f"{where}.class_name: required (a built-in tool or an import path)")
        try:
            target = _normalise_target(tool.class_name)
        except ValueError as err:
            raise ValueError(f"{where}.{err}") from None
        try:
            impl = import_target(target)
        except (ImportError, AttributeError) as err:
            raise ValueError(
                f"{where}.class_name {tool.class_name!r}: cannot import {target}: {err}"
            ) from None
        if inspect.isclass(impl):
            if not callable(getattr(impl, "execute", None)):
                raise ValueError(f"{where}.class_name {tool.class_name!r}: the class has no execute() method")
            default = getattr(impl, "default_schema", None)
        elif callable(impl):
            if tool.config:
                raise ValueError(f"{where}.config: {target} is a function, it takes no settings")
            default = None
        else:
            raise ValueError(
                f"{where}.class_name {tool.class_name!r}: {target} is neither a class nor a function"
            )
        raw_schema = tool.tool_schema or default
        if not raw_schema:
            raise ValueError(f"{where}.tool_schema: required for {target} (it declares no default_schema)")
        schema = ToolSchema.from_openai(dict(raw_schema), where=f"{where}.tool_schema")
        timeout = agent.tool_timeout_s if tool.timeout_s is None else float(tool.timeout_s)
        if not timeout > 0:
            raise ValueError(f"{where}.timeout_s: expected > 0 seconds, got {tool.timeout_s!r}")
        cap = getattr(tool, "max_concurrent", None)
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"{where}.max_concurrent: expected null or an int >= 1, got {cap!r}")
        spec = ToolSpec(schema.name, schema, target, dict(tool.config), timeout, cap)
        _check_tool_settings(spec, impl, where)
        specs.append(spec)
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tools: tool names must be unique, {duplicates} appear more than once")
    return specs


def _check_tool_settings(spec: ToolSpec, impl: Any, where: str) -> None:
    """A tool class may check its own settings (``check_config(config, timeout_s)`` raising ValueError)."""
    check = getattr(impl, "check_config", None)
    if inspect.isclass(impl) and callable(check):
        try:
            check(spec.config, spec.timeout_s)
        except ValueError as err:
            raise ValueError(f"{where}.config: {err}") from None


_BUILT: dict[str, Callable[..., Any]] = {}


def build_tool(spec: ToolSpec) -> Callable[..., Any]:
    """The callable ``(arguments, **row_kwargs) -> answer`` of ``spec`` (built once per process)."""
    key = spec.key()
    if key not in _BUILT:
        impl = import_target(spec.target)
        _BUILT[key] = impl(spec.config).execute if inspect.isclass(impl) else impl
    return _BUILT[key]


def row_tool_kwargs(extra_info: Any, tool_name: str) -> dict[str, Any]:
    """The row's settings for ``tool_name``: ``extra_info.tools_kwargs[name]`` create + execute kwargs merged."""
    if not isinstance(extra_info, Mapping):
        return {}
    entry = (extra_info.get("tools_kwargs") or {}).get(tool_name) or {}
    if not isinstance(entry, Mapping):
        return {}
    merged: dict[str, Any] = {}
    for part in ("create_kwargs", "execute_kwargs"):
        value = entry.get(part) or {}
        if isinstance(value, Mapping):
            merged.update(value)
    return merged


def prompt_chat_template_kwargs(agent: Any) -> dict[str, Any] | None:
    """``{"tools": [OpenAI schemas]}`` for the chat template when prompts should list the tools, else None.

    Used when the data set renders prompts (``rollout.agent.enabled`` and ``tools_in_prompt``);
    templates that mention no tools (the embedded character model's) ignore it.
    """
    if not getattr(agent, "enabled", False) or not getattr(agent, "tools_in_prompt", False):
        return None
    return {"tools": [spec.schema.to_openai() for spec in resolve_tools(agent)]}
