"""Turning chat prompts into the left-padded prompt tensors a rollout takes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, str]]


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Messages | str) -> str:
    """The text of a prompt: the tokenizer's chat template with the generation prompt appended.

    A plain string is returned unchanged; a tokenizer without a chat template
    gets the messages' contents concatenated.
    """
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise TypeError(
            f"messages: expected a str or a list of {{'role', 'content'}} dicts, got {messages!r}"
        )
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(message["content"] for message in messages)


def left_pad(
    sequences: Sequence[Sequence[int]], pad_token_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into ``(input_ids [B, L], attention_mask [B, L])`` int64.

    ``L`` is ``length`` or the longest sequence. Raises ValueError for an empty
    sequence or one longer than ``length``.
    """
    if not sequences:
        raise ValueError("sequences: expected at least one sequence, got none")
    longest = max(len(seq) for seq in sequences)
    width = longest if length is None else length
    if longest > width:
        raise ValueError(f"sequences: longest has {longest} tokens, more than length={width}")
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequences[{row}]: expected at least one token, got none")
        input_ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
        attention_mask[row, width - len(seq) :] = 1
    return input_ids, attention_mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """position_ids [B, L] = cumsum(attention_mask) - 1, clipped at 0 (int64)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Messages | str],
    max_prompt_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Render (chat template), tokenize (no extra special tokens) and left-pad prompts.

    Returns ``input_ids``, ``attention_mask``, ``position_ids``, each [B, P];
    P is the longest prompt. Raises ValueError when a prompt is longer than
    ``max_prompt_length`` tokens, or the tokenizer has no pad token.
    """
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer: expected a pad token (tokenizer.pad_token_id is None)")
    texts = [render_chat(tokenizer, prompt) for prompt in prompts]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    if max_prompt_length is not None:
        for row, seq in enumerate(ids):
            if len(seq) > max_prompt_length:
                raise ValueError(
                    f"prompts[{row}]: {len(seq)} tokens, more than max_prompt_length={max_prompt_length}"
                )
    input_ids, attention_mask = left_pad(ids, tokenizer.pad_token_id)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
    }


def prompts_of_rows(rows: Sequence[dict[str, Any]]) -> list[Messages | str]:
    """The ``prompt`` field of each verl-schema row (a chat list or a string)."""
    prompts = []
    for index, row in enumerate(rows):
        if "prompt" not in row:
            raise KeyError(f"rows[{index}]: expected a 'prompt' field, found {sorted(row)}")
        prompt = row["prompt"]
        prompts.append(prompt if isinstance(prompt, str) else [dict(message) for message in prompt])
    return prompts
