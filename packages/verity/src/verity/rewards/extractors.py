"""Pull the final answer out of a model response.

Every extractor takes the response text and returns the answer as a string, or
``None`` when the response holds no answer in that format. They are pure
functions of the text (no sympy, no I/O), cheap enough to run thousands of
times a second, and they always take the *last* match: a model that states an
intermediate result and then its final answer is graded on the final one.

Formats:

- GSM8K strict: ``#### 1,234`` (the reference solutions' own marker);
- last number: the last number anywhere in the text (GSM8K "flexible");
- ``\\boxed{...}``: the content of the last ``\\boxed``/``\\fbox`` with balanced braces (MATH);
- DAPO: the text after the last ``Answer:`` on its line;
- integer: an answer that must be an integer (AIME), read from the formats above.
"""

from __future__ import annotations

import re

_GSM8K_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")
_NUMBER = re.compile(r"-?\$?\s?(?:[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+)")
_DAPO_ANSWER = re.compile(r"(?i)answer\s*:[ \t]*([^\n]*)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_BOXED_COMMANDS = ("\\boxed", "\\fbox")


def clean_number(text: str) -> str:
    """Normalise a numeric string: drop ``$``, spaces, thousands commas and a trailing period.

    ``"$1,234.50"`` -> ``"1234.50"``; ``"-.5"`` -> ``"-0.5"``; ``"7."`` -> ``"7"``.
    """
    out = text.replace("$", "").replace(" ", "").strip()
    out = out.rstrip(".")
    out = out.replace(",", "")
    if out.startswith("-."):
        out = "-0" + out[1:]
    elif out.startswith("."):
        out = "0" + out
    return out


def extract_gsm8k_strict(text: str) -> str | None:
    """The number after the last ``####`` marker, cleaned by :func:`clean_number`; None if absent."""
    matches = _GSM8K_STRICT.findall(text)
    return clean_number(matches[-1]) if matches else None


def extract_last_number(text: str) -> str | None:
    """The last number in the text (``$``, thousands commas and a trailing period removed); None if none."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    candidate = matches[-1].replace("$", "").replace(" ", "")
    # "1,2,3" is a list, not a number: keep the last item unless the commas group thousands.
    if "," in candidate and not _THOUSANDS.match(candidate):
        candidate = candidate.split(",")[-1] or candidate.split(",")[-2]
    return clean_number(candidate)


def _read_braced(text: str, start: int) -> tuple[str, int] | None:
    """Read ``{...}`` starting at ``text[start] == "{"``; returns (content, index after the closing brace)."""
    depth = 0
    for pos in range(start, len(text)):
        char = text[pos]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : pos], pos + 1
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``); None if absent.

    Braces are balanced, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. An
    unclosed ``\\boxed{`` counts as no answer.
    """
    best_pos = -1
    for command in _BOXED_COMMANDS:
        best_pos = max(best_pos, text.rfind(command))
    if best_pos < 0:
        return None
    rest_start = best_pos + (len("\\boxed") if text.startswith("\\boxed", best_pos) else len("\\fbox"))
    rest = text[rest_start:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        read = _read_braced(text, rest_start + (len(rest) - len(stripped)))
        return read[0].strip() if read is not None else None
    if rest.startswith(" "):
        # "\boxed 5" form: up to the next "$" or whitespace.
        match = re.match(r"\s+([^\s$]+)", rest)
        return match.group(1) if match else None
    return None


def extract_dapo_answer(text: str) -> str | None:
    """The text after the last ``Answer:`` (case-insensitive) on its line, stripped; None if absent or empty."""
    matches = _DAPO_ANSWER.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip()
    return answer or None


def strip_math_delimiters(answer: str) -> str:
    """Remove surrounding ``$...$``, ``\\(...\\)``, ``\\[...\\]`` and a trailing period."""
    out = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if out.startswith(left) and out.endswith(right) and len(out) >= len(left) + len(right):
            out = out[len(left) : len(out) - len(right)].strip()
    return out.rstrip(".").strip()


def parse_integer(answer: str | int | None) -> int | None:
    """``answer`` as an integer if it denotes one (``"033"``, ``"1,000"``, ``"$42$"``, ``"7.0"``), else None."""
    if answer is None:
        return None
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return answer
    text = strip_math_delimiters(str(answer))
    inner = extract_boxed(text)
    if inner is not None:
        text = inner
    text = re.sub(r"\\text\{[^}]*\}", "", text)
    text = clean_number(text.replace("{,}", ","))
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if re.fullmatch(r"-?\d+\.0+", text):
        return int(text.split(".")[0])
    return None


def extract_integer_answer(text: str) -> str | None:
    """An integer final answer: from the last ``\\boxed{}``, else the last ``Answer:`` line; None if neither is an integer."""
    for extractor in (extract_boxed, extract_dapo_answer):
        found = extractor(text)
        if found is not None:
            value = parse_integer(found)
            return None if value is None else str(value)
    return None
