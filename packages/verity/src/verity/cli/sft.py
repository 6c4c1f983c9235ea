"""``verity sft``: supervised warm-start of a causal LM, written as a Hugging Face checkpoint.

    verity sft --output ckpt/                                   # the embedded tiny model and task
    verity sft --model path/to/hf_model --train train.parquet --test test.parquet \
               --steps 1600 --lr 3e-3 --batch-size 64 --output ckpt/

``--model tiny`` (the default) builds a fresh tiny Qwen2 with the character
tokenizer; any other value is an HF model folder (its tokenizer is loaded from
the same folder unless ``--tokenizer`` says otherwise). Without ``--train``
the embedded default's arithmetic splits are generated (with the teacher's
answers as they are: no full-stop slips, see ``verity.trainer.embedded``). Rows are verl-schema
(parquet or JSONL); the target is ``response`` or ``reward_model.ground_truth``.
With a test file, held-out greedy accuracy is printed before and after.

Exit codes: 0 done; 2 bad arguments or input files.
"""

from __future__ import annotations

import argparse
import json
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
    """Rows of a verl-schema ``.parquet`` or ``.jsonl`` file."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if file.suffix == ".parquet":
        from verity.data.tasks.arithmetic import read_parquet_rows

        return read_parquet_rows(file)
    if file.suffix in (".jsonl", ".json"):
        return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    raise ValueError(f"{path}: expected a .parquet or .jsonl file")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.lr <= 0:
        print("verity sft: --steps and --batch-size must be >= 1 and --lr > 0", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoTokenizer

    from verity.data.char_tokenizer import CharTokenizer
    from verity.data.tasks.arithmetic import ArithmeticConfig, generate_splits
    from verity.data.tiny_model import build_tiny_qwen2_for, load_causal_lm
    from verity.trainer.embedded import EmbeddedSettings
    from verity.trainer.evaluate import evaluate_greedy
    from verity.trainer.sft import run_sft

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.train:
            train_rows = read_rows(args.train)
            test_rows = read_rows(args.test) if args.test else []
        else:
            settings = EmbeddedSettings()
            train_rows, test_rows = generate_splits(
                settings.num_train,
                settings.num_test,
                settings.data_seed,
                ArithmeticConfig(**settings.task_config),
            )
            if args.test:
                test_rows = read_rows(args.test)
        if args.model == "tiny":
            tokenizer = CharTokenizer()
            model = build_tiny_qwen2_for(tokenizer, seed=args.seed)
        else:
            model = load_causal_lm(args.model)
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
