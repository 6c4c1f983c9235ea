"""The embedded task of the DAPO recipe's CPU config: 4-operand arithmetic answered after ``Answer:``.

The embedded preset ``dapo-arith4`` (``model.embedded_preset=dapo-arith4``) is the tiny
Qwen2 of the runtime's embedded default, warm-started on a harder task than the
quickstart's, in the DAPO-Math answer format:

- problems: four one-digit operands with ``+``/``-`` (``"4-2+8+4="``, never below zero):
  three additions or subtractions in a row, which the 0.5M-parameter model gets right
  about a third of the time when it samples;
- rows labelled ``data_source = "math_dapo"``, so they are scored like DAPO-Math-17k rows:
  the last ``Answer:`` line against the reference, +1 right / -1 wrong
  (``verity.rewards``'s ``dapo`` reward);
- the warm-start teacher answers ``Answer: 14``, but on ``pad_rate`` of the problems
  first writes a run of 1..``max_pad`` filler words on a line of their own
  (``"so so so\nAnswer: 14"``) — a stand-in for the overlong, repetitive generations the
  DAPO paper's overlong shaping is about. With the recipe's 20-token response budget a
  run of four or more words is cut before its answer (a truncated sample scores -1),
  shorter runs land in the 8-token punishment buffer, and greedy decoding of the
  warm-started model mostly repeats the filler until the budget runs out.

What there is to learn is to stop padding (every truncated sample is a lost answer) and a
little arithmetic; many prompts are always answered wrong by the warm-started model, and
more become always right as it improves, so without dynamic sampling a large share of
each batch's groups carries no signal.
"""

from __future__ import annotations

import random
from typing import Any

from verity_toyworld.presets import (
    EMBEDDED_PRESETS,
    SFT_TEACHERS,
    EmbeddedSettings,
    register_embedded_preset,
    register_sft_teacher,
)

PRESET = "dapo-arith4"
TEACHER = "dapo_padded_answer"


def padded_answer_teacher(rows: list[dict[str, Any]], settings: EmbeddedSettings) -> list[dict[str, Any]]:
    """Copies of ``rows`` with a response ``[<filler line>\\n]Answer: <ground truth>`` (module docstring).

    ``settings.teacher_config``: ``pad_rate`` (share of rows padded, seeded by ``sft_seed``),
    ``pad_word`` and ``max_pad`` (a padded row repeats the word 1..max_pad times, uniformly).
    """
    knobs = settings.teacher_config
    rate, word, most = float(knobs["pad_rate"]), str(knobs["pad_word"]), int(knobs["max_pad"])
    if not 0.0 <= rate <= 1.0 or most < 1 or not word.strip():
        raise ValueError(f"teacher_config: need pad_rate in [0, 1], max_pad >= 1 and a pad_word, got {knobs}")
    rng = random.Random(settings.sft_seed)
    out = []
    for row in rows:
        answer = f"Answer: {row['reward_model']['ground_truth']}"
        if rng.random() < rate:
            answer = " ".join([word] * rng.randint(1, most)) + "\n" + answer
        out.append({**row, "response": answer})
    return out


SETTINGS = EmbeddedSettings(
    task="arithmetic",
    task_config={"digits": 1, "operations": "+-", "operands": 4, "style": "expr"},
    num_train=6000,
    num_test=500,
    data_seed=0,
    sft_steps=1500,
    sft_slip_rate=0.0,
    data_source="math_dapo",
    teacher=TEACHER,
    teacher_config={"pad_rate": 0.5, "pad_word": "so", "max_pad": 5},
    eval_max_new_tokens=20,
)


def register_task() -> None:
    """Register the teacher and the ``dapo-arith4`` preset (once per process)."""
    if TEACHER not in SFT_TEACHERS.names():
        register_sft_teacher(TEACHER, padded_answer_teacher)
    if PRESET not in EMBEDDED_PRESETS.names():
        register_embedded_preset(PRESET, SETTINGS)
