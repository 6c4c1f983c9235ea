"""A dense reward file for runs whose every step must move the policy (resume and parity tests)."""

from __future__ import annotations

from pathlib import Path

DIGIT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Share of digit characters in the response: dense, so every sample moves the policy."""
    return sum(ch.isdigit() for ch in solution_str) / max(1, len(solution_str))
'''


def write_digit_reward(folder: Path) -> str:
    """Write :data:`DIGIT_REWARD` to ``folder/digits.py``; return its path (for ``reward.custom_path``)."""
    path = Path(folder) / "digits.py"
    path.write_text(DIGIT_REWARD)
    return str(path)
