"""Convert published raw datasets (GSM8K, MATH, AIME) into verl-schema rows.

Raw formats (as the datasets are published; read from ``.jsonl``, ``.json``,
``.parquet`` or ``.csv``):

- **GSM8K**: ``question``, ``answer`` — the answer is a worked solution ending in
  ``#### <number>``; the ground truth is that number without thousands commas.
- **MATH**: ``problem``, ``solution`` (with the final answer in ``\\boxed{...}``),
  ``level``, ``type``; the ground truth is the last boxed answer. ``answer`` is used
  instead when a row has it (MATH-500).
- **AIME**: ``Problem``/``Answer`` or ``problem``/``answer`` (plus optional ``ID``,
  ``Year``, ``Solution``); the answer must be an integer.

The prompt is the question followed by an instruction suffix that names the answer
format its reward function reads (override with ``instruction``). ``data_source``
values match the default reward table: ``openai/gsm8k``, ``lighteval/MATH``, ``aime``.
Columns and ``extra_info`` fields come in the order and types verl's own preprocessing
writes (GSM8K: ``extra_info`` = ``split``, ``index``, ``answer``, ``question``; MATH:
``level``, ``type`` columns first, ``extra_info`` = ``split``, ``index``), so a file
prepared here concatenates with one prepared by verl. Every raw row that cannot be
converted is listed, not only the first (:class:`RawFormatError`).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from verity.data.verl_dataset import read_rows

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
AIME_INSTRUCTION = (
    "Solve the problem step by step. The last line of your response must be of the form "
    '"Answer: N" where N is the answer, an integer from 0 to 999.'
)

FORMATS = ("gsm8k", "math", "aime")
_MAX_LISTED = 50


class RawFormatError(ValueError):
    """A raw row lacks what its format requires; the message names the row."""


def _extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` with balanced braces, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    opening = text.index("{", start)
    depth = 0
    for pos in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[opening + 1 : pos].strip()
    return None


def _as_integer(value: Any) -> int | None:
    """``value`` as an int when it denotes one (``33``, ``"033"``, ``"1,000"``, ``"7.0"``), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    text = str(value).strip().strip("$").replace(",", "").strip()
    boxed = _extract_last_boxed(text)
    if boxed is not None:
        text = boxed
    if text.lstrip("-").isdigit():
        return int(text)
    if text.endswith(".0") and text[:-2].lstrip("-").isdigit():
        return int(text[:-2])
    return None


def _row(
    data_source: str,
    question: str,
    instruction: str,
    ground_truth: str,
    ability: str,
    extra: dict[str, Any],
) -> dict[str, Any]:
    content = f"{question.strip()} {instruction}".strip() if instruction else question.strip()
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra,
    }


def _field(row: Mapping[str, Any], names: Sequence[str], index: int, fmt: str) -> Any:
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    raise RawFormatError(
        f"{fmt} row {index}: needs a {' or '.join(repr(n) for n in names)} field; has {sorted(row)}"
    )


def _convert_all(
    raw: Sequence[Mapping[str, Any]], fmt: str, convert: Callable[[int, Mapping[str, Any]], dict]
) -> list[dict]:
    """``convert(i, row)`` for every raw row; every row it rejects is listed in one RawFormatError."""
    out, problems = [], []
    for i, row in enumerate(raw):
        try:
            out.append(convert(i, row))
        except RawFormatError as error:
            problems.append(str(error))
    if problems:
        shown = "\n".join(f"  {p}" for p in problems[:_MAX_LISTED])
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise RawFormatError(
            f"{fmt}: {len(problems)} of {len(raw)} raw rows cannot be converted (0-based row numbers):\n{shown}{more}"
        )
    return out


def gsm8k_rows(
    raw: Sequence[Mapping[str, Any]], split: str = "train", instruction: str | None = None
) -> list[dict]:
    """verl rows from GSM8K rows (``question``, ``answer`` ending in ``#### N``).

    ``extra_info`` holds ``split``, ``index``, ``answer``, ``question`` in that order, as verl's
    own GSM8K preprocessing writes them, so the files concatenate with verl-prepared ones.
    """

    def convert(i: int, row: Mapping[str, Any]) -> dict:
        question = str(_field(row, ["question"], i, "gsm8k"))
        solution = str(_field(row, ["answer"], i, "gsm8k"))
        if "####" not in solution:
            raise RawFormatError(f"gsm8k row {i}: 'answer' has no '#### <number>' final line")
        final = solution.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").strip()
        if not final:
            raise RawFormatError(f"gsm8k row {i}: nothing after '####' in 'answer'")
        extra = {"split": str(split), "index": i, "answer": solution, "question": question}
        text = GSM8K_INSTRUCTION if instruction is None else instruction
        return _row("openai/gsm8k", question, text, final, "math", extra)

    return _convert_all(raw, "gsm8k", convert)


def math_rows(
    raw: Sequence[Mapping[str, Any]], split: str = "train", instruction: str | None = None
) -> list[dict]:
    """verl rows from MATH rows (``problem``, ``solution`` with ``\\boxed{}``, ``level``, ``type``).

    As verl's MATH preprocessing leaves them: ``level`` and ``type`` (strings) as the first
    columns, ``extra_info`` with ``split`` and ``index``.
    """

    def convert(i: int, row: Mapping[str, Any]) -> dict:
        problem = str(_field(row, ["problem"], i, "math"))
        answer = row.get("answer")
        solution = row.get("solution")
        if answer is None:
            if solution is None:
                raise RawFormatError(f"math row {i}: needs 'solution' (with \\boxed{{}}) or 'answer'")
            answer = _extract_last_boxed(str(solution))
            if answer is None:
                raise RawFormatError(f"math row {i}: 'solution' has no \\boxed{{...}} answer")
        text = MATH_INSTRUCTION if instruction is None else instruction
        converted = _row(
            "lighteval/MATH", problem, text, str(answer), "math", {"split": str(split), "index": i}
        )
        kind = row.get("type", row.get("subject", ""))
        return {"level": str(row.get("level", "")), "type": str(kind), **converted}

    return _convert_all(raw, "math", convert)


def aime_rows(
    raw: Sequence[Mapping[str, Any]], split: str = "test", instruction: str | None = None
) -> list[dict]:
    """verl rows from AIME rows (``Problem``/``Answer`` or ``problem``/``answer``, integer answers)."""

    def convert(i: int, row: Mapping[str, Any]) -> dict:
        problem = str(_field(row, ["Problem", "problem", "question"], i, "aime"))
        answer = _field(row, ["Answer", "answer"], i, "aime")
        value = _as_integer(answer)
        if value is None:
            raise RawFormatError(f"aime row {i}: answer {answer!r} is not an integer")
        extra: dict[str, Any] = {"split": str(split), "index": i}
        for key in ("ID", "id", "Year", "year"):
            if key in row and row[key] is not None:
                extra[key.lower()] = str(row[key])
        text = AIME_INSTRUCTION if instruction is None else instruction
        return _row("aime", problem, text, str(value), "math", extra)

    return _convert_all(raw, "aime", convert)


CONVERTERS: dict[str, Callable[..., list[dict]]] = {"gsm8k": gsm8k_rows, "math": math_rows, "aime": aime_rows}


def read_raw(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a raw file: ``.jsonl``/``.json``/``.parquet`` (via :func:`read_rows`) or ``.csv``."""
    path = Path(path).expanduser()
    if path.suffix.lower() == ".csv":
        if not path.is_file():
            raise FileNotFoundError(f"input: {str(path)!r} does not exist")
        with open(path, newline="", encoding="utf-8") as handle:
            return list(csv.DictReader(handle))
    return read_rows(path)


def write_rows(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write verl rows to ``.parquet`` or ``.jsonl`` (by suffix); parent folders are created.

    An output path that cannot be written (a folder, under a file, no permission) is a
    ``ValueError`` naming it, raised before anything is written.
    """
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".jsonl", ".ndjson"):
        raise ValueError(f"output: {str(path)!r} must end in .parquet or .jsonl")
    if path.is_dir():
        raise ValueError(f"output: {str(path)!r} is a folder; give the path of a .parquet or .jsonl file")
    blocking = next((parent for parent in path.parents if parent.is_file()), None)
    if blocking is not None:
        raise ValueError(
            f"output: {str(path)!r} cannot be written: {str(blocking)!r} is a file, not a folder"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"output: {str(path)!r} cannot be written: its folder cannot be created ({error.strerror or error})"
        ) from None
    try:
        if suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist([dict(r) for r in rows]), path)
        else:
            with open(path, "w", encoding="utf-8") as handle:
                for row in rows:
                    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    except OSError as error:
        raise ValueError(f"output: {str(path)!r} cannot be written ({error.strerror or error})") from None
    return path


def prepare_file(
    fmt: str,
    input_path: str | Path,
    output_path: str | Path,
    split: str | None = None,
    instruction: str | None = None,
    limit: int | None = None,
) -> int:
    """Convert ``input_path`` (raw ``fmt``) into a verl-schema file at ``output_path``; returns the row count."""
    if fmt not in CONVERTERS:
        raise ValueError(f"format: expected one of {list(FORMATS)}, got {fmt!r}")
    raw = read_raw(input_path)
    if limit is not None:
        raw = raw[:limit]
    kwargs: dict[str, Any] = {"instruction": instruction}
    if split is not None:
        kwargs["split"] = split
    rows = CONVERTERS[fmt](raw, **kwargs)
    write_rows(rows, output_path)
    return len(rows)
