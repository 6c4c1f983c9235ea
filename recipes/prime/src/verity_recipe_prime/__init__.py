"""The PRIME recipe: implicit process rewards as plug-ins on verity's one RL loop (see README.md).

PRIME (Cui et al. 2025) trains an implicit process reward model online from the
verifier's outcome labels and adds its dense, token-level rewards to RLOO's outcome
advantage. This package is a plug-in (``verity_recipe_prime.plugin``: the ``prm`` role,
the ``prm``/``prime`` config sections, the stages and the estimator) plus pinned
configs and the metrics they must reach.

    from verity.config import load_config
    from verity_recipe_prime import config_path
    cfg = load_config([], config_file=config_path("cpu"))
"""

from __future__ import annotations

from pathlib import Path

from verity.config import named_config_file

NAME = "prime"
PAPER = "Cui et al., Process Reinforcement through Implicit Rewards (2025), arXiv:2502.01456"
FOLDER = Path(__file__).parent


def config_path(name: str = "cpu") -> Path:
    """The path of ``configs/<name>.yaml``; FileNotFoundError naming the configs there otherwise."""
    return named_config_file(FOLDER / "configs", name)
