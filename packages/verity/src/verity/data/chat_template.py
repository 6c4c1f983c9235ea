"""Turn a chat message list into prompt text and token ids with the model's tokenizer.

When the tokenizer has a chat template, the prompt is
``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``
(the template adds any BOS itself, so the text is then encoded without special
tokens). A tokenizer without a chat template (a base model) gets a plain fallback:
the messages' contents joined by a newline, encoded with the tokenizer's own
special-token convention (e.g. a leading BOS).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Messages = Sequence[Mapping[str, Any]]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    messages: Messages,
    tokenizer: Any,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for ``messages`` (see the module docstring for the two cases)."""
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **dict(chat_template_kwargs or {}),
        )
        if not isinstance(text, str):
            raise TypeError(f"tokenizer.apply_chat_template returned {type(text).__name__}, expected str")
        return text
    return "\n".join(str(m["content"]) for m in messages)


def encode_prompts(texts: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Token ids of rendered prompts (a list of int lists), one call for the whole list."""
    if not texts:
        return []
    add_special = not has_chat_template(tokenizer)
    encoded = tokenizer(list(texts), add_special_tokens=add_special)["input_ids"]
    return [list(map(int, ids)) for ids in encoded]


def pad_token_id_of(tokenizer: Any) -> int:
    """The id used for left-padding prompts: ``pad_token_id``, else ``eos_token_id``; ValueError if neither."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    raise ValueError("tokenizer: has neither pad_token_id nor eos_token_id; set tokenizer.pad_token")
