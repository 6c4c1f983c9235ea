"""``verity train [--config FILE] [key=value ...]``: one RL run.

    verity train trainer.total_steps=100 actor.optim.lr=1e-5
    verity train --config recipes/grpo/src/verity_recipe_grpo/configs/cpu.yaml data.train_files=[train.parquet]

The configuration is validated (unknown keys, batch arithmetic, missing files)
before any worker starts; a bad one exits with code 2 and names the key.

Exit codes: 0 done; 2 bad config, data or reward function (found before any worker
starts), the output folder is in use by another run, or the Ray cluster cannot hold the
run's worker pools (the placement plan names what was asked and what each node has free); 1 a worker died, a stage timed
out or too many reward samples failed (the message names the role, rank and cause, and
the last complete checkpoint, when there is one); 143 stopped by SIGTERM, 130 by Ctrl-C, after
saving a checkpoint at the end of the step (the command that resumes is printed); a second Ctrl-C
stops at once (exit 130). A :class:`verity.errors.RunError` (raised on purpose, e.g. by a
plug-in) prints its sentence and exits with its ``exit_code``. The whole list, message by
message: docs/failures.md.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from typing import Any

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


def quiet_logging(level: int = logging.INFO) -> None:
    """Console logging of a run: verity's lines at ``level``, libraries' chatter (font caches ...) at WARNING."""
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for name in ("matplotlib", "PIL", "filelock", "urllib3", "asyncio"):
        logging.getLogger(name).setLevel(logging.WARNING)


def resume_command(argv: list[str], prog: str = "verity train") -> str:
    """The command that continues this run: the same arguments with ``trainer.resume=auto``."""
    kept = [a for a in argv if not a.lstrip("+").startswith("trainer.resume=")]
    if len(kept) != len(argv):
        kept.append("trainer.resume=auto")
    return shlex.join([*prog.split(), *kept])


def execute(cfg: Any, prog: str, argv: list[str] | None = None) -> tuple[int, dict[str, Any] | None]:
    """Run ``cfg``; return ``(exit code, summary or None)``, printing a sentence for each known failure.

    Shared by ``verity train`` and ``verity quickstart`` (exit codes in the module docstring).
    ``argv``: the command's arguments, to print the command that resumes a stopped run.
    """
    from verity.checkpoint.resume import last_checkpoint_hint
    from verity.checkpoint.signals import TrainingStopped
    from verity.controller import ResourceUnavailableError, WorkerError
    from verity.data.verl_dataset import MalformedDatasetError, PromptTooLongError
    from verity.errors import RunError
    from verity.launch.run import run_training
    from verity.launch.run_dir import OutputDirBusyError
    from verity.rewards.failures import RewardFailureError
    from verity.rewards.preflight import RewardSetupError
    from verity.trainer.stage_guard import StageTimeoutError

    try:
        return 0, run_training(cfg)
    except (
        ConfigError,
        MalformedDatasetError,
        PromptTooLongError,
        OutputDirBusyError,
        RewardSetupError,
        ResourceUnavailableError,
    ) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2, None
    except TrainingStopped as err:
        print(f"{prog}: {err}", file=sys.stderr)
        print(f"{prog}: resume with: {resume_command(list(argv or []), prog)}", file=sys.stderr)
        return err.exit_code, None
    except RunError as err:  # raised on purpose (a plug-in's or the runtime's): its sentence, its exit code
        return _stopped(prog, str(err), err.exit_code, last_checkpoint_hint(cfg)), None
    except WorkerError as err:
        if isinstance(err.cause, RunError):  # raised on purpose in a worker: its sentence, not a traceback
            return _stopped(prog, str(err.cause), err.cause.exit_code, last_checkpoint_hint(cfg)), None
        return _stopped(prog, f"{type(err).__name__}: {err}", 1, last_checkpoint_hint(cfg)), None
    except (StageTimeoutError, RewardFailureError) as err:
        return _stopped(prog, f"{type(err).__name__}: {err}", 1, last_checkpoint_hint(cfg)), None


def _stopped(prog: str, message: str, code: int, checkpoint_hint: str | None) -> int:
    """Print why the run stopped, and the checkpoint to continue from when there is one; return ``code``."""
    print(f"{prog}: {message}", file=sys.stderr)
    if checkpoint_hint is not None:  # no hint before the first checkpoint: nothing to resume
        print(f"{prog}: {checkpoint_hint}", file=sys.stderr)
    return code


def resumed_line(summary: dict[str, Any], cfg: Any) -> str | None:
    """A sentence when this invocation continued a checkpoint (None for a fresh run)."""
    step = summary.get("resumed_from_step")
    if step is None:
        return None
    total = cfg.trainer.total_steps
    if step >= total:
        return (
            f"the run in {cfg.trainer.output_dir} was already complete (step {step} of {total}): no step ran "
            "now, the results below are its own (trainer.resume=off starts over, a larger "
            "trainer.total_steps continues it)"
        )
    return f"resumed from step {step}: steps {step + 1}-{total} ran now"


def stop_at_once_on_ctrl_c(main: Any, argv: list[str], prog: str) -> int:
    """``main(argv)``, with a second Ctrl-C (a ``KeyboardInterrupt``) reported in one line, exit 130."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print(
            f"{prog}: stopped at once on Ctrl-C (the current step is lost; the last complete "
            "checkpoint, if any, is intact)",
            file=sys.stderr,
        )
        return 130


def main(argv: list[str]) -> int:
    return stop_at_once_on_ctrl_c(_main, argv, "verity train")


def _main(argv: list[str]) -> int:
    args = parse(argv, "verity train", "Run one RL training job.")
    quiet_logging()
    try:
        cfg = load_config(args.overrides, config_file=args.config)
    except ConfigError as err:
        print(f"verity train: {err}", file=sys.stderr)
        return 2
    if args.help_config:
        from verity.config.describe import describe_config

        print(describe_config(cfg))
        return 0
    code, summary = execute(cfg, "verity train", argv)
    if summary is None:
        return code
    resumed = resumed_line(summary, cfg)
    if resumed:
        print(f"verity train: {resumed}")
    print(
        f"summary: {cfg.trainer.output_dir}/summary.json (accuracy {summary.get('accuracy_before')} -> "
        f"{summary.get('accuracy_after')})"
    )
    if summary.get("tracking_uri"):
        print(
            f"MLflow:  mlflow ui --backend-store-uri {summary['tracking_uri']}  (run {summary.get('run_id')})"
        )
    return 0
