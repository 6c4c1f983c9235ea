"""``verity sft``: supervised warm-start of a causal LM, written as a Hugging Face checkpoint.

    verity sft --output ckpt/                                   # the embedded tiny model and task
    verity sft --model path/to/hf_model --train train.parquet --test test.parquet \
               --steps 1600 --lr 3e-3 --batch-size 64 --output ckpt/

``--model tiny`` (the default) builds a fresh model of the ``default`` embedded
preset (with ``verity-toyworld``: a tiny Qwen2 with the character tokenizer); any other value is an HF model folder (its tokenizer is loaded from
the same folder unless ``--tokenizer`` says otherwise). Without ``--train``
the ``default`` embedded preset's task splits are generated (with the task's own
answers: no full-stop slips, see ``verity_toyworld.build``). Rows are verl-schema
(parquet or JSONL); the target is ``response`` or ``reward_model.ground_truth``.
With a test file, held-out greedy accuracy is printed before and after.

Exit codes: 0 done; 2 bad arguments or input files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    parser = argparse.ArgumentParser(
        prog="verity sft", description="Supervised warm-start (SFT) of a causal LM."
    )
    parser.add_argument("--output", required=True, help="folder for the HF checkpoint (model + tokenizer)")
    parser.add_argument("--model", default="tiny", help="'tiny' (a fresh tiny Qwen2) or an HF model folder")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    parser.add_argument("--train", default=None, help="verl-schema train file (.parquet/.jsonl)")
    parser.add_argument("--test", default=None, help="verl-schema held-out file for greedy accuracy")
    parser.add_argument("--steps", type=int, default=3200, help="optimizer steps (default 3200)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per step (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="sampling order and tiny-model init seed")
    parser.add_argument("--log-every", type=int, default=100, help="print the loss every N steps (0: never)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser


def read_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a verl-schema ``.parquet``, ``.jsonl`` or ``.json`` file, each with a prompt and an answer.

    An empty file, one without a ``prompt`` column, or a row without an answer (``response``
    or ``reward_model.ground_truth``) is a ``ValueError`` naming the file (and the row).
    """
    from verity.data.verl_dataset import read_nonempty_rows
    from verity.sft import sft_answer

    rows = read_nonempty_rows(path)
    for index, row in enumerate(rows):
        try:
            sft_answer(row)
        except KeyError:
            raise ValueError(
                f"{path}: row {index} (0-based) has no answer to train on: SFT needs a 'response' "
                f"or a 'reward_model.ground_truth' field; the row's fields are {sorted(row)}"
            ) from None
    return rows


def argument_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the numbers and the output folder, checked before any work starts."""
    problems = [
        f"{flag} must be {bound}, got {value}"
        for flag, value, ok, bound in (
            ("--steps", args.steps, args.steps >= 1, ">= 1"),
            ("--batch-size", args.batch_size, args.batch_size >= 1, ">= 1"),
            ("--lr", args.lr, args.lr > 0, "> 0"),
        )
        if not ok
    ]
    out = Path(args.output).expanduser()
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking == out:
        problems.append(f"--output {args.output!r} exists and is not a folder; give a folder's path")
    elif blocking is not None:
        problems.append(
            f"--output {args.output!r} cannot be created: {str(blocking)!r} is a file, not a folder"
        )
    return problems


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    problems = argument_problems(args)
    if problems:
        print(f"verity sft: {'; '.join(problems)}", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoTokenizer

    from verity.data.embedded import embedded_preset
    from verity.engines.hf_loading import load_causal_lm
    from verity.evaluation.greedy import evaluate_greedy
    from verity.sft import run_sft

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.train:
            train_rows = read_rows(args.train)
            test_rows = read_rows(args.test) if args.test else []
        else:
            train_rows, test_rows = embedded_preset("default").task_rows()
            if args.test:
                test_rows = read_rows(args.test)
        if args.model == "tiny":
            model, tokenizer = embedded_preset("default").fresh_model(seed=args.seed)
        else:
            if not (Path(args.model).expanduser() / "config.json").is_file():
                raise FileNotFoundError(
                    f"--model: expected 'tiny' or an HF model folder with config.json, got {args.model!r}"
                )
            model = load_causal_lm(Path(args.model).expanduser()).eval()
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except (FileNotFoundError, ValueError, KeyError) as error:
        print(f"verity sft: {error}", file=sys.stderr)
        return 2
    if test_rows:
        print(f"held-out greedy accuracy before: {evaluate_greedy(model, tokenizer, test_rows):.1%}")
    result = run_sft(
        model,
        tokenizer,
        train_rows,
        args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        log_every=args.log_every,
    )
    print(f"sft: {args.steps} steps in {result.seconds:.1f} s, final loss {result.losses[-1]:.4f}")
    if test_rows:
        print(f"held-out greedy accuracy after: {evaluate_greedy(model, tokenizer, test_rows):.1%}")
    Path(args.output).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"checkpoint: {args.output}")
    return 0
