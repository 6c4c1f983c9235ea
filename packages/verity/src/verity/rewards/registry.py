"""Which reward function scores a sample: dispatch by ``data_source``, plus user functions.

A reward function is named by a *spec* string, so that it can be sent to a
worker process and loaded there:

- a built-in name: ``"gsm8k_strict"``, ``"math_verify"``, ``"code_sandbox"``, ... (see
  :data:`BUILTIN_NAMES`);
- ``"package.module:function"`` — an importable function;
- ``"/path/to/file.py:function"`` — a function in a Python file (loaded by path);
- ``"task:<name>"`` — the verifier of a synthetic task registered in :mod:`verity.data.task_registry`.

:func:`resolve_spec` picks the spec for a ``data_source``: a user function
(``custom_reward``) wins for every source, then per-source ``overrides``, then
:data:`DEFAULT_REWARD_TABLE`, then :data:`PREFIX_RULES`, then synthetic tasks
(``verity/<task>``). An unknown source is an error raised before any scoring.

A reward function has the verl signature ``fn(data_source, solution_str,
ground_truth, extra_info=None, **kwargs)``, may be ``async``, and returns a
number or a dict with ``score`` and any extra metrics (:func:`call_reward`).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
import threading
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

RewardFunction = Callable[..., Any]

_CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco", "code", "livecodebench", "primeintellect")

DEFAULT_REWARD_TABLE: dict[str, str] = {
    "openai/gsm8k": "gsm8k_strict",
    "gsm8k": "gsm8k_strict",
    "lighteval/MATH": "math_boxed",
    "DigitalLearningGmbH/MATH-lighteval": "math_boxed",
    "HuggingFaceH4/MATH-500": "math_boxed",
    "math": "math_boxed",
    "math_verify": "math_verify",
    "math_dapo": "dapo",
    "math_dapo_reasoning": "dapo",
    "aime": "aime",
    "hiyouga/geometry3k": "geo3k",  # verl's geo3k preprocessing
    "geometry3k": "geo3k",
    **{name: "code_sandbox" for name in _CODE_SOURCES},
}
"""Exact ``data_source`` -> reward spec."""

PREFIX_RULES: tuple[tuple[str, str], ...] = (
    ("aime", "aime"),  # aime2024, aime_2025, ...
    ("numina_", "math_verify"),
    ("code_", "code_sandbox"),
)
"""``(prefix, spec)`` tried in order when the exact table has no entry."""

BUILTIN_NAMES: tuple[str, ...] = (
    "gsm8k_strict",
    "gsm8k_flexible",
    "math_boxed",
    "math_verify",
    "dapo",
    "aime",
    "geo3k",
    "code_sandbox",
)


class UnknownDataSourceError(ValueError):
    """No reward function is configured for a ``data_source``."""


class RewardResultError(TypeError):
    """A reward function returned something that is not a score."""


def _task_names() -> dict[str, str]:
    """``data_source`` -> task name for the registered synthetic tasks (empty when no plug-in registers any)."""
    from verity.data.task_registry import synthetic_tasks

    out = {}
    for name, module in synthetic_tasks().items():
        out[getattr(module, "DATA_SOURCE", f"verity/{name}")] = name
    return out


def resolve_spec(
    data_source: str,
    overrides: Mapping[str, str] | None = None,
    custom_spec: str | None = None,
) -> str:
    """The reward spec that scores samples of ``data_source`` (see the module docstring for the order).

    Raises UnknownDataSourceError naming the source and the known ones when nothing matches.
    """
    if custom_spec:
        return custom_spec
    if overrides and data_source in overrides:
        return overrides[data_source]
    if data_source in DEFAULT_REWARD_TABLE:
        return DEFAULT_REWARD_TABLE[data_source]
    for prefix, spec in PREFIX_RULES:
        if data_source.startswith(prefix):
            return spec
    tasks = _task_names()
    if data_source in tasks:
        return f"task:{tasks[data_source]}"
    known = sorted(set(DEFAULT_REWARD_TABLE) | set(tasks) | set(overrides or {}))
    raise UnknownDataSourceError(
        f"data_source {data_source!r}: no reward function for it; known sources: {known}, "
        f"prefixes: {[p for p, _ in PREFIX_RULES]}. Map it with '+reward.overrides={{{data_source}: SPEC}}' "
        "(SPEC: a built-in name, module:function or file.py:function), or score every source with "
        "reward.custom_path=FILE.py reward.custom_name=FUNCTION."
    )


def custom_spec_from(path: str | None, name: str | None) -> str | None:
    """The spec of a user function given as a file path (or module) and a function name; None when no path."""
    if not path:
        return None
    return f"{path}:{name or 'compute_score'}"


def _load_file_function(path: str, name: str) -> RewardFunction:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"custom reward path: {path!r} is not a file")
    module_name = "verity_user_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"custom reward path: cannot load {path!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    function = getattr(module, name, None)
    if not callable(function):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise AttributeError(f"custom reward name: {path!r} has no function {name!r}; it defines {public}")
    return function


def _task_function(task_name: str) -> RewardFunction:
    from verity.data.task_registry import synthetic_tasks

    tasks = synthetic_tasks()
    if task_name not in tasks:
        raise KeyError(f"task {task_name!r}: unknown; known tasks: {tasks.names()}")
    score = tasks.get(task_name).score

    def task_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **_: Any):
        return score(solution_str, ground_truth)

    return task_reward


@lru_cache(maxsize=256)
def load_reward_function(spec: str) -> RewardFunction:
    """Load the function a spec names (cached per process). Raises ValueError/ImportError/AttributeError."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward spec: expected a non-empty string, got {spec!r}")
    if spec == "code_sandbox":
        from verity.rewards.code import code_sandbox

        return code_sandbox
    if spec in BUILTIN_NAMES:
        from verity.rewards.builtin import BUILTIN_REWARD_FUNCTIONS

        return BUILTIN_REWARD_FUNCTIONS[spec]
    if spec.startswith("task:"):
        return _task_function(spec[len("task:") :])
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(
            f"reward spec {spec!r}: expected a built-in name {list(BUILTIN_NAMES)}, "
            "'package.module:function', '/path/file.py:function' or 'task:<name>'"
        )
    if target.endswith(".py") or "/" in target or Path(target).is_file():
        return _load_file_function(target, name)
    module = importlib.import_module(target)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"reward spec {spec!r}: module {target!r} has no function {name!r}")
    return function


def check_loads(spec: str) -> bool:
    """Load the function ``spec`` names; True when it loads (raises what loading raised)."""
    load_reward_function(spec)
    return True


def preload_reward_functions(specs: tuple[str, ...]) -> None:
    """Load the reward functions ``specs`` name now (worker start-up), so the first sample is not slow."""
    for spec in specs:
        load_reward_function(spec)


def _run_coroutine(coroutine: Any) -> Any:
    """Run a coroutine to completion, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    box: dict[str, Any] = {}

    def runner() -> None:
        try:
            box["value"] = asyncio.run(coroutine)
        except BaseException as error:  # re-raised in the caller's thread
            box["error"] = error

    thread = threading.Thread(target=runner, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def normalize_result(result: Any, spec: str = "reward function") -> tuple[float, dict[str, Any]]:
    """``(score, extra metrics)`` from what a reward function returned (a number or a dict with ``score``).

    Raises RewardResultError for anything else, or for a non-finite score.
    """
    extras: dict[str, Any] = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            raise RewardResultError(f"{spec}: returned a dict without 'score' (keys {sorted(result)})")
        extras = {str(k): v for k, v in result.items() if k != "score"}
        result = result["score"]
    if hasattr(result, "item") and callable(result.item):
        result = result.item()  # numpy / torch scalars
    if not isinstance(result, int | float):
        raise RewardResultError(
            f"{spec}: returned {type(result).__name__}; expected a float or a dict with 'score'"
        )
    score = float(result)
    if not math.isfinite(score):
        raise RewardResultError(f"{spec}: returned a non-finite score {score}")
    return score, extras


def call_reward(
    spec: str,
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    kwargs: Mapping[str, Any] | None = None,
) -> tuple[float, dict[str, Any]]:
    """Load ``spec`` and score one sample; awaits the result when the function is async."""
    function = load_reward_function(spec)
    result = function(
        data_source=data_source,
        solution_str=solution_str,
        ground_truth=ground_truth,
        extra_info=extra_info,
        **dict(kwargs or {}),
    )
    if inspect.isawaitable(result):
        result = _run_coroutine(result)
    return normalize_result(result, spec)
