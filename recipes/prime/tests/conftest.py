"""Shared pieces of the PRIME recipe's tests: the repository's test helpers, a tiny model and task."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/helpers (tiny models, multi-process spawning) of the repository this recipe lives in;
# processes spawned by a test inherit sys.path
_HELPERS_ROOT = str(Path(__file__).resolve().parents[3] / "tests")
if _HELPERS_ROOT not in sys.path:
    sys.path.insert(0, _HELPERS_ROOT)


@pytest.fixture(scope="session")
def prime_tiny_model_and_task(tmp_path_factory) -> dict[str, str]:
    """An untrained tiny Qwen2 + character tokenizer in HF format, train/test files, a dense reward.

    The reward scores a response by its share of digit characters and calls it correct
    (``acc``) when it holds a digit at all: an untrained model (digits are 10 of its 260
    characters) gets both right and wrong samples in most groups of 4, so the accuracy
    filter keeps groups and the PRM has both labels to learn from.
    """
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tasks.arithmetic import ArithmeticConfig, write_splits
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    root = tmp_path_factory.mktemp("prime-tiny")
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    files = write_splits(
        root / "data", num_train=96, num_test=32, seed=0, config=ArithmeticConfig(digits=1, style="expr")
    )
    reward = root / "digits.py"
    reward.write_text(DIGIT_REWARD)
    return {
        "model": str(model_dir),
        "train": str(files["train"]),
        "test": str(files["test"]),
        "reward": str(reward),
    }


DIGIT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Share of digit characters in the response; correct when it holds a digit."""
    share = sum(ch.isdigit() for ch in solution_str) / max(1, len(solution_str))
    return {"score": share, "acc": share > 0}
'''
