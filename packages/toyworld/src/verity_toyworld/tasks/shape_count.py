"""Count the shapes of one colour in a small drawn picture (a synthetic visual task).

Each problem is a 56x56 white picture drawn with Pillow: its 4x4 grid of 14-pixel cells
holds up to ``max_shapes`` filled squares or circles (one per cell, so shapes never
overlap), each red, green or blue. The question names one colour; the answer is how many
shapes have it (0 .. ``max_shapes``). Rows follow verl's multimodal schema::

    {"prompt": [{"role": "user", "content": "<image>red?"}],
     "images": [{"bytes": <PNG bytes>, "path": None}],
     "data_source": "verity/shape_count", "ability": "vision",
     "reward_model": {"style": "rule", "ground_truth": "3"},
     "extra_info": {"split": "train", "index": 0, "colour": "red", "layout": "..."}}

The answer is in the picture only: the prompt text is one of three questions, so a model
that ignores the image can do no better than guessing the most common count per colour.
Train and test splits never share a (picture, question) pair. The verifier :func:`score`
gives 1.0 when the response is exactly the integer answer (cut at EOS or a newline).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from typing import Any

from verity_toyworld.tasks._common import draw_rows
from verity_toyworld.tasks.arithmetic import extract_answer

DATA_SOURCE = "verity/shape_count"
ABILITY = "vision"
SIZE = 56
CELL = 14
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 30),
    "blue": (30, 60, 220),
}


@dataclass(frozen=True)
class ShapeCountConfig:
    """``max_shapes``: most shapes in a picture (1..16); ``min_shapes``: fewest (0..max_shapes).

    ``question_first``: the question comes before the picture (``"red?<image>"``) instead of after
    it (``"<image>red?"``). A causal model then reads the picture already knowing the colour, so
    each image token can count its own shapes of that colour (the ``shape-count`` preset's form).
    """

    min_shapes: int = 1
    max_shapes: int = 4
    question_first: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_shapes <= (SIZE // CELL) ** 2:
            raise ValueError(f"max_shapes: expected 1..{(SIZE // CELL) ** 2}, got {self.max_shapes}")
        if not 0 <= self.min_shapes <= self.max_shapes:
            raise ValueError(f"min_shapes: expected 0..max_shapes={self.max_shapes}, got {self.min_shapes}")


def draw_picture(layout: list[tuple[int, str, str]]) -> bytes:
    """PNG bytes of a picture: ``layout`` lists ``(cell 0..15, colour name, "square" | "circle")``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    cells = SIZE // CELL
    for cell, colour, kind in layout:
        x, y = (cell % cells) * CELL + 2, (cell // cells) * CELL + 2
        box = (x, y, x + CELL - 5, y + CELL - 5)
        (pen.rectangle if kind == "square" else pen.ellipse)(box, fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def blank_picture() -> bytes:
    """A white picture of the task's size (the ablation that hides the answer)."""
    return draw_picture([])


def _draw(config: ShapeCountConfig):
    def draw(rng: random.Random) -> tuple[str, str, str, dict[str, Any]]:
        count = rng.randint(config.min_shapes, config.max_shapes)
        cells = sorted(rng.sample(range((SIZE // CELL) ** 2), count))
        layout = [(c, rng.choice(list(COLOURS)), rng.choice(("square", "circle"))) for c in cells]
        colour = rng.choice(list(COLOURS))
        answer = str(sum(1 for _, c, _ in layout if c == colour))
        key = f"{colour}|" + ";".join(f"{c},{col},{k}" for c, col, k in layout)
        prompt = f"{colour}?<image>" if config.question_first else f"<image>{colour}?"
        return key, prompt, answer, {"colour": colour, "layout": key.split("|", 1)[1]}

    return draw


def generate_splits(
    num_train: int, num_test: int, seed: int = 0, config: ShapeCountConfig | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train_rows, test_rows)``: seeded, no (picture, question) pair in both splits, images as PNG bytes."""
    config = config or ShapeCountConfig()
    splits = draw_rows(_draw(config), {"train": num_train, "test": num_test}, seed, DATA_SOURCE, ABILITY)
    for rows in splits.values():
        for row in rows:
            layout = [
                (int(c), col, kind)
                for c, col, kind in (
                    item.split(",") for item in row["extra_info"]["layout"].split(";") if item
                )
            ]
            row["images"] = [{"bytes": draw_picture(layout), "path": None}]
    return splits["train"], splits["test"]


def score(response_text: str, ground_truth: str | int) -> float:
    """1.0 when the response is exactly the integer ``ground_truth`` (cut at EOS or a newline), else 0.0."""
    answer = extract_answer(response_text)
    return 1.0 if answer is not None and int(answer) == int(str(ground_truth).strip()) else 0.0


__all__ = ["DATA_SOURCE", "ShapeCountConfig", "blank_picture", "draw_picture", "generate_splits", "score"]
