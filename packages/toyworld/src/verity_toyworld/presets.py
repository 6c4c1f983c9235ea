"""Named settings of the embedded default: task, row format, warm-start teacher, model shape, SFT.

``model.path=embedded`` builds (once, then reuses from a cache) a tiny model warm-started
on a synthetic task (:mod:`verity_toyworld.build`). What it builds is an
:class:`EmbeddedSettings`; ``model.embedded_preset`` picks one by name from
:data:`EMBEDDED_PRESETS` (the runtime's registry, :mod:`verity.data.embedded`). This package registers ``default`` (the quickstart's 2-digit
arithmetic) and ``multiply-tools`` (multiplication with a calculator tool, for the agent
loop: ``docs/agent-loop.md``); a recipe or a user's plug-in registers its own, e.g. a harder task with its
own answer format and teacher::

    register_embedded_preset("my-task", EmbeddedSettings(
        task="arithmetic", task_config={"digits": 2, "operands": 3, "operations": "+-", "style": "expr"},
        data_source="math_dapo",                 # rows scored by the DAPO reward (answer after "Answer:")
        teacher="my_teacher", teacher_config={"shown_steps": 1}, sft_steps=1600))

The row format: ``data_source`` relabels every row of both splits (the run's reward
dispatch then scores them with that source's verifier, and so does the warm-start's
own evaluation), and ``prompt_template`` wraps the task's prompt text (``{prompt}``).

The teacher writes the warm-start's target responses: a function
``teacher(train_rows, settings) -> rows`` registered in :data:`SFT_TEACHERS` that returns
copies of the rows with a ``response`` text each. The built-in ``answer`` teacher answers
with the bare integer and, on ``sft_slip_rate`` of the problems using one of
``sft_slip_operations``, adds a full stop (the designed mistake of the default; see
:mod:`verity_toyworld.build`).

Every field goes into the cache key (:meth:`EmbeddedSettings.key`), so a preset with
other settings builds its own entry.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verity.data.embedded import EMBEDDED_PRESETS, register_embedded_model
from verity.registry import Registry

__all__ = [
    "CONFIG_PRESET",
    "EMBEDDED_FORMAT",
    "EMBEDDED_PRESETS",
    "MODEL_FAMILIES",
    "SFT_TEACHERS",
    "EmbeddedSettings",
    "format_rows",
    "register_embedded_preset",
    "register_sft_teacher",
    "teacher_rows",
]

CONFIG_PRESET = Path(__file__).with_name("embedded-tiny.yaml")
"""The run settings a model of this package learns with (lr, lengths, sharding), shown by ``verity config show``."""

EMBEDDED_FORMAT = 4
"""Bump when the layout or the build procedure changes: old cache entries are then ignored."""

# Fields added after format 4, with their defaults: they enter the cache key only when they
# differ from these, so entries built before they existed (the default's) stay valid.
_LATER_FIELDS: dict[str, Any] = {
    "data_source": None,
    "prompt_template": "{prompt}",
    "teacher": "answer",
    "teacher_config": {},
    "eval_max_new_tokens": 16,
    "model_family": "qwen2",
}

MODEL_FAMILIES = ("qwen2", "qwen2_5_vl", "qwen3_moe", "qwen2_moe")
"""What an embedded model is built as: a tiny Qwen2 causal LM (:func:`verity_toyworld.tiny_model.build_tiny_qwen2_for`),
a tiny Qwen2.5-VL vision-language model (:func:`verity_toyworld.tiny_vlm.build_tiny_qwen2_5_vl`, for tasks
whose rows carry images) or a tiny mixture-of-experts causal LM (:func:`verity_toyworld.tiny_moe.build_tiny_moe_for`)."""


@dataclass(frozen=True)
class EmbeddedSettings:
    """Everything that determines an embedded model and its task files (all of it goes into the cache key).

    Task: ``task`` (a name in ``verity_toyworld.tasks.TASKS``) with ``task_config`` (its
    ``*Config`` knobs), ``num_train``/``num_test`` rows from ``data_seed``; rows
    relabelled to ``data_source`` (None: the task's own) with the user message
    ``prompt_template.format(prompt=...)``. Model: ``model_family`` (one of
    :data:`MODEL_FAMILIES`) shaped by ``model`` (the builder's keyword arguments; empty: its
    defaults) from ``model_seed``. Warm-start: ``sft_steps`` of ``sft_batch_size`` rows at ``sft_lr``
    from ``sft_seed`` on the responses of ``teacher`` (:data:`SFT_TEACHERS`, knobs in
    ``teacher_config``; the ``answer`` teacher's slip in ``sft_slip_rate`` /
    ``sft_slip_operations``). The build's greedy evaluation generates up to
    ``eval_max_new_tokens`` tokens.
    """

    task: str = "arithmetic"
    task_config: dict[str, Any] = field(
        default_factory=lambda: {"digits": 2, "operations": "+-", "operands": 2, "style": "expr"}
    )
    num_train: int = 6000
    num_test: int = 500
    data_seed: int = 0
    model_family: str = "qwen2"
    model: dict[str, int] = field(
        default_factory=lambda: {
            "hidden": 128,
            "layers": 2,
            "heads": 4,
            "kv_heads": 2,
            "intermediate": 512,
            "max_pos": 256,
        }
    )
    model_seed: int = 0
    sft_steps: int = 3200
    sft_lr: float = 3e-3
    sft_batch_size: int = 64
    sft_seed: int = 0
    sft_slip_rate: float = 0.7
    sft_slip_operations: str = "-"
    data_source: str | None = None
    prompt_template: str = "{prompt}"
    teacher: str = "answer"
    teacher_config: dict[str, Any] = field(default_factory=dict)
    eval_max_new_tokens: int = 16

    def __post_init__(self) -> None:
        if not 0.0 <= self.sft_slip_rate <= 1.0:
            raise ValueError(f"sft_slip_rate: expected a fraction in [0, 1], got {self.sft_slip_rate}")
        if self.sft_steps < 0:
            raise ValueError(f"sft_steps: expected >= 0 (0 skips the warm-start), got {self.sft_steps}")
        if self.num_train < 1 or self.num_test < 1:
            raise ValueError(f"num_train/num_test: expected >= 1, got {self.num_train}/{self.num_test}")
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template: expected a '{{prompt}}' field, got {self.prompt_template!r}")
        if self.model_family not in MODEL_FAMILIES:
            raise ValueError(
                f"model_family: expected one of {list(MODEL_FAMILIES)}, got {self.model_family!r}"
            )
        if self.eval_max_new_tokens < 1:
            raise ValueError(f"eval_max_new_tokens: expected >= 1, got {self.eval_max_new_tokens}")

    @property
    def config_preset(self) -> Path:
        """The learning settings of these tiny models (:data:`CONFIG_PRESET`), applied under the user's keys."""
        return CONFIG_PRESET

    @property
    def vision(self) -> bool:
        """Whether the model is a vision-language model (its task's rows carry images)."""
        return self.model_family == "qwen2_5_vl"

    def check(self) -> None:
        """ValueError when the teacher or the task is not registered (before anything is built)."""
        from verity.data.task_registry import synthetic_tasks

        SFT_TEACHERS.get(self.teacher)  # UnknownNameError is a ValueError naming the known teachers
        synthetic_tasks().get(self.task)

    def build(self, cache_dir: Path, sft_steps: int | None = None) -> Any:
        """The cached build of these settings under ``cache_dir`` (:func:`verity_toyworld.build.ensure_embedded_default`)."""
        from verity_toyworld.build import ensure_embedded_default

        return ensure_embedded_default(cache_dir, sft_steps=sft_steps, settings=self)

    def fresh_model(self, seed: int = 0) -> tuple[Any, Any]:
        """``(untrained model, tokenizer)``: a tiny Qwen2 of the builder's default shape (a tiny MoE of this
        preset's shape for an MoE family), character tokenizer."""
        from verity_toyworld.char_tokenizer import CharTokenizer
        from verity_toyworld.tiny_model import build_tiny_qwen2_for

        tokenizer = CharTokenizer()
        if self.model_family in ("qwen3_moe", "qwen2_moe"):
            from verity_toyworld.tiny_moe import build_tiny_moe_for

            return build_tiny_moe_for(tokenizer, family=self.model_family, seed=seed, **self.model), tokenizer
        return build_tiny_qwen2_for(tokenizer, seed=seed), tokenizer

    def task_rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``(train rows, test rows)`` of the task as generated (no teacher, no relabelling)."""
        from verity.data.task_registry import synthetic_tasks, task_config_class

        task = synthetic_tasks().get(self.task)
        config = task_config_class(task)(**self.task_config)
        return task.generate_splits(self.num_train, self.num_test, self.data_seed, config)

    def key(self) -> str:
        """16 hex digits identifying these settings and ``EMBEDDED_FORMAT``."""
        data = asdict(self)
        for name, default in _LATER_FIELDS.items():
            if data[name] == default:
                del data[name]
        text = json.dumps({"format": EMBEDDED_FORMAT, **data}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


Teacher = Callable[[list[dict[str, Any]], EmbeddedSettings], list[dict[str, Any]]]

SFT_TEACHERS: Registry[Teacher] = Registry("SFT teacher")


def register_embedded_preset(name: str, settings: EmbeddedSettings) -> None:
    """Make ``settings`` available as ``model.embedded_preset=<name>``."""
    if not isinstance(settings, EmbeddedSettings):
        raise TypeError(f"embedded preset {name!r}: expected EmbeddedSettings, got {type(settings).__name__}")
    register_embedded_model(name, settings)


def register_sft_teacher(name: str, teacher: Teacher) -> None:
    """Add a warm-start teacher ``teacher(train_rows, settings) -> rows with a 'response' each``."""
    SFT_TEACHERS.add(name, teacher)


def format_rows(rows: list[dict[str, Any]], settings: EmbeddedSettings) -> list[dict[str, Any]]:
    """Copies of ``rows`` relabelled to ``settings.data_source`` with the prompt in ``settings.prompt_template``.

    Unchanged rows (the same objects) when both are at their defaults.
    """
    if settings.data_source is None and settings.prompt_template == "{prompt}":
        return rows
    out = []
    for row in rows:
        messages = [dict(m) for m in row["prompt"]]
        messages[-1]["content"] = settings.prompt_template.format(prompt=messages[-1]["content"])
        out.append(
            {
                **row,
                "prompt": messages,
                "data_source": settings.data_source or row["data_source"],
            }
        )
    return out


def teacher_rows(
    rows: list[dict[str, Any]], slip_rate: float, slip_operations: str, seed: int = 0
) -> list[dict[str, Any]]:
    """Copies of ``rows`` with the ``answer`` teacher's ``response`` (see the module docstring).

    A row whose ``extra_info.expression`` uses one of ``slip_operations`` gets
    ``answer + "."`` with probability ``slip_rate`` (seeded); every other row
    the bare answer.
    """
    rng = random.Random(seed)
    out = []
    for row in rows:
        answer = str(row["reward_model"]["ground_truth"])
        expression = str(row.get("extra_info", {}).get("expression", ""))
        slips = any(op in expression for op in slip_operations) and rng.random() < slip_rate
        out.append({**row, "response": answer + "." if slips else answer})
    return out


def _answer_teacher(rows: list[dict[str, Any]], settings: EmbeddedSettings) -> list[dict[str, Any]]:
    return teacher_rows(rows, settings.sft_slip_rate, settings.sft_slip_operations, seed=settings.sft_seed)


def _multiply_tools_teacher(rows: list[dict[str, Any]], settings: EmbeddedSettings) -> list[dict[str, Any]]:
    """Tool demonstrations on ``teacher_config["tool_rate"]`` of the rows, the bare product on the others
    (:func:`verity_toyworld.tasks.multiply.tool_teacher_rows`)."""
    from verity_toyworld.tasks.multiply import tool_teacher_rows

    return tool_teacher_rows(rows, float(settings.teacher_config["tool_rate"]), seed=settings.sft_seed)


def _shape_count_teacher(rows: list[dict[str, Any]], settings: EmbeddedSettings) -> list[dict[str, Any]]:
    """The right count for every picture; on ``sft_slip_rate`` of the questions about
    ``teacher_config["slip_colour"]`` the count is followed by a full stop (the designed slip,
    as the ``answer`` teacher's on subtractions)."""
    rng = random.Random(settings.sft_seed)
    slip_colour = settings.teacher_config.get("slip_colour")
    out = []
    for row in rows:
        answer = str(row["reward_model"]["ground_truth"])
        slips = (
            row.get("extra_info", {}).get("colour") == slip_colour and rng.random() < settings.sft_slip_rate
        )
        out.append({**row, "response": answer + "." if slips else answer})
    return out


register_sft_teacher("answer", _answer_teacher)
register_sft_teacher("shape_count", _shape_count_teacher)
register_sft_teacher("multiply_tools", _multiply_tools_teacher)
register_embedded_preset("default", EmbeddedSettings())
# 3-digit x 2-digit products, which the tiny model cannot compute but can copy from a calculator: the
# warm-start calls the calculator on a third of the problems and guesses the product on the others
# (the multi-turn task of docs/agent-loop.md and of the grpo recipe's cpu-tools config)
register_embedded_preset(
    "multiply-tools",
    EmbeddedSettings(
        task="multiply",
        task_config={"digits_a": 3, "digits_b": 2},
        num_train=4000,
        num_test=256,
        sft_steps=600,
        sft_batch_size=32,
        sft_slip_rate=0.0,
        teacher="multiply_tools",
        teacher_config={"tool_rate": 0.3},
        eval_max_new_tokens=96,
    ),
)
# The tiny Qwen2.5-VL on the visual counting task (verity_toyworld.tasks.shape_count): how many shapes of
# a colour a 56x56 picture holds; the warm-start slips a full stop after most counts of blue shapes
# (the recipes/vlm task; docs/multimodal.md)
register_embedded_preset(
    "shape-count",
    EmbeddedSettings(
        task="shape_count",
        task_config={"min_shapes": 2, "max_shapes": 6, "question_first": True},
        num_train=3000,
        num_test=256,
        model_family="qwen2_5_vl",
        model={  # build_tiny_qwen2_5_vl's shape, pinned here so that it is part of the cache key
            "hidden": 128,
            "layers": 2,
            "heads": 4,
            "kv_heads": 2,
            "intermediate": 512,
            "max_pos": 512,
            "vision_hidden": 32,
            "vision_depth": 2,
            "vision_heads": 2,
            "vision_intermediate": 64,
        },
        sft_steps=8000,  # 4,000 left one build of three short of counting red (docs/multimodal.md)
        sft_batch_size=32,
        sft_lr=1e-3,  # 3e-3 leaves the model at the answer prior (measured; docs/multimodal.md)
        sft_slip_rate=0.7,
        teacher="shape_count",
        teacher_config={"slip_colour": "blue"},
        eval_max_new_tokens=4,
    ),
)
# The tiny Qwen3-MoE (8 experts, top-2 per token, 2 sparse layers; verity_toyworld.tiny_moe) on the
# default's arithmetic task and warm-start slip: the mixture-of-experts row of the grpo recipe (cpu-moe)
register_embedded_preset(
    "moe",
    EmbeddedSettings(
        model_family="qwen3_moe",
        model={  # build_tiny_moe's shape, pinned here so that it is part of the cache key
            "hidden": 64,
            "layers": 2,
            "heads": 4,
            "kv_heads": 2,
            "experts": 8,
            "top_k": 2,
            "expert_intermediate": 128,
            "max_pos": 256,
        },
        sft_steps=1600,
    ),
)
