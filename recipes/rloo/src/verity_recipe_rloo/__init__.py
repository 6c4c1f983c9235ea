"""The RLOO recipe: pinned configs and the metrics they must reach (see README.md).

RLOO needs nothing beyond the runtime: ``algorithm.advantage.estimator=rloo`` picks
the leave-one-out estimator from ``verity.algorithms``. This package holds only
configuration and promises.

    from verity.config import load_config
    from verity_recipe_rloo import config_path
    cfg = load_config([], config_file=config_path("cpu"))
"""

from __future__ import annotations

from pathlib import Path

from verity.config import named_config_file

NAME = "rloo"
PAPER = "Ahmadian et al., Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs (2024), arXiv:2402.14740"
FOLDER = Path(__file__).parent


def config_path(name: str = "cpu") -> Path:
    """The path of ``configs/<name>.yaml``; FileNotFoundError naming the configs there otherwise."""
    return named_config_file(FOLDER / "configs", name)
