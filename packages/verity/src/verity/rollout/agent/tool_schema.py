"""A tool's OpenAI function schema, and checking a call's arguments against it.

The schema is the one OpenAI's chat API, Hugging Face chat templates (``tools=``) and
verl's tool configs use::

    {"type": "function",
     "function": {"name": "calculator",
                  "description": "Evaluate an arithmetic expression.",
                  "parameters": {"type": "object",
                                 "properties": {"expression": {"type": "string"}},
                                 "required": ["expression"]}}}

Arguments are checked against the subset of JSON Schema that function schemas use in
practice: ``type`` (string, number, integer, boolean, object, array, null, or a list of
them), ``required``, ``enum``, ``properties`` (checked recursively), ``items`` and
``additionalProperties: false``. Anything else in the schema is passed to the chat
template but not enforced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolSchema", "argument_problems"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_JSON_TYPES = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class ToolSchema:
    """A function tool: ``name``, ``description`` and JSON-schema ``parameters`` (an object schema)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def from_openai(cls, schema: dict[str, Any], where: str = "tool_schema") -> ToolSchema:
        """Parse ``{"type": "function", "function": {...}}`` (or the inner ``function`` dict alone).

        Raises ValueError naming ``where`` and the field at fault.
        """
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(schema).__name__}")
        if "function" in schema:
            if schema.get("type", "function") != "function":
                raise ValueError(f"{where}.type: expected 'function', got {schema.get('type')!r}")
            function = schema["function"]
        else:
            function = schema
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function: expected a mapping, got {type(function).__name__}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                f"{where}.function.name: expected a name of letters, digits, '_', '.', '-' "
                f"(at most 64, not starting with a digit), got {name!r}"
            )
        description = function.get("description", "")
        if not isinstance(description, str):
            raise ValueError(
                f"{where}.function.description: expected a str, got {type(description).__name__}"
            )
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        _check_parameters(parameters, f"{where}.function.parameters")
        return cls(name=name, description=description, parameters=dict(parameters))

    def to_openai(self) -> dict[str, Any]:
        """The schema in OpenAI's form (what a chat template's ``tools=`` takes)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _check_parameters(parameters: Any, where: str) -> None:
    if not isinstance(parameters, dict):
        raise ValueError(f"{where}: expected a JSON-schema mapping, got {type(parameters).__name__}")
    if parameters.get("type", "object") != "object":
        raise ValueError(
            f"{where}.type: a function's parameters must be an 'object', got {parameters.get('type')!r}"
        )
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, dict) for v in properties.values()):
        raise ValueError(f"{where}.properties: expected a mapping of name -> schema")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required: expected a list of property names, got {required!r}")
    missing = [r for r in required if r not in properties]
    if missing:
        raise ValueError(f"{where}.required: {missing} are not in properties {sorted(properties)}")
    for name, prop in properties.items():
        for kind in _types_of(prop):
            if kind not in _JSON_TYPES:
                raise ValueError(
                    f"{where}.properties.{name}.type: expected one of {sorted(_JSON_TYPES)}, got {kind!r}"
                )


def _types_of(schema: dict[str, Any]) -> list[str]:
    kind = schema.get("type")
    if kind is None:
        return []
    return list(kind) if isinstance(kind, list) else [kind]


def _matches_type(value: Any, kind: str) -> bool:
    if kind in ("number", "integer") and isinstance(value, bool):
        return False  # JSON booleans are not numbers
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES[kind])


def argument_problems(arguments: Any, schema: dict[str, Any], path: str = "arguments") -> list[str]:
    """What is wrong with ``arguments`` under the JSON schema ``schema`` (empty when they fit).

    See the module docstring for the keywords that are checked.
    """
    problems: list[str] = []
    kinds = _types_of(schema)
    if kinds and not any(_matches_type(arguments, k) for k in kinds if k in _JSON_TYPES):
        shown = "|".join(kinds)
        return [f"{path}: expected {shown}, got {type(arguments).__name__}"]
    if "enum" in schema and arguments not in schema["enum"]:
        problems.append(f"{path}: expected one of {schema['enum']!r}, got {arguments!r}")
    if isinstance(arguments, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in arguments:
                problems.append(f"{path}.{name}: required")
        if schema.get("additionalProperties") is False:
            extra = sorted(set(arguments) - set(properties))
            if extra:
                problems.append(f"{path}: unexpected {extra} (allowed: {sorted(properties)})")
        for name, value in arguments.items():
            if name in properties:
                problems += argument_problems(value, properties[name], f"{path}.{name}")
    if isinstance(arguments, list) and isinstance(schema.get("items"), dict):
        for index, value in enumerate(arguments):
            problems += argument_problems(value, schema["items"], f"{path}[{index}]")
    return problems
