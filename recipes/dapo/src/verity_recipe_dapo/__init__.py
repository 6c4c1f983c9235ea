"""The DAPO recipe: plug-ins to the one RL loop, pinned configs and the metrics they must reach (README.md).

DAPO (Yu et al. 2025) is GRPO plus four techniques. Two exist in the runtime and are
pinned by the configs: clip-higher (``actor.policy_loss.clip_ratio_low/high`` = 0.2/0.28)
and the token-level loss (``actor.policy_loss.loss_agg_mode=token-mean``); no KL term.
The rest is this package's plug-in (:mod:`verity_recipe_dapo.plugin`, loaded through the
``verity.plugins`` entry point): dynamic sampling, overlong reward shaping, overlong
filtering (the ``dapo:`` config section) and the embedded task of the CPU config.

    from verity.config import load_config
    from verity_recipe_dapo import config_path
    cfg = load_config([], config_file=config_path("cpu"))
"""

from __future__ import annotations

from pathlib import Path

from verity.config import named_config_file

NAME = "dapo"
PAPER = "Yu et al., DAPO: An Open-Source LLM Reinforcement Learning System at Scale (2025), arXiv:2503.14476"
FOLDER = Path(__file__).parent


def config_path(name: str = "cpu") -> Path:
    """The path of ``configs/<name>.yaml``; FileNotFoundError naming the configs there otherwise."""
    return named_config_file(FOLDER / "configs", name)
