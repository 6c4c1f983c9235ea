"""The vision-language recipe: GRPO on prompts with images (see README.md).

Images in prompts need nothing beyond the runtime: a verl-schema dataset with an
``images`` column and a Qwen2-VL-family model folder go through the same loop
(``docs/multimodal.md``), and the runtime's ``shape-count`` embedded preset is the tiny
Qwen2.5-VL warm-started on the visual counting task. This package holds configuration,
promises and the blank-picture ablation (``scripts/blank_ablation.py``).

    from verity.config import load_config
    from verity_recipe_vlm import config_path
    cfg = load_config([], config_file=config_path("cpu"))
"""

from __future__ import annotations

from pathlib import Path

from verity.config import named_config_file

NAME = "vlm"
PAPER = "Shao et al., DeepSeekMath (2024), arXiv:2402.03300 (GRPO); Bai et al., Qwen2.5-VL (2025), arXiv:2502.13923"
FOLDER = Path(__file__).parent


def config_path(name: str = "cpu") -> Path:
    """The path of ``configs/<name>.yaml``; FileNotFoundError naming the configs there otherwise."""
    return named_config_file(FOLDER / "configs", name)
