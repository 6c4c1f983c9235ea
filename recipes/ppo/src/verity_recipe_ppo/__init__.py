"""The PPO recipe: pinned configs and the metrics they must reach (see README.md).

PPO needs nothing beyond the runtime: ``algorithm.advantage.estimator=gae`` turns on
the critic (the ``critic`` section) and GAE from ``verity.algorithms``. This package holds only
configuration and promises.

    from verity.config import load_config
    from verity_recipe_ppo import config_path
    cfg = load_config([], config_file=config_path("cpu"))
"""

from __future__ import annotations

from pathlib import Path

from verity.config import named_config_file

NAME = "ppo"
PAPER = "Schulman et al., Proximal Policy Optimization Algorithms (2017), arXiv:1707.06347"
FOLDER = Path(__file__).parent


def config_path(name: str = "cpu") -> Path:
    """The path of ``configs/<name>.yaml``; FileNotFoundError naming the configs there otherwise."""
    return named_config_file(FOLDER / "configs", name)
