"""The GRPO recipe: pinned configs and the metrics they must reach (see README.md).

GRPO needs nothing beyond the runtime: ``algorithm.advantage.estimator=grpo`` picks
the group-relative estimator from ``verity.algorithms``. This package holds only
configuration and promises.

    from verity.config import load_config
    from verity_recipe_grpo import config_path
    cfg = load_config([], config_file=config_path("cpu"))
"""

from __future__ import annotations

from pathlib import Path

from verity.config import named_config_file

NAME = "grpo"
PAPER = "Shao et al., DeepSeekMath (2024), arXiv:2402.03300"
FOLDER = Path(__file__).parent


def config_path(name: str = "cpu") -> Path:
    """The path of ``configs/<name>.yaml``; FileNotFoundError naming the configs there otherwise."""
    return named_config_file(FOLDER / "configs", name)
