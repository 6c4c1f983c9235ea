"""Tools for the agent loop's tests that import nothing heavy (a tool process starts fast).

``light_tools(hang_timeout_s, caps)`` gives ``rollout.agent.tools`` entries for them and the
built-in calculator.
"""

from __future__ import annotations

import json
import time
from typing import Any


def echo(arguments: dict[str, Any], **row_kwargs: Any) -> str:
    """Answers with its ``text`` argument."""
    return json.dumps({"text": arguments.get("text")})


def hang(arguments: dict[str, Any], **row_kwargs: Any) -> str:
    """Never answers."""
    time.sleep(3600)
    return "late"


def fail(arguments: dict[str, Any], **row_kwargs: Any) -> str:
    """Raises an ordinary exception."""
    raise RuntimeError("the index is offline")


def flood(arguments: dict[str, Any], **row_kwargs: Any) -> str:
    """Answers with 8 MB of text."""
    return "y" * (8 << 20)


def stamp(arguments: dict[str, Any], **row_kwargs: Any) -> str:
    """Sleeps ``float(text)`` seconds; answers ``<start>,<end>`` (``time.monotonic``, machine-wide)."""
    start = time.monotonic()
    time.sleep(float(arguments.get("text") or 0))
    return f"{start:.6f},{time.monotonic():.6f}"


def light_tools(hang_timeout_s: float = 3.0, caps: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """``rollout.agent.tools`` entries: calculator and the tools above (``caps``: max_concurrent by name)."""
    caps = caps or {}
    schema = {"type": "object", "properties": {"text": {"type": "string"}}}
    entries: list[dict[str, Any]] = [{"class_name": "calculator", "timeout_s": 120.0}]
    for name in ("echo", "hang", "fail", "flood", "stamp"):
        entries.append(
            {
                "class_name": f"helpers.light_tools:{name}",
                "tool_schema": {"type": "function", "function": {"name": name, "parameters": schema}},
                "timeout_s": hang_timeout_s if name == "hang" else 120.0,
                "max_concurrent": caps.get(name),
            }
        )
    return entries
