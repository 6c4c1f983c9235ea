"""The built-in ``calculator`` tool: arithmetic on numbers, never ``eval`` of Python.

The expression is parsed with :func:`ast.parse` and walked node by node; only these
nodes are evaluated, everything else is refused with an error message:

- numbers (``int`` and ``float`` literals; not ``bool``, not complex);
- ``+ - * / // % **`` and unary ``+ -`` (``^`` is refused with a hint: it is not a power);
- calls of ``abs round min max sqrt floor ceil`` with positional arguments, and the
  constants ``pi`` and ``e``.

Limits keep every call small and fast: the text is at most ``max_length`` characters
(default 256) and ``max_nodes`` syntax nodes (default 128); an integer result (also any
intermediate one) may have at most ``max_digits`` digits (default 100), and a power
whose result would be longer is refused before it is computed; a float result must be
finite. Division by zero is an error message.

Answers: an integer as its digits; a float that is a whole number below 1e15 as an
integer (``6/3`` -> ``2``), any other float with 12 significant digits (``1/3`` ->
``0.333333333333``).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from verity.rollout.agent.tools import Tool, ToolError

__all__ = ["Calculator", "evaluate_expression", "format_number"]

Number = int | float

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int]] = {  # name -> (function, min args, max args)
    "abs": (abs, 1, 1),
    "round": (round, 1, 2),
    "min": (min, 1, 16),
    "max": (max, 1, 16),
    "sqrt": (math.sqrt, 1, 1),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}
_OPERATOR_TEXT = {
    ast.BitXor: "^",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
}


class _Evaluator:
    def __init__(self, max_digits: int) -> None:
        self.limit = 10**max_digits
        self.max_digits = max_digits

    def check(self, value: Any) -> Number:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ToolError(f"unsupported value {value!r}")
        if isinstance(value, int) and abs(value) >= self.limit:
            raise ToolError(f"result has more than {self.max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("result is not a finite number")
        return value

    def power(self, base: Number, exponent: Number) -> Number:
        if isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
            digits = exponent * math.log10(abs(base))
            if digits > self.max_digits + 1:
                raise ToolError(f"result has more than {self.max_digits} digits")
        try:
            value = base**exponent
        except OverflowError:
            raise ToolError("result is too large") from None
        if isinstance(value, complex):
            raise ToolError("result is not a real number")
        return value

    def eval(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Expression):
            return self.eval(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise ToolError(f"only numbers are allowed, got {node.value!r}")
            return self.check(node.value)
        if isinstance(node, ast.BinOp):
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, ast.Pow):
                return self.check(self.power(left, right))
            op = _BINARY.get(type(node.op))
            if op is None:
                text = _OPERATOR_TEXT.get(type(node.op), type(node.op).__name__)
                hint = " (use ** for powers)" if text == "^" else ""
                raise ToolError(f"unsupported operator {text}{hint}")
            try:
                return self.check(op(left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result is too large") from None
        if isinstance(node, ast.UnaryOp):
            op = _UNARY.get(type(node.op))
            if op is None:
                raise ToolError(f"unsupported operator {type(node.op).__name__}")
            return self.check(op(self.eval(node.operand)))
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            raise ToolError(f"unknown name {node.id!r}; constants: {', '.join(_CONSTANTS)}")
        if isinstance(node, ast.Call):
            return self.call(node)
        raise ToolError(f"unsupported syntax: {type(node).__name__}")

    def call(self, node: ast.Call) -> Number:
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            shown = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
            raise ToolError(f"unknown function {shown!r}; functions: {', '.join(_FUNCTIONS)}")
        if node.keywords:
            raise ToolError(f"{node.func.id}() takes positional arguments only")
        function, low, high = _FUNCTIONS[node.func.id]
        if not low <= len(node.args) <= high:
            raise ToolError(f"{node.func.id}() takes {low}..{high} arguments, got {len(node.args)}")
        args = [self.eval(arg) for arg in node.args]
        if node.func.id == "round" and len(args) == 2 and not isinstance(args[1], int):
            raise ToolError("round(x, n): n must be an integer")
        try:
            return self.check(function(*args))
        except (ValueError, OverflowError) as err:
            raise ToolError(f"{node.func.id}(): {err}") from None


def evaluate_expression(
    text: str, *, max_length: int = 256, max_nodes: int = 128, max_digits: int = 100
) -> Number:
    """The value of the arithmetic expression ``text`` (see the module docstring); ToolError otherwise."""
    if not isinstance(text, str):
        raise ToolError(f"expression must be a string, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > max_length:
        raise ToolError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ToolError(f"not an arithmetic expression: {type(err).__name__}") from None
    if sum(1 for _ in ast.walk(tree)) > max_nodes:
        raise ToolError(f"expression has more than {max_nodes} parts")
    return _Evaluator(max_digits).eval(tree)


def format_number(value: Number) -> str:
    """The answer text of a result (see the module docstring)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


class Calculator(Tool):
    """``calculator(expression)``: evaluates arithmetic safely (settings: ``max_length``, ``max_nodes``, ``max_digits``)."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": (
                "Evaluate an arithmetic expression with + - * / // % ** and parentheses, "
                "and abs, round, min, max, sqrt, floor, ceil."
            ),
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "for example (12+7)*3"}},
                "required": ["expression"],
            },
        },
    }
    _SETTINGS = ("max_length", "max_nodes", "max_digits")

    @classmethod
    def check_config(cls, config: dict[str, Any], timeout_s: float) -> None:
        """Raise ValueError for an unknown or non-positive setting."""
        for key, value in config.items():
            if key not in cls._SETTINGS:
                raise ValueError(f"calculator: unknown setting {key!r}; settings: {', '.join(cls._SETTINGS)}")
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"calculator: {key} must be an int >= 1, got {value!r}")

    def execute(self, arguments: dict[str, Any], **row_kwargs: Any) -> str:
        """The value of ``arguments["expression"]`` as text."""
        settings = {key: int(self.config[key]) for key in self._SETTINGS if key in self.config}
        return format_number(evaluate_expression(arguments.get("expression"), **settings))
