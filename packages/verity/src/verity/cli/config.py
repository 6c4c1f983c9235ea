"""``verity config show [SECTION] [--config FILE] [key=value ...]``: every key, its value and its meaning.

    verity config show                         # the whole default config, commented
    verity config show actor.optim             # one section
    verity config show --config recipes/grpo/src/verity_recipe_grpo/configs/cpu.yaml trainer

The config is composed and validated exactly as ``verity train`` would (plug-in
sections included), then printed as YAML with each key's comment from the code. A model
preset's keys (``model.path=embedded``: the ``embedded-tiny`` preset) are marked
``[preset NAME]``, under a first line naming the preset and every key it set.
Exit codes: 0 shown; 2 bad config or unknown section.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="verity config", description="Show the run configuration.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print the composed config (or one section) with each key's comment")
    show.add_argument("section", nargs="?", help="a dotted section, e.g. actor or actor.optim")
    show.add_argument("--config", help="YAML config file starting with 'defaults: [verity, _self_]'")
    show.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. actor.optim.lr=1e-5")
    args = parser.parse_args(argv)
    # `verity config show trainer.total_steps=3` : a first word with '=' is an override, not a section
    if args.section and "=" in args.section:
        args.overrides.insert(0, args.section)
        args.section = None
    from verity.config import ConfigError, load_config
    from verity.config.describe import describe_config

    try:
        cfg = load_config(args.overrides, config_file=args.config)
        print(describe_config(cfg, args.section))
    except (ConfigError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) else err
        print(f"verity config: {message}", file=sys.stderr)
        return 2
    return 0
