"""Supervised warm-start: next-token training on prompt + answer + EOS, loss on the answer only.

A single-process loop meant to give a small model partial competence before
RL. Each example is ``chat_template(prompt) ++ tokens(answer) ++ [EOS]``,
right-padded; labels are -100 on the prompt and the padding, so with
``a`` = answer tokens (EOS included) over the whole batch

    loss = -(1 / |a|) * sum_{t in a} log p(x_t | x_<t)          (token mean)

Batches are drawn without replacement from a seeded permutation of the rows
(a new permutation each epoch). AdamW with linear warm-up to ``lr`` over
``warmup_steps`` then cosine decay to ``min_lr_ratio * lr`` at ``steps``;
gradients clipped to ``grad_clip`` (global L2 norm).

A row with images (verl's ``images`` column, ``<image>`` placeholders in its messages) needs the
model's image processor (``image_processor=``): its prompt is encoded as a run encodes it
(:class:`~verity.data.verl_dataset.PromptDataset`: image tokens expanded per image, rows with
a placeholder/image mismatch or an unreadable image named before training), and each batch
feeds the rows' patches and M-RoPE positions to the model
(:func:`verity.data.vision_inputs.vision_forward_inputs`), the same inputs the rollout and the
trainer give it.

The answer of a row is its ``response`` field when present, otherwise its
``reward_model.ground_truth`` (the synthetic tasks' rows answer with exactly that).

A multi-turn answer (a demonstration of tool use) is a ``response`` that is a list of
chat messages, ``assistant`` turns and the ``tool`` answers between them. It is laid out
token for token as the agent loop (:mod:`verity.rollout.agent`) lays out a rollout:
each assistant turn is its text + EOS (trained), each group of tool answers is what the
chat template puts after such a turn (:class:`~verity.rollout.agent.render.ToolMessageRenderer`;
in the context, with label -100, never trained). The loss is the token mean over the
trained tokens only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verity.rollout.prompts import prompts_of_rows, render_chat

IGNORE_INDEX = -100


@dataclass
class SFTResult:
    """What a warm-start did: per-step losses (nats per answer token), wall seconds, tokens seen."""

    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    answer_tokens: int = 0
    steps: int = 0


def sft_answer(row: dict[str, Any]) -> str:
    """The target text of a row: ``row["response"]`` if present, else ``row["reward_model"]["ground_truth"]``."""
    if "response" in row and row["response"] is not None:
        return str(row["response"])
    try:
        return str(row["reward_model"]["ground_truth"])
    except (KeyError, TypeError) as error:
        raise KeyError("row: expected a 'response' or a 'reward_model.ground_truth' field for SFT") from error


def multi_turn_target(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], renderer: Any = None
) -> tuple[list[int], list[int]]:
    """``(ids, trained)`` of a multi-turn answer (see the module docstring); ``trained[i]`` is 1 or 0.

    ``renderer``: a :class:`~verity.rollout.agent.render.ToolMessageRenderer` (built when None).
    Raises ValueError for a role other than ``assistant``/``tool`` or answers that do not
    follow an assistant turn.
    """
    from verity.rollout.agent.render import ToolMessageRenderer

    renderer = renderer or ToolMessageRenderer(tokenizer)
    eos = tokenizer.eos_token_id
    stop_text = tokenizer.decode([eos], skip_special_tokens=False)
    ids: list[int] = []
    trained: list[int] = []
    pending: list[dict[str, Any]] = []
    for index, message in enumerate(list(messages) + [{"role": "end"}]):
        role = message.get("role")
        if role == "tool":
            if not ids:
                raise ValueError(f"response[{index}]: a tool answer must follow an assistant turn")
            pending.append(
                {"role": "tool", "name": message.get("name", ""), "content": str(message["content"])}
            )
            continue
        if pending:
            rendered = renderer.encode(pending, stop_text)
            ids += rendered
            trained += [0] * len(rendered)
            pending = []
        if role == "assistant":
            turn = list(tokenizer(str(message["content"]), add_special_tokens=False)["input_ids"]) + [eos]
            ids += turn
            trained += [1] * len(turn)
        elif role != "end":
            raise ValueError(f"response[{index}]: expected role 'assistant' or 'tool', got {role!r}")
    return ids, trained


def image_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict[str, Any]], image_processor: Any
) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """Rows with images: ``(prompt_ids, pixel_values, image_grid_thw)`` per row, encoded as a run encodes them.

    ``pixel_values[i]`` is ``[patches_i, C*T*P*P]`` float32, ``image_grid_thw[i]`` ``[images_i, 3]``
    int64. Raises :class:`~verity.data.verl_dataset.MalformedDatasetError` naming bad rows.
    """
    from verity.data.verl_dataset import PromptDataset

    if image_processor is None:
        raise ValueError("image_processor: the SFT rows carry images; give the model's image processor")
    dataset = PromptDataset(list(rows), tokenizer, max_prompt_length=1 << 30, image_processor=image_processor)
    records = dataset.records
    if len(records) != len(rows):  # PromptDataset raises rather than drops with these settings
        raise RuntimeError(f"image_prompt_ids: encoded {len(records)} of {len(rows)} rows")
    return (
        [list(r.input_ids) for r in records],
        [r.pixel_values for r in records],
        [r.image_grid_thw for r in records],
    )


def tokenize_examples(
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    prompt_ids: Sequence[list[int]] | None = None,
) -> list[tuple[list[int], ...]]:
    """``(prompt_ids, answer_ids + [eos])`` per row (no extra special tokens added by the tokenizer).

    A row whose ``response`` is a list of messages gives ``(prompt_ids, answer_ids, trained)``
    instead (:func:`multi_turn_target`). ``prompt_ids`` (one list per row) replaces the chat
    template's encoding of the prompts (rows with images: :func:`image_prompt_ids`).
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer: expected an EOS token (tokenizer.eos_token_id is None)")
    examples: list[tuple[list[int], ...]] = []
    renderer = None
    for index, (prompt, row) in enumerate(zip(prompts_of_rows(rows), rows, strict=True)):
        if prompt_ids is not None:
            prompt_ids_row = prompt_ids[index]
        else:
            prompt_ids_row = tokenizer(render_chat(tokenizer, prompt), add_special_tokens=False)["input_ids"]
        if isinstance(row.get("response"), list):
            if renderer is None:
                from verity.rollout.agent.render import ToolMessageRenderer

                renderer = ToolMessageRenderer(tokenizer)
            examples.append((list(prompt_ids_row), *multi_turn_target(tokenizer, row["response"], renderer)))
            continue
        answer_ids = tokenizer(sft_answer(row), add_special_tokens=False)["input_ids"]
        examples.append((list(prompt_ids_row), list(answer_ids) + [tokenizer.eos_token_id]))
    return examples


def collate_examples(examples: Sequence[tuple[list[int], ...]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``prompt ++ answer`` into ``input_ids``, ``attention_mask``, ``labels`` [B, L] int64.

    ``labels`` equal ``input_ids`` on answer tokens and -100 elsewhere (the
    model shifts them by one internally); an example ``(prompt, answer, trained)``
    also has -100 where ``trained`` is 0 (a multi-turn answer's tool tokens).
    """
    width = max(len(e[0]) + len(e[1]) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        prompt, answer = example[0], example[1]
        ids = prompt + answer
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
        target = torch.tensor(answer, dtype=torch.long)
        if len(example) > 2:
            target = torch.where(torch.tensor(example[2], dtype=torch.bool), target, IGNORE_INDEX)
        labels[row, len(prompt) : len(ids)] = target
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def learning_rate_at(step: int, lr: float, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for 0-based ``step``: linear warm-up over ``warmup_steps``, then cosine to ``min_lr_ratio*lr``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def run_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    steps: int,
    lr: float = 3e-3,
    batch_size: int = 64,
    seed: int = 0,
    *,
    warmup_steps: int | None = None,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    log_every: int = 0,
    on_log: Callable[[int, float], None] | None = None,
    image_processor: Any = None,
) -> SFTResult:
    """Train ``model`` in place for ``steps`` optimizer steps of ``batch_size`` rows; returns an :class:`SFTResult`.

    ``warmup_steps`` defaults to ``min(50, steps // 10)``. Every ``log_every``
    steps (0: never) ``on_log(step, loss)`` is called (default: print).
    The model is left in eval mode. Same rows, settings and seed on the same
    machine give the same weights. Rows with images need ``image_processor`` (the module
    docstring says how they are fed).
    """
    if not rows:
        raise ValueError("rows: expected at least one training row, got none")
    if steps < 1:
        raise ValueError(f"steps: expected >= 1, got {steps}")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    if lr <= 0:
        raise ValueError(f"lr: expected > 0, got {lr}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    from verity.data.multimodal import has_images_column

    images: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    prompt_ids = None
    if has_images_column(rows):
        prompt_ids, pixel_values, grids = image_prompt_ids(tokenizer, rows, image_processor)
        images = (pixel_values, grids)
    examples = tokenize_examples(tokenizer, rows, prompt_ids)
    warmup = min(50, steps // 10) if warmup_steps is None else warmup_steps
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    result = SFTResult()
    started = time.perf_counter()
    model.train()
    for step in range(steps):
        picked = []
        while len(picked) < batch_size:
            if not order:
                order = torch.randperm(len(examples), generator=generator).tolist()
            picked.append(order.pop())
        batch = {k: v.to(device) for k, v in collate_examples([examples[i] for i in picked], pad_id).items()}
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, lr, steps, warmup, min_lr_ratio)
        extra: dict[str, torch.Tensor] = {}
        if images is not None:
            from verity.data.vision_inputs import vision_forward_inputs

            extra, _ = vision_forward_inputs(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                [images[0][i] for i in picked],
                [images[1][i] for i in picked],
            )
        loss = model(**batch, **extra).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        result.losses.append(float(loss.detach()))
        result.tokens += int(batch["attention_mask"].sum())
        result.answer_tokens += int((batch["labels"] != IGNORE_INDEX).sum())
        if log_every and (step + 1) % log_every == 0:
            (on_log or _print_log)(step + 1, result.losses[-1])
    model.eval()
    result.steps = steps
    result.seconds = time.perf_counter() - started
    return result


def _print_log(step: int, loss: float) -> None:
    print(f"sft step {step}: loss {loss:.4f}", flush=True)
