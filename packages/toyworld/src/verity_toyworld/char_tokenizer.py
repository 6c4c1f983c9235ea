"""A character-level tokenizer that is an ordinary Hugging Face fast tokenizer.

Every byte is one token, so every printable ASCII character (and the
newline) is one token and any other text still round-trips (as its UTF-8
bytes). ``<pad>``, ``<bos>``, ``<eos>`` (and an unused ``<unk>``) are special
tokens. Ids: 0..3 special, 4..98 the printable ASCII characters space..tilde
in code order, 99 the newline, 100..259 the remaining bytes.

How it is built, and why: a *byte-level BPE with no merges*, pre-tokenized
exactly as Qwen2's tokenizer does (GPT-style split, then the byte-to-symbol
mapping). Without merges the result is one token per byte whatever the split.
Transformers 5 loads any tokenizer saved beside a ``qwen2`` model config as
``Qwen2Tokenizer``, which rebuilds a byte-level BPE from the saved vocabulary
and merges; because this tokenizer *is* such a BPE, that rebuild gives the
very same ids. So ``AutoTokenizer.from_pretrained(model_dir)`` works on the
tiny model's folder exactly as on a real Qwen2.5 checkpoint, and on a folder
holding only the tokenizer (loaded as ``PreTrainedTokenizerFast``).

Like Qwen's tokenizers it adds no special tokens when encoding; the chat
template puts ``<bos>`` in front of the rendered conversation and renders each
message's content verbatim (no role markers; a tool's answer is wrapped in
``<tool_response>...</tool_response>`` as Hermes-style templates do), which keeps
prompts short for a character model::

    apply_chat_template([{"role": "user", "content": "2+3="}], tokenize=False,
                        add_generation_prompt=True) == "<bos>2+3="
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<tool_response>{{ message['content'] }}</tool_response>"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
)
"""Renders ``<bos>`` followed by every message's content, verbatim; a tool's answer (role ``tool``,
multi-turn rollouts) inside ``<tool_response>...</tool_response>``, so the model can tell it apart."""

# The GPT-2/Qwen2 split (contractions, letter runs, single digits, punctuation
# runs, newlines, spaces). With no merges it does not change the ids; it is
# kept identical to Qwen2's so both constructions agree token for token.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The class name written into tokenizer_config.json: any transformers version
# resolves it to its generic fast tokenizer, which reads tokenizer.json as is.
_SAVED_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def byte_symbols() -> dict[int, str]:
    """The byte-level BPE alphabet: byte value -> the printable character that stands for it.

    Bytes that are printable Latin-1 characters (``!``..``~``, ``¡``..``¬``,
    ``®``..``ÿ``) stand for themselves; the other 68 bytes (controls, space,
    DEL, NBSP, soft hyphen) are given the characters U+0100, U+0101, ... in
    byte order — so space is ``Ġ`` (U+0120) and newline ``Ċ`` (U+010A).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def char_vocabulary() -> dict[str, int]:
    """Token -> id (see the module docstring for the layout)."""
    symbols = byte_symbols()
    byte_order = [
        *range(32, 127),
        ord("\n"),
        *(b for b in range(256) if not 32 <= b < 127 and b != ord("\n")),
    ]
    tokens = list(SPECIAL_TOKENS) + [symbols[byte] for byte in byte_order]
    return {token: index for index, token in enumerate(tokens)}


def build_char_backend() -> Tokenizer:
    """The raw ``tokenizers.Tokenizer``: byte-level BPE without merges (one token per byte)."""
    backend = Tokenizer(
        models.BPE(
            vocab=char_vocabulary(),
            merges=[],
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


class CharTokenizer(PreTrainedTokenizerFast):
    """Character-level :class:`PreTrainedTokenizerFast` (see the module docstring).

    ``CharTokenizer()`` builds the 260-token vocabulary;
    ``CharTokenizer.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``
    both load a saved one and encode identically.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        building = not args and "tokenizer_object" not in kwargs and "tokenizer_file" not in kwargs
        if building:
            kwargs["tokenizer_object"] = build_char_backend()
            kwargs.setdefault("pad_token", PAD_TOKEN)
            kwargs.setdefault("bos_token", BOS_TOKEN)
            kwargs.setdefault("eos_token", EOS_TOKEN)
            kwargs.setdefault("unk_token", UNK_TOKEN)
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
