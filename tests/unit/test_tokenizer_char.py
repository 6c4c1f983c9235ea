"""CharTokenizer: character ids, special tokens, chat template, Hugging Face save/load."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.tiny_model import build_tiny_qwen2_for


@pytest.fixture(scope="module")
def tokenizer() -> CharTokenizer:
    return CharTokenizer()


def test_vocabulary_layout(tokenizer):
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert len(tokenizer) == 260  # 4 special + 256 bytes
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.unk_token_id == 3
    # ' ' is code 32, the first character: id 4; 'A' is code 65: id 4 + 33; '~' 98; newline 99
    assert tokenizer(" A~\n", add_special_tokens=False)["input_ids"] == [4, 37, 98, 99]


def test_round_trip_every_character(tokenizer):
    text = "".join(chr(c) for c in range(32, 127)) + "\nAnn has 23 pens,  gets 14. Now? 37"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, nothing added
    assert tokenizer.decode(ids) == text


def test_special_tokens_in_text_and_decoding(tokenizer):
    ids = tokenizer("12<eos>")["input_ids"]
    assert ids == [4 + ord("1") - 32, 4 + ord("2") - 32, 2]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12"
    assert tokenizer.decode(ids) == "12<eos>"


def test_non_ascii_text_is_encoded_as_its_utf8_bytes(tokenizer):
    ids = tokenizer("é", add_special_tokens=False)["input_ids"]  # UTF-8: 0xC3 0xA9
    assert len(ids) == 2 and all(100 <= i < 260 for i in ids)
    assert tokenizer.decode(ids) == "é"


def test_chat_template_renders_bos_and_content(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "23+14="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<bos>23+14="


def test_save_and_load_with_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Ann has 23 pens.\n 9-4=5<eos>"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(tokenizer(text)["input_ids"]) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    messages = [{"role": "user", "content": "1+2="}]
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "<bos>1+2="
    again = CharTokenizer.from_pretrained(tmp_path)
    assert isinstance(again, CharTokenizer) and again(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_auto_tokenizer_beside_a_qwen2_config_encodes_the_same(tokenizer, tmp_path):
    """Transformers 5 loads a tokenizer next to a qwen2 config.json as Qwen2Tokenizer; ids must not change."""
    build_tiny_qwen2_for(
        tokenizer, hidden=16, layers=1, heads=2, kv_heads=1, intermediate=16
    ).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in [
        "Ann has 23 pens,  gets 14.\n Now? 37<eos>",
        "  x\n\n y'll don't 12345 é \t!",
        "<bos>9-4=<eos><pad>",
    ]:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"], (type(loaded).__name__, text)
        assert loaded.decode(tokenizer(text)["input_ids"]) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, len(loaded)) == (0, 1, 2, 260)
    messages = [{"role": "user", "content": "1+2="}]
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "<bos>1+2="
