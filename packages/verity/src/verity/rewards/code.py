"""Code reward: run the response's program against test cases in the sandbox; score = pass fraction.

The program is the last fenced code block of the response (```` ```python ````,
```` ```py ```` or a bare fence); a response without one scores 0. The ground
truth (a dict, or a JSON string of one) gives the tests in one of these forms:

- stdin/stdout: ``{"inputs": [str, ...], "outputs": [str, ...]}`` — each input is fed
  on stdin, the printed output must match (trailing whitespace per line and trailing
  blank lines ignored; numbers compared with 1e-6 relative tolerance token by token);
- call-based: the same plus ``"fn_name"`` — each input is a list of arguments (JSON),
  the function (or ``Solution().<fn_name>``) must return the output;
- assert-style: ``{"asserts": [str, ...]}`` (also ``"test_list"``), optional ``"setup"``
  code run first — each assert statement is one test case;
- a whole test program: ``{"test_code": str, "entry_point": str | None}`` — one case;
  with an ``entry_point``, ``check(<entry_point>)`` is called after the test code
  (HumanEval style).

Every case is its own sandboxed run (:func:`verity.rewards.sandbox.run_python`), so
one case cannot fake another's result; a case passes only if the run reached its end.
Cases run one after another until ``total_timeout_s`` is spent; cases not run fail.
Keep ``total_timeout_s`` below the reward manager's per-sample timeout.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

from verity.rewards.sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str | None:
    """The last fenced code block of ``response`` (python/py/bare fence), or None."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


def parse_tests(ground_truth: Any) -> dict[str, Any]:
    """The test specification as a dict; raises ValueError naming what was expected."""
    tests = ground_truth
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as error:
            raise ValueError(f"ground_truth: code tests must be JSON, could not parse: {error}") from error
    if isinstance(tests, list) and all(isinstance(t, dict) and "input" in t for t in tests):
        tests = {"inputs": [t["input"] for t in tests], "outputs": [t.get("output") for t in tests]}
    if not isinstance(tests, dict):
        raise ValueError(f"ground_truth: expected a dict of tests, got {type(tests).__name__}")
    if "test_list" in tests and "asserts" not in tests:
        tests = {**tests, "asserts": tests["test_list"]}
    if "inputs" in tests:
        if not isinstance(tests.get("outputs"), list) or len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError("ground_truth: 'inputs' and 'outputs' must be lists of the same length")
    elif "asserts" not in tests and "test_code" not in tests:
        raise ValueError(
            f"ground_truth: expected 'inputs'/'outputs', 'asserts' or 'test_code', got keys {sorted(tests)}"
        )
    return tests


def _as_float(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def outputs_match(actual: str, expected: str) -> bool:
    """Judge comparison of printed output (see the module docstring)."""

    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in str(text).replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    if lines(actual) == lines(expected):
        return True
    got, want = str(actual).split(), str(expected).split()
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if a == b:
            continue
        fa, fb = _as_float(a), _as_float(b)
        if fa is None or fb is None or not math.isclose(fa, fb, rel_tol=1e-6, abs_tol=1e-9):
            return False
    return True


_CALL_TEMPLATE = """
import json as _verity_json
def _verity_same(a, b):
    if isinstance(a, tuple): a = list(a)
    if isinstance(a, float) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_verity_same(x, y) for x, y in zip(a, b))
    return a == b
_verity_fn = globals().get({name!r})
if _verity_fn is None and "Solution" in globals():
    _verity_fn = getattr(Solution(), {name!r})
_verity_args = _verity_json.loads({args!r})
_verity_want = _verity_json.loads({want!r})
_verity_got = _verity_fn(*_verity_args)
assert _verity_same(_verity_got, _verity_want) or _verity_same([_verity_got], _verity_want)
"""


def build_cases(tests: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per test case: ``{"stdin": str, "expected": str | None, "test_code": str | None}``."""
    cases: list[dict[str, Any]] = []
    if "inputs" in tests:
        name = tests.get("fn_name")
        for given, want in zip(tests["inputs"], tests["outputs"], strict=True):
            if name:
                args = given if isinstance(given, list) else json.loads(given)
                expected = want if not isinstance(want, str) else json.loads(want)
                code = _CALL_TEMPLATE.format(name=name, args=json.dumps(args), want=json.dumps(expected))
                cases.append({"stdin": "", "expected": None, "test_code": code})
            else:
                stdin = given if isinstance(given, str) else "\n".join(map(str, given))
                cases.append({"stdin": stdin, "expected": str(want), "test_code": None})
    elif "asserts" in tests:
        setup = tests.get("setup") or tests.get("test_setup_code") or ""
        for statement in tests["asserts"]:
            cases.append({"stdin": "", "expected": None, "test_code": f"{setup}\n{statement}\n"})
    else:
        test_code = tests["test_code"]
        entry = tests.get("entry_point")
        if entry:
            test_code = f"{test_code}\ncheck({entry})\n"
        cases.append({"stdin": "", "expected": None, "test_code": test_code})
    return cases


def run_cases(
    code: str,
    cases: list[dict[str, Any]],
    limits: SandboxLimits | None = None,
    total_timeout_s: float = 8.0,
) -> list[bool]:
    """Run every case in its own sandbox; ``passed[i]`` for case ``i`` (cases past the time budget fail)."""
    limits = limits or SandboxLimits()
    started = time.monotonic()
    passed: list[bool] = []
    for case in cases:
        left = total_timeout_s - (time.monotonic() - started)
        if left <= 0.05:
            passed.append(False)
            continue
        case_limits = SandboxLimits(**{**limits.__dict__, "wall_s": min(limits.wall_s, left)})
        result, completed = run_python(
            code, stdin=case["stdin"], limits=case_limits, test_code=case["test_code"]
        )
        if case["test_code"] is not None:
            passed.append(completed)
        else:
            passed.append(result.status == "ok" and outputs_match(result.stdout, case["expected"]))
    return passed


def code_sandbox(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    case_timeout_s: float = 4.0,
    total_timeout_s: float = 8.0,
    memory_mb: int = 1024,
    disk_mb: int = 64,
    max_cases: int | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Score = fraction of test cases the response's program passes (see the module docstring).

    ``disk_mb``: the most one case's program may write in all (its folder and temporary
    folders; nothing it writes survives the case).

    Returns ``{"score", "acc" (1.0 when all pass), "passed", "total", "pred": None}``.
    """
    tests = parse_tests(ground_truth)
    cases = build_cases(tests)
    if max_cases is not None:
        cases = cases[:max_cases]
    if not cases:
        raise ValueError("ground_truth: no test cases")
    code = extract_code(solution_str)
    if code is None:
        return {"score": 0.0, "acc": 0.0, "passed": 0, "total": len(cases), "pred": None}
    limits = SandboxLimits(
        wall_s=case_timeout_s, cpu_s=max(1, math.ceil(case_timeout_s)), memory_mb=memory_mb, disk_mb=disk_mb
    )
    passed = run_cases(code, cases, limits, total_timeout_s)
    count = sum(passed)
    return {
        "score": count / len(cases),
        "acc": 1.0 if count == len(cases) else 0.0,
        "passed": count,
        "total": len(cases),
        "pred": None,
    }
