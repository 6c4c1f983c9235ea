"""The tokens of tool answers, appended after a model turn exactly as the chat template renders them.

The loop works on token ids (the model's tokens are never re-tokenized). After a turn
it needs the tokens that the chat template puts between the end of that assistant
message and the start of the next one: the end-of-turn marker, the tool messages, and
the generation prompt of the next assistant turn. They are found by rendering a
conversation whose assistant message is a sentinel string::

    full   = template([user, assistant(SENTINEL), tool_1, ..., tool_k], add_generation_prompt=True)
    suffix = full[after the last SENTINEL:]

For Qwen2.5 that suffix is ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...
</tool_response><|im_end|>\\n<|im_start|>assistant\\n``. When the model's turn already
ended with its stop token and the suffix starts with that token's text, it is dropped
from the suffix (the model wrote it; it is trained). A turn that ended without a stop
token (a per-turn token limit) keeps it: it belongs to the template, not to the model.
A tokenizer without a chat template gets ``"\\n" + answers joined by "\\n" + "\\n"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["SENTINEL", "ToolMessageRenderer"]

SENTINEL = "VERITY-ASSISTANT-TURN-SENTINEL"


class ToolMessageRenderer:
    """Renders tool messages into the token ids appended after a model turn (see the module docstring).

    Raises ValueError at construction when the tokenizer's chat template cannot render a
    ``tool`` message or drops its content.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        probe = "verity-probe-answer"
        try:
            text = self.text([{"role": "tool", "name": "probe", "content": probe}], stop_text=None)
        except Exception as err:  # the template raised: say so with its message
            raise ValueError(
                f"the tokenizer's chat template cannot render a tool message: {type(err).__name__}: {err}"
            ) from None
        if probe not in text:
            raise ValueError("the tokenizer's chat template drops the content of tool messages")

    def text(self, messages: Sequence[dict[str, Any]], stop_text: str | None) -> str:
        """The text between the model's turn and its next turn.

        ``messages``: ``{"role": "tool", "name", "content"}`` dicts; ``stop_text``: the text of
        the stop token that ended the model's turn (None when it ended without one).
        """
        if not self.has_template:
            return "\n" + "\n".join(str(m["content"]) for m in messages) + "\n"
        conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}]
        full = self.tokenizer.apply_chat_template(
            conversation + [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        position = full.rfind(SENTINEL)
        if position < 0:
            raise ValueError("the chat template does not render the assistant message's content")
        suffix = full[position + len(SENTINEL) :]
        if stop_text and suffix.startswith(stop_text):
            suffix = suffix[len(stop_text) :]
        return suffix

    def encode(self, messages: Sequence[dict[str, Any]], stop_text: str | None) -> list[int]:
        """The token ids of :meth:`text` (no special tokens added by the tokenizer)."""
        ids = self.tokenizer(self.text(messages, stop_text), add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]
