"""``verity train [--config FILE] [key=value ...]``: one RL run.

    verity train trainer.total_steps=100 actor.optim.lr=1e-5
    verity train --config recipes/grpo/configs/cpu.yaml data.train_files=[train.parquet]

The configuration is validated (unknown keys, batch arithmetic, missing files)
before any worker starts; a bad one exits with code 2 and names the key.

Exit codes: 0 done; 2 bad config or data; 1 a worker died or a stage timed out
(the message names the role, rank and cause, and the last complete checkpoint);
143 stopped by SIGTERM after saving a checkpoint (resume with trainer.resume=auto).
"""

from __future__ import annotations

import argparse
import logging
import sys

from verity.config import ConfigError, load_config


def parse(argv: list[str], prog: str, description: str) -> argparse.Namespace:
    """``--config FILE`` plus Hydra ``key=value`` overrides."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML config file starting with 'defaults: [verity, _self_]'")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. actor.optim.lr=1e-5")
    parser.add_argument(
        "--help-config",
        action="store_true",
        help="print every config key with its value and meaning (as composed from --config and the overrides), then exit",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv, "verity train", "Run one RL training job.")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.overrides, config_file=args.config)
    except ConfigError as err:
        print(f"verity train: {err}", file=sys.stderr)
        return 2
    if args.help_config:
        from verity.config.describe import describe_config

        print(describe_config(cfg))
        return 0
    from verity.checkpoint.resume import last_checkpoint_hint
    from verity.checkpoint.signals import EXIT_CODE_STOPPED, TrainingStopped
    from verity.controller import WorkerError
    from verity.data.verl_dataset import MalformedDatasetError, PromptTooLongError
    from verity.trainer.run import run_training
    from verity.trainer.stage_guard import StageTimeoutError

    try:
        summary = run_training(cfg)
    except (ConfigError, MalformedDatasetError, PromptTooLongError) as err:
        print(f"verity train: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        print(f"verity train: {err}", file=sys.stderr)
        return EXIT_CODE_STOPPED
    except (WorkerError, StageTimeoutError) as err:
        print(f"verity train: {type(err).__name__}: {err}", file=sys.stderr)
        print(f"verity train: {last_checkpoint_hint(cfg)}", file=sys.stderr)
        return 1
    print(
        f"summary: {cfg.trainer.output_dir}/summary.json (accuracy {summary.get('accuracy_before')} -> "
        f"{summary.get('accuracy_after')})"
    )
    return 0
