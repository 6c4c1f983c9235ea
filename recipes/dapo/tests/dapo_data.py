"""Small files in the verl schema of DAPO-Math-17k and of AIME 2024, written for the DAPO tests.

DAPO-Math-17k rows (``BytedTsinghua-SIA/DAPO-Math-17k``) hold the problem inside the
instruction below as one user message, ``data_source = "math_dapo"``, ``ability = "MATH"``,
``reward_model = {"ground_truth": <answer>, "style": "rule-lighteval/MATH_v2"}`` and an
``extra_info.index`` id. The AIME 2024 file of the DAPO release has the same layout.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def dapo_math_row(problem: str, answer: str, data_source: str = "math_dapo") -> dict[str, Any]:
    """One row in the DAPO-Math-17k layout (see the module docstring)."""
    return {
        "data_source": data_source,
        "prompt": [{"content": INSTRUCTION.format(problem=problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{problem}={answer}"))},
    }


def write_rows(rows: list[dict[str, Any]], path: Path) -> str:
    """Write ``rows`` to a parquet file; returns its path as text."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return str(path)


def sums(limit: int) -> list[tuple[str, str]]:
    """``("What is a + b?", "a+b")`` for a, b in 0..limit-1."""
    return [(f"What is {a} + {b}?", str(a + b)) for a in range(limit) for b in range(limit)]
