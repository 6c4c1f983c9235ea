"""The built-in ``python`` tool: run the model's code in the code sandbox, answer with its output.

Every call is one run of :func:`verity.rewards.sandbox.run_python` — the sandbox the
code reward uses — so its confinement applies to every call: a fresh process in its
own session and working folder, CPU / memory / file-size / process / open-file limits,
no network where the kernel allows a network namespace, an unprivileged uid when
running as root, output read back capped, and the whole session killed at the wall
time limit (``verity.rewards.sandbox`` says what holds in which case).

Settings (``config``): any :class:`~verity.rewards.sandbox.SandboxLimits` field
(``wall_s`` default 5, ``cpu_s`` 4, ``memory_mb`` 512 here, ...) and ``max_output_chars``
(default 2000: the answer keeps the last that many characters of stdout). ``wall_s`` must be
below the tool's timeout (``timeout_s`` / ``rollout.agent.tool_timeout_s``), so the
sandbox ends a runaway program before the tool's process is killed.

Answer: the program's stdout. A program that fails (non-zero exit, killed at a limit,
timed out) is an error answer (:class:`ToolError`) carrying the last lines of its
stderr, so it is counted among the tool errors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from verity.rollout.agent.tools import Tool, ToolError

__all__ = ["PythonTool"]

_DEFAULT_MEMORY_MB = 512


class PythonTool(Tool):
    """``python(code)``: runs ``code`` in the sandbox; answers with its stdout."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python program and return what it prints (standard library only, no network).",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the program; print the result"}},
                "required": ["code"],
            },
        },
    }

    @staticmethod
    def _limit_fields() -> set[str]:
        from verity.rewards.sandbox import SandboxLimits

        return {f.name for f in dataclasses.fields(SandboxLimits)}

    @classmethod
    def limits_of(cls, config: dict[str, Any]) -> Any:
        """The :class:`SandboxLimits` of a config (memory defaults to 512 MiB)."""
        from verity.rewards.sandbox import SandboxLimits

        values = {k: v for k, v in config.items() if k in cls._limit_fields()}
        values.setdefault("memory_mb", _DEFAULT_MEMORY_MB)
        return SandboxLimits(**values)

    @classmethod
    def check_config(cls, config: dict[str, Any], timeout_s: float) -> None:
        """Unknown settings, invalid limits, or a wall limit not below the tool's timeout raise ValueError."""
        known = cls._limit_fields() | {"max_output_chars"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"python: unknown setting(s) {unknown}; settings: {sorted(known)}")
        limits = cls.limits_of(config)
        if limits.wall_s >= timeout_s:
            raise ValueError(
                f"python: wall_s={limits.wall_s} must be below the tool's timeout ({timeout_s} s), "
                "so the sandbox stops a program before its process is killed"
            )
        chars = config.get("max_output_chars", 2000)
        if not isinstance(chars, int) or chars < 1:
            raise ValueError(f"python: max_output_chars must be an int >= 1, got {chars!r}")

    def execute(self, arguments: dict[str, Any], **row_kwargs: Any) -> str:
        """Run ``arguments["code"]`` in the sandbox (see the module docstring)."""
        from verity.rewards.sandbox import run_python

        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("code must be a non-empty string")
        result, _ = run_python(code, limits=self.limits_of(self.config))
        keep = int(self.config.get("max_output_chars", 2000))
        if result.status != "ok":
            tail = "\n".join(result.stderr.strip().splitlines()[-3:])[-keep:]
            what = {
                "timeout": "the program ran out of time",
                "signal": f"the program was killed (signal {-(result.returncode or 0)})",
            }.get(result.status, f"the program failed (exit code {result.returncode})")
            raise ToolError(f"{what}" + (f": {tail}" if tail else ""))
        return result.stdout[-keep:] if len(result.stdout) > keep else result.stdout
