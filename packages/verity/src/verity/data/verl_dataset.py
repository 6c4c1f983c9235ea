"""Prompt datasets in the verl schema: read, validate, chat-template, tokenize, apply a length policy.

A row (one line of JSONL, one record of parquet) is::

    {"prompt": [{"role": "user", "content": "..."}, ...],   # chat message list
     "data_source": "openai/gsm8k",                           # selects the reward function
     "ability": "math",                                       # optional
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}       # optional dict

Files written by verl's own preprocessing scripts load unchanged. Every row is
checked before anything is tokenized; malformed rows are reported together with
their 0-based row numbers (:class:`MalformedDatasetError`), or skipped and logged
with ``on_malformed="skip"``.

Prompts longer than ``max_prompt_length`` tokens follow an explicit policy:

- ``"error"`` (default): raise :class:`PromptTooLongError` naming the rows;
- ``"filter"``: drop those rows (``PromptDataset.filtered_rows`` lists them);
- ``"truncate_left"``: keep the last ``max_prompt_length`` tokens (the question's end
  and the generation prompt survive);
- ``"truncate_right"``: keep the first ``max_prompt_length`` tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verity.data.chat_template import encode_prompts, pad_token_id_of, render_prompt
from verity.data.multimodal import ImagePrompt, encode_image_prompt, has_images_column, image_row_problems

logger = logging.getLogger("verity.data")

TRUNCATION_POLICIES = ("error", "filter", "truncate_left", "truncate_right")
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
_MAX_REPORTED = 20


class MalformedDatasetError(ValueError):
    """Rows that do not follow the verl schema; the message lists them by row number."""


class DataFileError(MalformedDatasetError):
    """A dataset file that cannot be read as its suffix says (not parquet, truncated, empty)."""


class PromptTooLongError(ValueError):
    """Prompts longer than ``max_prompt_length`` under the ``"error"`` policy."""


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise MalformedDatasetError(
                    f"{path}: line {line_number} is not valid JSON: {error}"
                ) from error
    return rows


DATA_SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".json")


def data_file_problem(path: str | Path, label: str = "file") -> str | None:
    """Why ``path`` is not one readable dataset file, in words starting ``label 'path'``; None when it is a file.

    A folder (a downloaded dataset's directory, say) is named as a folder, with the
    data files found in it and one level below, instead of "does not exist".
    """
    resolved = Path(path).expanduser()
    if resolved.is_file():
        return None
    if not resolved.is_dir():
        return f"{label} {str(path)!r} does not exist"
    found = sorted(
        str(child)
        for pattern in ("*", "*/*")
        for child in resolved.glob(pattern)
        if child.suffix.lower() in DATA_SUFFIXES and child.is_file()
    )
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        inside = f"the data files in it: {', '.join(found[:3])}{more}"
    else:
        inside = "it holds no .parquet, .jsonl or .json file"
    return f"{label} {str(path)!r} is a folder, not a data file; list its files instead ({inside})"


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read all rows of one ``.parquet``, ``.jsonl``/``.ndjson`` or ``.json`` (a list) file as plain dicts."""
    problem = data_file_problem(path, "dataset file:")
    if problem:
        raise FileNotFoundError(problem)
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DataFileError(f"{path}: not a readable parquet file ({reason})") from None
    if suffix in (".jsonl", ".ndjson"):
        try:
            return _read_jsonl(path)
        except UnicodeDecodeError as error:
            raise DataFileError(f"{path}: not a readable JSONL file (not UTF-8 text: {error})") from None
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise DataFileError(f"{path}: not a readable JSON file ({error})") from None
        if not isinstance(data, list):
            raise MalformedDatasetError(
                f"{path}: a .json dataset must hold a list of rows, got {type(data).__name__}"
            )
        return data
    raise ValueError(f"dataset file: {str(path)!r} has suffix {suffix!r}; expected .parquet, .jsonl or .json")


#: raw column names that usually hold what verl's ``prompt`` chat list should
_PROMPT_LOOKALIKES = (
    "question",
    "problem",
    "query",
    "instruction",
    "input",
    "prompt_text",
    "text",
    "messages",
)


def read_nonempty_rows(path: str | Path) -> list[dict[str, Any]]:
    """:func:`read_rows`, refusing a file without rows, or without a ``prompt`` column, in one sentence naming it."""
    rows = read_rows(path)
    if not rows:
        raise DataFileError(f"{path}: the file holds no rows (an empty dataset file)")
    columns = list(dict.fromkeys(key for row in rows if isinstance(row, Mapping) for key in row))
    if columns and "prompt" not in columns:
        import difflib

        close = [c for c in columns if c.lower() in _PROMPT_LOOKALIKES] or difflib.get_close_matches(
            "prompt", columns, n=1
        )
        hint = f"; {close[0]!r} is probably meant" if close else ""
        raise MalformedDatasetError(
            f"{path}: no 'prompt' column (each row's chat messages, a list of {{role, content}}); the file's "
            f"columns are {columns}{hint}: convert it with `verity data prepare --format gsm8k|math|aime`, or "
            "write each row's prompt as [{'role': 'user', 'content': ...}] (docs/rewards-and-data.md)"
        )
    return rows


def row_problems(row: Any) -> list[str]:
    """What is wrong with one row (an empty list when it follows the schema)."""
    if not isinstance(row, Mapping):
        return [f"expected a dict row, got {type(row).__name__}"]
    problems = []
    prompt = row.get("prompt")
    if not isinstance(prompt, list | tuple) or not prompt:
        problems.append(
            f"'prompt' must be a non-empty list of {{role, content}} messages, got {type(prompt).__name__}"
        )
    else:
        for i, message in enumerate(prompt):
            if not isinstance(message, Mapping):
                problems.append(f"'prompt'[{i}] must be a dict with 'role' and 'content'")
            elif message.get("role") not in MESSAGE_ROLES:
                problems.append(
                    f"'prompt'[{i}].role must be one of {list(MESSAGE_ROLES)}, got {message.get('role')!r}"
                )
            elif not isinstance(message.get("content"), str):
                problems.append(
                    f"'prompt'[{i}].content must be a str, got {type(message.get('content')).__name__}"
                )
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        problems.append(f"'data_source' must be a non-empty str, got {source!r}")
    reward = row.get("reward_model")
    if not isinstance(reward, Mapping):
        problems.append(f"'reward_model' must be a dict with 'ground_truth', got {type(reward).__name__}")
    elif reward.get("ground_truth") is None and reward.get("style") != "model":
        problems.append("'reward_model.ground_truth' is missing (only style 'model' may omit it)")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        problems.append(f"'extra_info' must be a dict or absent, got {type(extra).__name__}")
    return problems


def check_rows(rows: Sequence[Any]) -> list[tuple[int, str]]:
    """``(row number, problem)`` for every malformed row of ``rows`` (0-based row numbers)."""
    return [(i, "; ".join(p)) for i, row in enumerate(rows) if (p := row_problems(row))]


def _with_image_problems(rows: Sequence[Any], bad: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """``bad`` plus the rows whose ``images`` column does not match their ``<image>`` placeholders."""
    problems = dict(bad)
    for i, row in enumerate(rows):
        extra = image_row_problems(row) if isinstance(row, Mapping) else []
        if extra:
            problems[i] = "; ".join([problems[i], *extra] if i in problems else extra)
    return sorted(problems.items())


def _report(origin: str, bad: list[tuple[int, str]], total: int) -> str:
    lines = [f"{origin}: {len(bad)} of {total} rows do not follow the verl schema (0-based row numbers):"]
    lines += [f"  row {i}: {problem}" for i, problem in bad[:_MAX_REPORTED]]
    if len(bad) > _MAX_REPORTED:
        lines.append(f"  ... and {len(bad) - _MAX_REPORTED} more")
    return "\n".join(lines)


@dataclass
class PromptRecord:
    """One tokenized prompt: ids (unpadded), its text and the per-sample fields of its row."""

    input_ids: list[int]
    prompt_text: str
    raw_prompt: list[dict[str, Any]]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]
    ability: str | None
    row: int
    pixel_values: Any = None
    image_grid_thw: Any = None


class PromptDataset:
    """Tokenized prompts of one or more verl-schema files (or in-memory rows).

    Args:
        source: a path, a list of paths, a list of row dicts, or a ``datasets.Dataset``.
        tokenizer: the model's tokenizer (chat template applied when it has one).
        max_prompt_length: tokens; longer prompts follow ``truncation``.
        truncation: one of :data:`TRUNCATION_POLICIES`.
        on_malformed: ``"error"`` (raise, listing the rows) or ``"skip"`` (drop and log them).
        chat_template_kwargs: extra arguments of ``apply_chat_template``.
        max_samples: keep only the first rows (after filtering); None or < 0 keeps all.
        image_processor: the model's image processor (``AutoImageProcessor``); needed when the
            rows carry verl's ``images`` column (see :mod:`verity.data.multimodal`).
    """

    def __init__(
        self,
        source: str | Path | Sequence[str | Path] | Sequence[Mapping[str, Any]] | Any,
        tokenizer: Any,
        max_prompt_length: int,
        truncation: str = "error",
        on_malformed: str = "error",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_samples: int | None = None,
        image_processor: Any = None,
    ) -> None:
        if truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"truncation: expected one of {list(TRUNCATION_POLICIES)}, got {truncation!r}")
        if on_malformed not in ("error", "skip"):
            raise ValueError(f"on_malformed: expected 'error' or 'skip', got {on_malformed!r}")
        if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise ValueError(f"max_prompt_length: expected an int >= 1, got {max_prompt_length!r}")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.pad_token_id = pad_token_id_of(tokenizer)
        rows, origin = self._load(source)
        multimodal = has_images_column(rows)
        bad = check_rows(rows)
        if multimodal:
            bad = _with_image_problems(rows, bad)
        if bad and on_malformed == "error":
            raise MalformedDatasetError(_report(origin, bad, len(rows)))
        if bad:
            logger.warning("%s", _report(origin, bad, len(rows)) + "\n  (skipped)")
        bad_rows = {i for i, _ in bad}
        self.skipped_rows = sorted(bad_rows)
        kept = [i for i in range(len(rows)) if i not in bad_rows]
        images: dict[int, ImagePrompt] = {}
        if multimodal:
            kept, images = self._encode_images(
                rows, kept, origin, image_processor, on_malformed, chat_template_kwargs
            )
            if truncation in ("truncate_left", "truncate_right"):
                raise ValueError(
                    f"truncation: {truncation!r} would cut image tokens out of prompts with images; "
                    "use 'error' or 'filter'"
                )
            texts = [images[i].text for i in kept]
            ids = [images[i].input_ids for i in kept]
        else:
            texts = [
                render_prompt(rows[i]["prompt"], tokenizer, chat_template_kwargs=chat_template_kwargs)
                for i in kept
            ]
            ids = encode_prompts(texts, tokenizer)
        self.records: list[PromptRecord] = []
        self.filtered_rows: list[int] = []
        too_long = [(i, len(t)) for i, t in zip(kept, ids, strict=True) if len(t) > max_prompt_length]
        if too_long and truncation == "error":
            shown = ", ".join(f"row {i} ({n} tokens)" for i, n in too_long[:_MAX_REPORTED])
            raise PromptTooLongError(
                f"{origin}: {len(too_long)} prompts are longer than max_prompt_length={max_prompt_length}: "
                f"{shown}. Raise max_prompt_length or choose truncation 'filter', 'truncate_left' or 'truncate_right'."
            )
        for i, text, token_ids in zip(kept, texts, ids, strict=True):
            if len(token_ids) > max_prompt_length:
                if truncation == "filter":
                    self.filtered_rows.append(i)
                    continue
                if truncation == "truncate_left":
                    token_ids = token_ids[-max_prompt_length:]
                else:
                    token_ids = token_ids[:max_prompt_length]
                text = tokenizer.decode(token_ids, skip_special_tokens=False)
            record = self._record(rows[i], i, text, token_ids)
            if i in images:
                record.pixel_values = images[i].pixel_values
                record.image_grid_thw = images[i].image_grid_thw
            self.records.append(record)
        if self.filtered_rows:
            logger.warning(
                "%s: filtered %d prompts longer than %d tokens",
                origin,
                len(self.filtered_rows),
                max_prompt_length,
            )
        if max_samples is not None and max_samples >= 0:
            self.records = self.records[:max_samples]
        if not self.records:
            raise MalformedDatasetError(
                f"{origin}: no prompts left (rows={len(rows)}, skipped={len(bad)}, filtered={len(self.filtered_rows)})"
            )

    def _encode_images(
        self,
        rows: Sequence[Any],
        kept: list[int],
        origin: str,
        image_processor: Any,
        on_malformed: str,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[list[int], dict[int, ImagePrompt]]:
        """Decode and process every kept row's images before anything is computed.

        Returns the rows still kept and their :class:`ImagePrompt`; unreadable images raise
        :class:`MalformedDatasetError` naming the rows (or are skipped with ``on_malformed="skip"``).
        """
        if image_processor is None:
            raise ValueError(
                f"{origin}: the rows carry an 'images' column but no image processor was given "
                "(the model folder needs a preprocessor_config.json that AutoImageProcessor loads)"
            )
        encoded: dict[int, ImagePrompt] = {}
        bad: list[tuple[int, str]] = []
        for i in kept:
            row = rows[i]
            try:
                encoded[i] = encode_image_prompt(
                    row["prompt"],
                    list(row.get("images") or []),
                    self.tokenizer,
                    image_processor,
                    chat_template_kwargs,
                )
            except ValueError as error:
                bad.append((i, f"'images': {error}"))
        if bad and on_malformed == "error":
            raise MalformedDatasetError(_report(origin, bad, len(rows)))
        if bad:
            logger.warning("%s", _report(origin, bad, len(rows)) + "\n  (skipped)")
        return [i for i in kept if i in encoded], encoded

    @staticmethod
    def _load(source: Any) -> tuple[list[Any], str]:
        if isinstance(source, str | Path):
            return read_nonempty_rows(source), str(source)
        if hasattr(source, "to_list") and callable(source.to_list):  # datasets.Dataset
            return list(source.to_list()), type(source).__name__
        if isinstance(source, Iterable):
            items = list(source)
            if items and all(isinstance(item, str | Path) for item in items):
                rows: list[Any] = []
                for path in items:
                    rows.extend(read_nonempty_rows(path))
                return rows, " + ".join(str(p) for p in items)
            return items, "rows"
        raise TypeError(
            f"dataset source: expected a path, a list of paths, a list of rows or a datasets.Dataset, "
            f"got {type(source).__name__}"
        )

    @staticmethod
    def _record(row: Mapping[str, Any], index: int, text: str, ids: list[int]) -> PromptRecord:
        extra = dict(row.get("extra_info") or {})
        return PromptRecord(
            input_ids=ids,
            prompt_text=text,
            raw_prompt=[{"role": m["role"], "content": m["content"]} for m in row["prompt"]],
            data_source=row["data_source"],
            ground_truth=row["reward_model"].get("ground_truth"),
            extra_info=extra,
            ability=row.get("ability"),
            row=index,
        )

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]
