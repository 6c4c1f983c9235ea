"""``verity quickstart [key=value ...]``: GRPO on the embedded default, with a before/after table.

Builds (or reuses from the cache) the tiny Qwen2 model, its character tokenizer and
the arithmetic task, warm-started by SFT; measures held-out greedy accuracy; runs
GRPO with the actor on 2 Ray workers (FSDP2 over gloo); measures again. Writes
``summary.json``, ``curves.png``, ``metrics.jsonl`` and an MLflow store into
``trainer.output_dir`` (default ``outputs/quickstart``).
"""

from __future__ import annotations

import logging
import sys
from importlib import resources

from verity.cli.train import parse, quiet_logging, stop_at_once_on_ctrl_c
from verity.config import ConfigError, load_config


def preset_path() -> str:
    """The quickstart's pinned config file shipped with the package."""
    return str(resources.files("verity.config") / "presets" / "quickstart.yaml")


def _percent(value: float | None) -> str:
    """``value`` as a percentage, or ``not run`` when that evaluation was switched off."""
    return "not run" if value is None else f"{value:.1%}"


def format_table(summary: dict) -> str:
    """The before/after table printed at the end of the quickstart."""
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    change = "" if before is None or after is None else f"{(after - before) * 100:+.1f} pts"
    rows = [("held-out accuracy (greedy)", _percent(before), _percent(after), change)]
    lines = [f"{'':28} {'before':>8} {'after':>8} {'change':>11}"]
    lines += [f"{name:28} {b:>8} {a:>8} {c:>11}" for name, b, a, c in rows]
    lines.append(f"RL steps: {summary['steps']}   training wall time: {summary['wall_seconds']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return stop_at_once_on_ctrl_c(_main, argv, "verity quickstart")


def _main(argv: list[str]) -> int:
    args = parse(argv, "verity quickstart", "GRPO on the embedded tiny model, before/after accuracy.")
    quiet_logging(logging.WARNING)
    try:
        cfg = load_config(
            args.overrides, config_file=args.config or preset_path(), preset=args.config is None
        )
    except ConfigError as err:
        print(f"verity quickstart: {err}", file=sys.stderr)
        return 2
    from verity.cli.train import execute, resumed_line

    code, summary = execute(cfg, "verity quickstart", argv)
    if summary is None:
        return code
    out = cfg.trainer.output_dir
    print()
    resumed = resumed_line(summary, cfg)
    if resumed:
        print(f"verity quickstart: {resumed}\n")
    print(format_table(summary))
    print(f"\noutputs: {out}/summary.json  {out}/curves.png  {out}/metrics.jsonl")
    print(
        f"MLflow:  {summary['tracking_uri'] and 'mlflow ui --backend-store-uri ' + summary['tracking_uri']}"
    )
    return 0
