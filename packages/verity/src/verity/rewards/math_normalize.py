"""String normalisation and equality of final math answers (MATH boxed answers, DAPO ``Answer:``).

Two answers are equal when their normalised strings are equal, or when both
denote rational numbers that are equal exactly (``\\frac12``, ``1/2``, ``0.5``
and ``.5`` are one number). Normalisation, in order:

1. drop display clutter: ``\\left``/``\\right``, ``\\!``, ``\\,``, ``\\;``, ``\\ ``,
   ``$``, ``\\%``/``%``, degree signs (``^\\circ``), ``\\displaystyle``;
2. ``\\dfrac``/``\\tfrac`` -> ``\\frac``; a trailing ``\\text{...}``/``\\mbox{...}`` unit
   after a value is dropped, other ``\\text{X}`` unwrapped to ``X``;
3. a short assignment ``x = 5`` keeps its right-hand side;
4. braces are added where LaTeX lets them be left out: ``\\frac12`` ->
   ``\\frac{1}{2}``, ``\\sqrt3`` -> ``\\sqrt{3}``; ``a/b`` of two integers ->
   ``\\frac{a}{b}``;
5. all whitespace is removed, thousands commas in a plain number dropped, a
   leading ``.`` becomes ``0.``, a trailing period is dropped.

This is deliberately a string-level check; :mod:`verity.rewards.builtin` also
offers math-verify for symbolic equality (``x^2-1`` vs ``(x-1)(x+1)``).
"""

from __future__ import annotations

import re
from fractions import Fraction

_CLUTTER = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "\\$", "\\%")
_UNIT_WORDS = (
    "degrees",
    "degree",
    "units",
    "unit",
    "cm",
    "meters",
    "inches",
    "inch",
    "feet",
    "ft",
    "dollars",
    "cents",
    "hours",
    "minutes",
    "seconds",
    "mph",
    "km",
    "square",
    "sq",
)
_TRAILING_TEXT = re.compile(r"^(.+?)\\(?:text|mbox|mathrm)\{\s*[^{}]*\}$")
_TEXT_WRAPPER = re.compile(r"\\(?:text|mbox|mathrm|textbf|mathbf)\{([^{}]*)\}")
_ASSIGNMENT = re.compile(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(.+)$")
_PLAIN_FRACTION = re.compile(r"^(-?\d+)/(\d+)$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_LATEX_FRACTION = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_DECIMAL = re.compile(r"^-?(\d+\.?\d*|\.\d+)$")


def _brace_shorthand(command: str, arity: int, text: str) -> str:
    r"""Give each argument of ``command`` braces: ``\frac12`` -> ``\frac{1}{2}``, ``\sqrt3`` -> ``\sqrt{3}``."""
    out: list[str] = []
    pos = 0
    while True:
        found = text.find(command, pos)
        if found < 0:
            out.append(text[pos:])
            return "".join(out)
        cursor = found + len(command)
        out.append(text[pos:cursor])
        for _ in range(arity):
            if cursor < len(text) and text[cursor] == "{":
                depth = 0
                end = cursor
                while end < len(text):
                    depth += {"{": 1, "}": -1}.get(text[end], 0)
                    end += 1
                    if depth == 0:
                        break
                out.append(text[cursor:end])
                cursor = end
            elif cursor < len(text) and text[cursor] not in "\\[":
                out.append("{" + text[cursor] + "}")
                cursor += 1
        pos = cursor


def normalize_math_answer(answer: str) -> str:
    """Normalise a final math answer (see the module docstring for the rules); never raises."""
    s = str(answer).strip()
    s = s.replace("\n", " ")
    s = re.sub(r"\\\\+", r"\\", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in _CLUTTER:
        s = s.replace(token, "")
    s = s.replace("\\ ", " ").replace("$", "").replace("%", "")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s).replace("\\circ", "").replace("°", "")
    s = s.strip()
    unit = _TRAILING_TEXT.match(s)
    if unit and unit.group(1).strip():
        s = unit.group(1)
    s = _TEXT_WRAPPER.sub(r"\1", s)
    assignment = _ASSIGNMENT.match(s)
    if assignment and "=" not in assignment.group(1):
        s = assignment.group(1)
    s = s.strip()
    words = s.split()
    while len(words) > 1 and words[-1].lower() in _UNIT_WORDS:
        words.pop()
    s = " ".join(words)
    s = re.sub(r"\s+", "", s)
    s = _brace_shorthand("\\frac", 2, s)
    s = _brace_shorthand("\\sqrt", 1, s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = s.rstrip(".")
    if s.startswith("."):
        s = "0" + s
    elif s.startswith("-."):
        s = "-0" + s[1:]
    plain = _PLAIN_FRACTION.match(s)
    if plain:
        s = f"\\frac{{{plain.group(1)}}}{{{plain.group(2)}}}"
    return s


def as_rational(normalized: str) -> Fraction | None:
    """The exact rational a normalised answer denotes (integer, decimal, ``\\frac{a}{b}``), else None."""
    if _DECIMAL.match(normalized):
        try:
            return Fraction(normalized)
        except (ValueError, ZeroDivisionError):
            return None
    frac = _LATEX_FRACTION.match(normalized)
    if frac:
        sign, num, den = frac.groups()
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return -value if sign else value
    return None


def math_answers_equal(prediction: str | None, reference: str | None) -> bool:
    """True when two final answers are equal after normalisation, or denote the same rational number."""
    if prediction is None or reference is None:
        return False
    pred = normalize_math_answer(prediction)
    ref = normalize_math_answer(reference)
    if not pred or not ref:
        return False
    if pred == ref:
        return True
    pred_value, ref_value = as_rational(pred), as_rational(ref)
    return pred_value is not None and pred_value == ref_value
