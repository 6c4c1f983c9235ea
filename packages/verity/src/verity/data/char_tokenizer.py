"""A character-level tokenizer that is an ordinary Hugging Face fast tokenizer.

Every printable ASCII character (codes 32..126) and the newline is one token;
``<pad>``, ``<bos>`` and ``<eos>`` (plus ``<unk>`` for anything else) are special
tokens. The tokenizer is built with the ``tokenizers`` library (a ``WordLevel``
model over single characters behind a pre-tokenizer that isolates every
character, and a ``Fuse`` decoder that joins them back without spaces) and
wrapped in :class:`transformers.PreTrainedTokenizerFast`, so it is saved with
``save_pretrained`` and loaded with ``AutoTokenizer.from_pretrained(dir)`` exactly
like a real checkpoint's tokenizer. Whatever loads a real model's tokenizer
therefore loads this one too.

Like Qwen's tokenizers it adds no special tokens when encoding; the chat
template puts ``<bos>`` in front of the rendered conversation and renders each
message's content verbatim (no role markers), which keeps prompts short for a
character model::

    apply_chat_template([{"role": "user", "content": "2+3="}], tokenize=False,
                        add_generation_prompt=True) == "<bos>2+3="
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

DEFAULT_CHARACTERS: tuple[str, ...] = tuple(chr(code) for code in range(32, 127)) + ("\n",)
"""Printable ASCII (space .. tilde) and the newline."""

CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""Renders ``<bos>`` followed by every message's content, verbatim."""

# The class name written into tokenizer_config.json, so that any transformers
# version resolves the saved files to its generic fast tokenizer.
_SAVED_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def build_char_backend(characters: Iterable[str] = DEFAULT_CHARACTERS) -> Tokenizer:
    """Build the raw ``tokenizers.Tokenizer``: ids 0..3 are the special tokens, then one id per character.

    Raises ValueError when ``characters`` has an entry that is not exactly one
    character, repeats a character, or is empty.
    """
    chars = list(characters)
    if not chars:
        raise ValueError("characters: expected at least one character, got none")
    for char in chars:
        if not isinstance(char, str) or len(char) != 1:
            raise ValueError(f"characters: expected single characters, got {char!r}")
    if len(set(chars)) != len(chars):
        raise ValueError("characters: expected each character once, found repeats")
    vocab = {token: index for index, token in enumerate(list(SPECIAL_TOKENS) + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # "[\s\S]" matches any single character, newlines included.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return backend


class CharTokenizer(PreTrainedTokenizerFast):
    """Character-level :class:`PreTrainedTokenizerFast` (see the module docstring).

    ``CharTokenizer()`` builds the default vocabulary (100 tokens: 4 special + 96
    characters); ``CharTokenizer(characters="0123456789+-=")`` a smaller one.
    ``CharTokenizer.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``
    both load a saved one (the latter as a plain ``PreTrainedTokenizerFast``,
    which behaves identically).
    """

    def __init__(self, *args: Any, characters: Iterable[str] | None = None, **kwargs: Any) -> None:
        building = not args and "tokenizer_object" not in kwargs and "tokenizer_file" not in kwargs
        if building:
            kwargs["tokenizer_object"] = build_char_backend(
                DEFAULT_CHARACTERS if characters is None else characters
            )
            kwargs.setdefault("pad_token", PAD_TOKEN)
            kwargs.setdefault("bos_token", BOS_TOKEN)
            kwargs.setdefault("eos_token", EOS_TOKEN)
            kwargs.setdefault("unk_token", UNK_TOKEN)
        elif characters is not None:
            raise ValueError("characters: only allowed when building a new tokenizer, not when loading one")
        super().__init__(*args, **kwargs)
        if building:
            self.chat_template = CHAT_TEMPLATE

    def save_pretrained(
        self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any
    ) -> tuple[str, ...]:
        """Save in Hugging Face format; the config names the generic fast tokenizer class."""
        files = super().save_pretrained(save_directory, *args, **kwargs)
        config_path = Path(save_directory) / "tokenizer_config.json"
        if config_path.exists():
            config = json.loads(config_path.read_text())
            config["tokenizer_class"] = _SAVED_TOKENIZER_CLASS
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return files
