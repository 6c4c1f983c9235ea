"""``verity data``: convert raw datasets to the verl schema, generate synthetic tasks, check files.

    verity data prepare --format gsm8k|math|aime --input RAW --output out.parquet [--split S]
                        [--instruction TEXT] [--limit N]
    verity data synth   --task NAME --n N [--seed S] [--split S] --output out.parquet
                        [--difficulty key=value ...]
    verity data check   FILE [FILE ...]

``prepare`` reads ``.jsonl``/``.json``/``.parquet``/``.csv`` in the published raw
format; ``synth`` writes rows of a synthetic task (``arithmetic``, ``gsm8k_style``,
``countdown``, ``digit_sequence``); ``check`` validates verl-schema files and
lists malformed rows by number (a file without rows fails too). Output is
``.parquet`` or ``.jsonl`` by suffix. ``prepare`` lists every raw row it cannot
convert, not only the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text.split(",") if "," in text else text


def parse_difficulty(items: list[str]) -> dict[str, Any]:
    """``["steps=3", "kinds=arithmetic,repeat"]`` -> ``{"steps": 3, "kinds": ["arithmetic", "repeat"]}``."""
    knobs: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--difficulty: expected key=value, got {item!r}")
        knobs[key.strip()] = _parse_value(value.strip())
    return knobs


def synth_rows(task: str, n: int, seed: int, split: str, difficulty: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of synthetic ``task``: its ``generate(n, seed, split, **difficulty)``, or its ``generate_splits``."""
    from verity.data.task_registry import synthetic_tasks

    tasks = synthetic_tasks()
    if task not in tasks:
        if not tasks.names():
            raise ValueError(
                f"--task: unknown task {task!r}: no synthetic tasks are registered; install "
                "verity-toyworld (pip install -e packages/toyworld) or a plug-in that registers tasks"
            )
        raise ValueError(f"--task: unknown task {task!r}; known tasks: {tasks.names()}")
    module = tasks.get(task)
    configs = [
        obj
        for name, obj in vars(module).items()
        if name.endswith("Config") and dataclasses.is_dataclass(obj) and isinstance(obj, type)
    ]
    if difficulty and not configs:
        raise ValueError(f"--difficulty: task {task!r} has no difficulty knobs")
    if configs:
        knobs = [field.name for field in dataclasses.fields(configs[0])]
        unknown = [key for key in difficulty if key not in knobs]
        if unknown:
            raise ValueError(
                f"--difficulty: task {task!r} has no knob {', '.join(map(repr, unknown))}; its knobs: {knobs}"
            )
    if hasattr(module, "generate"):
        return module.generate(n, seed=seed, split=split, **difficulty)
    config = configs[0](**difficulty) if configs else None
    train, test = module.generate_splits(
        n if split != "test" else 0, n if split == "test" else 0, seed, config
    )
    return test if split == "test" else train


def build_parser() -> argparse.ArgumentParser:
    """The ``verity data`` argument parser."""
    parser = argparse.ArgumentParser(prog="verity data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="convert a raw GSM8K/MATH/AIME file to the verl schema")
    prepare.add_argument("--format", required=True, choices=["gsm8k", "math", "aime"])
    prepare.add_argument("--input", required=True, help="raw file (.jsonl, .json, .parquet, .csv)")
    prepare.add_argument("--output", required=True, help="output file (.parquet or .jsonl)")
    prepare.add_argument("--split", default=None, help="split name stored in extra_info")
    prepare.add_argument(
        "--instruction", default=None, help="replace the instruction appended to each question"
    )
    prepare.add_argument("--limit", type=int, default=None, help="convert only the first N rows")
    synth = commands.add_parser("synth", help="generate rows of a synthetic task")
    synth.add_argument("--task", required=True)
    synth.add_argument("--n", type=int, required=True, help="number of rows")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--split", default="train")
    synth.add_argument("--output", required=True, help="output file (.parquet or .jsonl)")
    synth.add_argument(
        "--difficulty", nargs="*", default=[], metavar="KEY=VALUE", help="task difficulty knobs"
    )
    check = commands.add_parser("check", help="validate verl-schema files, listing malformed rows")
    check.add_argument("files", nargs="+")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``verity data``; returns the exit code (0 ok, 1 bad input, 2 usage error)."""
    args = build_parser().parse_args(argv)
    from verity.data.prepare import prepare_file, write_rows
    from verity.data.verl_dataset import check_rows, read_rows

    try:
        if args.command == "prepare":
            count = prepare_file(
                args.format, args.input, args.output, args.split, args.instruction, args.limit
            )
            print(f"wrote {count} rows ({args.format}) to {args.output}")
        elif args.command == "synth":
            if args.n < 1:
                raise ValueError(f"--n: expected >= 1, got {args.n}")
            rows = synth_rows(args.task, args.n, args.seed, args.split, parse_difficulty(args.difficulty))
            write_rows(rows, args.output)
            print(f"wrote {len(rows)} rows of {args.task} to {args.output}")
        else:
            failed = False
            for path in args.files:
                rows = read_rows(path)
                bad = check_rows(rows)
                for row, problem in bad[:50]:
                    print(f"{path}: row {row}: {problem}")
                empty = "" if rows else " (an empty file: nothing to train on)"
                print(f"{path}: {len(rows)} rows, {len(bad)} malformed{empty}")
                failed = failed or bool(bad) or not rows
            return 1 if failed else 0
    except (ValueError, FileNotFoundError, KeyError, TypeError) as error:
        print(f"verity data {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
