"""verl-schema prompt datasets: reading parquet/JSONL, chat templating, length policies, malformed rows,
left-padded batches and a resumable seeded sampler."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from verity.batch import Batch
from verity.data.chat_template import render_prompt
from verity.data.prompt_loader import PromptDataLoader, ResumableSampler, collate_prompts
from verity.data.verl_dataset import MalformedDatasetError, PromptDataset, PromptTooLongError, read_rows
from verity_toyworld.char_tokenizer import CharTokenizer


def _row(content, truth="1", source="openai/gsm8k", extra=None):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": extra if extra is not None else {"split": "train", "index": 0},
    }


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer()


class _NoTemplateTokenizer:
    """A base-model tokenizer without a chat template: one id per character, BOS=1 added, pad=0."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = 2

    def __call__(self, texts, add_special_tokens=True):
        prefix = [1] if add_special_tokens else []
        return {"input_ids": [prefix + [ord(c) for c in text] for text in texts]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i > 2)


def test_parquet_written_by_pandas_in_verl_schema_loads_unchanged(tmp_path, tokenizer):
    rows = [_row("1+1=", "2", extra={"split": "train", "index": 0, "answer": "2"}), _row("10+5=", "15")]
    rows[1]["extra_info"] = {"split": "train", "index": 1}  # heterogeneous extra_info keys
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)  # how verl's preprocessing scripts write files
    dataset = PromptDataset(path, tokenizer, max_prompt_length=16)
    assert len(dataset) == 2
    first = dataset[0]
    assert first.prompt_text == "<bos>1+1="  # the char tokenizer's chat template
    assert first.input_ids == tokenizer("<bos>1+1=", add_special_tokens=False)["input_ids"]
    assert first.ground_truth == "2" and first.data_source == "openai/gsm8k"
    assert first.extra_info["answer"] == "2"
    assert dataset[1].extra_info["index"] == 1


def test_jsonl_and_several_files(tmp_path, tokenizer):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(_row("1+1=")) + "\n\n")
    b.write_text(json.dumps(_row("2+2=")) + "\n" + json.dumps(_row("3+3=")) + "\n")
    dataset = PromptDataset([a, b], tokenizer, max_prompt_length=16)
    assert [r.prompt_text for r in dataset.records] == ["<bos>1+1=", "<bos>2+2=", "<bos>3+3="]
    assert len(read_rows(b)) == 2


def test_tokenizer_without_chat_template_joins_contents():
    rows = [{**_row("q"), "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "ab"}]}]
    dataset = PromptDataset(rows, _NoTemplateTokenizer(), max_prompt_length=10)
    assert dataset[0].prompt_text == "S\nab"
    assert dataset[0].input_ids == [1, ord("S"), ord("\n"), ord("a"), ord("b")]
    assert render_prompt([{"role": "user", "content": "x"}], _NoTemplateTokenizer()) == "x"


def test_malformed_rows_are_reported_with_row_numbers(tokenizer):
    rows = [
        _row("ok"),
        {**_row("x"), "prompt": "a plain string"},
        {**_row("x"), "data_source": None},
        _row("ok"),
        {**_row("x"), "reward_model": {"style": "rule"}},
        {**_row("x"), "prompt": [{"role": "narrator", "content": "x"}]},
    ]
    with pytest.raises(MalformedDatasetError) as info:
        PromptDataset(rows, tokenizer, max_prompt_length=16)
    message = str(info.value)
    assert "4 of 6 rows" in message
    for expected in [
        "row 1: 'prompt' must be",
        "row 2: 'data_source'",
        "row 4: 'reward_model.ground_truth'",
        "row 5:",
    ]:
        assert expected in message
    assert "row 0" not in message and "row 3" not in message
    skipped = PromptDataset(rows, tokenizer, max_prompt_length=16, on_malformed="skip")
    assert len(skipped) == 2 and skipped.skipped_rows == [1, 2, 4, 5]


def test_bad_json_line_is_named(tmp_path, tokenizer):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(_row("a")) + "\n{not json\n")
    with pytest.raises(MalformedDatasetError, match="line 2"):
        PromptDataset(path, tokenizer, max_prompt_length=16)


def test_length_policies(tokenizer):
    rows = [_row("12"), _row("123456789")]  # 3 and 10 tokens with <bos>
    with pytest.raises(PromptTooLongError, match="row 1 \\(10 tokens\\)"):
        PromptDataset(rows, tokenizer, max_prompt_length=5)
    filtered = PromptDataset(rows, tokenizer, max_prompt_length=5, truncation="filter")
    assert len(filtered) == 1 and filtered.filtered_rows == [1]
    left = PromptDataset(rows, tokenizer, max_prompt_length=5, truncation="truncate_left")
    assert left[1].prompt_text == "56789" and len(left[1].input_ids) == 5
    right = PromptDataset(rows, tokenizer, max_prompt_length=5, truncation="truncate_right")
    assert right[1].prompt_text == "<bos>1234"
    with pytest.raises(ValueError, match="truncation"):
        PromptDataset(rows, tokenizer, max_prompt_length=5, truncation="middle")


def test_collate_left_pads_and_builds_position_ids(tokenizer):
    dataset = PromptDataset([_row("1"), _row("123")], tokenizer, max_prompt_length=8)
    batch = collate_prompts(dataset.records, dataset.pad_token_id)
    assert isinstance(batch, Batch) and len(batch) == 2
    pad = tokenizer.pad_token_id
    ids = batch["input_ids"]
    assert ids.shape == (2, 4)
    assert ids[0, :2].tolist() == [pad, pad] and ids[0, 2:].tolist() == dataset[0].input_ids
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert batch["ground_truth"] == ["1", "1"] and batch["uid"] == ["0", "1"]
    assert batch["raw_prompt"][1] == [{"role": "user", "content": "123"}]
    fixed = collate_prompts(dataset.records, dataset.pad_token_id, pad_to=6)
    assert fixed["input_ids"].shape == (2, 6) and fixed["input_ids"].dtype == torch.long


def test_sampler_is_seeded_and_resumes_exactly():
    sampler = ResumableSampler(10, batch_size=3, shuffle=True, seed=7)
    assert sampler.batches_per_epoch() == 3
    first_epoch = [sampler.next_indices() for _ in range(3)]
    flat = sorted(i for batch in first_epoch for i in batch)
    assert len(set(flat)) == 9  # 9 distinct of 10 (drop_last)
    state = sampler.state_dict()
    following = [sampler.next_indices() for _ in range(4)]  # crosses into epoch 1, 2
    resumed = ResumableSampler(10, batch_size=3, shuffle=True, seed=0)
    resumed.load_state_dict(state)
    assert [resumed.next_indices() for _ in range(4)] == following
    again = ResumableSampler(10, batch_size=3, shuffle=True, seed=7)
    assert [again.next_indices() for _ in range(3)] == first_epoch
    with pytest.raises(ValueError, match="this dataset has 11"):
        ResumableSampler(11, 3).load_state_dict(state)


def test_unshuffled_sampler_without_drop_last():
    sampler = ResumableSampler(5, batch_size=2, shuffle=False, drop_last=False)
    assert [sampler.next_indices() for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]


def test_loader_epochs_and_state(tokenizer):
    dataset = PromptDataset([_row(str(i)) for i in range(8)], tokenizer, max_prompt_length=8)
    loader = PromptDataLoader(dataset, batch_size=3, seed=1)
    assert len(loader) == 2
    epoch0 = [b["uid"] for b in loader]
    assert len(epoch0) == 2 and loader.epoch == 0
    epoch1 = [b["uid"] for b in loader]
    assert len(epoch1) == 2 and loader.epoch == 1 and epoch1 != epoch0
    state = loader.state_dict()
    nxt = loader.next_batch()["uid"]
    other = PromptDataLoader(dataset, batch_size=3, seed=1)
    other.load_state_dict(state)
    assert other.next_batch()["uid"] == nxt


def test_loader_sets_its_batch_meta_on_every_batch(tokenizer):
    dataset = PromptDataset([_row(str(i)) for i in range(4)], tokenizer, max_prompt_length=8)
    loader = PromptDataLoader(dataset, batch_size=2, batch_meta={"held_on_driver": ("uid",)})
    batches = [loader.next_batch(), *loader]
    assert all(b.meta == {"held_on_driver": ("uid",)} for b in batches)
    batches[0].meta["held_on_driver"] = ()  # one batch's meta is its own
    assert loader.next_batch().meta == {"held_on_driver": ("uid",)}


def test_batch_size_larger_than_dataset_is_refused(tokenizer):
    dataset = PromptDataset([_row("1")], tokenizer, max_prompt_length=8)
    with pytest.raises(ValueError, match="only 1"):
        PromptDataLoader(dataset, batch_size=2)


def test_build_prompt_loader_for_training_and_validation(tmp_path, tokenizer):
    from verity.data.prompt_loader import build_prompt_loader

    path = tmp_path / "val.parquet"
    pd.DataFrame([_row(str(i)) for i in range(5)]).to_parquet(path)
    train = build_prompt_loader(str(path), tokenizer, batch_size=2, max_prompt_length=8, seed=3)
    assert len(train) == 2 and len(train.next_batch()) == 2
    val = build_prompt_loader(
        [str(path)], tokenizer, batch_size=256, max_prompt_length=8, shuffle=False, drop_last=False
    )
    batches = list(val)
    assert len(batches) == 1 and batches[0]["uid"] == ["0", "1", "2", "3", "4"]
    limited = build_prompt_loader(str(path), tokenizer, batch_size=2, max_prompt_length=8, max_samples=3)
    assert len(limited.dataset) == 3
