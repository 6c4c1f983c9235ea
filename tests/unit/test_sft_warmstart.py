"""SFT warm-start, greedy evaluation, the cached embedded default and the ``verity sft`` command."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers.scripted_cache import ScriptedCache
from transformers import AutoModelForCausalLM, AutoTokenizer
from verity.cli.sft import main as sft_main
from verity.evaluation.greedy import evaluate, evaluate_greedy
from verity.sft import collate_examples, learning_rate_at, run_sft, tokenize_examples
from verity_toyworld.build import EmbeddedSettings, ensure_embedded_default, teacher_rows
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.tasks.arithmetic import (
    ArithmeticConfig,
    generate_splits,
    read_parquet_rows,
    write_parquet,
)
from verity_toyworld.tiny_model import build_tiny_qwen2_for

SMALL_MODEL = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 64, "max_pos": 64}


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="module")
def rows():
    return generate_splits(64, 8, seed=0, config=ArithmeticConfig(digits=1, style="expr"))


def test_examples_put_labels_on_answer_and_eos_only(tokenizer):
    row = {"prompt": [{"role": "user", "content": "3+4="}], "reward_model": {"ground_truth": "7"}}
    ((prompt, answer),) = tokenize_examples(tokenizer, [row])
    char = lambda c: 4 + ord(c) - 32  # noqa: E731 - the character tokenizer's id layout
    assert prompt == [1, char("3"), char("+"), char("4"), char("=")]  # <bos> from the chat template
    assert answer == [char("7"), 2]  # answer then <eos>
    other = {"prompt": "9=", "response": "10"}
    batch = collate_examples(tokenize_examples(tokenizer, [row, other]), pad_token_id=0)
    assert batch["input_ids"].tolist() == [
        [1, char("3"), char("+"), char("4"), char("="), char("7"), 2],
        [char("9"), char("="), char("1"), char("0"), 2, 0, 0],
    ]
    assert batch["attention_mask"].tolist() == [[1] * 7, [1] * 5 + [0, 0]]
    assert batch["labels"].tolist() == [
        [-100] * 5 + [char("7"), 2],
        [-100, -100, char("1"), char("0"), 2, -100, -100],
    ]


def test_learning_rate_schedule():
    assert learning_rate_at(0, 1.0, 100, 10, 0.1) == pytest.approx(0.1)
    assert learning_rate_at(9, 1.0, 100, 10, 0.1) == pytest.approx(1.0)
    assert learning_rate_at(10, 1.0, 100, 10, 0.1) == pytest.approx(1.0)
    assert learning_rate_at(55, 1.0, 100, 10, 0.1) == pytest.approx(0.55)  # half-way down the cosine
    assert learning_rate_at(100, 1.0, 100, 10, 0.1) == pytest.approx(0.1)


def test_short_sft_lowers_the_loss_and_is_reproducible(tokenizer, rows):
    train, _ = rows
    model = build_tiny_qwen2_for(tokenizer, seed=0, **SMALL_MODEL)
    result = run_sft(model, tokenizer, train, steps=25, lr=1e-2, batch_size=8, seed=0)
    assert len(result.losses) == 25 and result.steps == 25 and result.seconds > 0
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)  # ~4.6 nats (uniform over 100 ids) falls well below
    assert not model.training
    again = build_tiny_qwen2_for(tokenizer, seed=0, **SMALL_MODEL)
    same = run_sft(again, tokenizer, train, steps=25, lr=1e-2, batch_size=8, seed=0)
    assert same.losses == result.losses
    assert torch.equal(model.model.embed_tokens.weight, again.model.embed_tokens.weight)


class AnswerLM(torch.nn.Module):
    """Emits a fixed answer string for every row, then EOS."""

    def __init__(self, tokenizer, answers: list[str]):
        super().__init__()
        self.scripts = [tokenizer(a, add_special_tokens=False)["input_ids"] + [2] for a in answers]
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.prompt_len = 0

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, **_):
        if past_key_values is None or past_key_values.get_seq_length() == 0:  # the prefill
            self.prompt_len = attention_mask.shape[1]
            past_key_values = ScriptedCache(self.prompt_len, input_ids.shape[0])
        step = attention_mask.shape[1] - self.prompt_len
        logits = torch.zeros(input_ids.shape[0], 1, 260)
        for row, original in enumerate(past_key_values.rows.tolist()):
            script = self.scripts[original]
            logits[row, 0, script[min(step, len(script) - 1)]] = 5.0
        return SimpleNamespace(logits=logits, past_key_values=past_key_values)


def test_evaluate_scores_each_row_with_its_verifier(tokenizer):
    rows = [
        {
            "prompt": [{"role": "user", "content": c}],
            "data_source": "verity/arithmetic",
            "reward_model": {"ground_truth": g},
        }
        for c, g in (("3+4=", "7"), ("9-2=", "7"), ("1+1=", "2"), ("5+5=", "10"))
    ]
    model = AnswerLM(tokenizer, ["7", "6", "2", "100"])
    result = evaluate(model, tokenizer, rows, batch_size=4)
    assert result.scores == [1.0, 0.0, 1.0, 0.0] and result.accuracy == 0.5
    assert result.responses == ["7", "6", "2", "100"] and result.response_lengths == [2, 2, 2, 4]
    assert evaluate_greedy(model, tokenizer, rows, batch_size=4) == 0.5
    # a custom scorer replaces the task lookup
    assert evaluate_greedy(model, tokenizer, rows, score_fn=lambda ds, text, truth: 1.0) == 1.0


def test_embedded_default_builds_once_and_loads_like_a_checkpoint(tmp_path):
    settings = EmbeddedSettings(num_train=64, num_test=8, model=SMALL_MODEL, sft_steps=3, sft_batch_size=8)
    lines: list[str] = []
    paths = ensure_embedded_default(tmp_path, settings=settings, log=lines.append)
    assert any("building" in line for line in lines)
    # the warm-start says how far it is (a tenth of the way each line; here every step of 3)
    assert [line.split(",")[0] for line in lines if "warm-start step" in line] == [
        f"verity: SFT warm-start step {k}/3" for k in (1, 2, 3)
    ]
    manifest = paths.manifest()
    assert manifest["settings"]["sft_steps"] == 3 and 0.0 <= manifest["test_greedy_accuracy"] <= 1.0
    assert 0.0 <= manifest["test_greedy_clean_rate"] <= 1.0 and manifest["sft_slipped_rows"] > 0
    assert paths.root.name == settings.key() and paths.tokenizer_dir == paths.model_dir
    model = AutoModelForCausalLM.from_pretrained(paths.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(paths.model_dir)
    assert model.config.hidden_size == 32 and tokenizer.eos_token_id == model.config.eos_token_id == 2
    base = AutoModelForCausalLM.from_pretrained(paths.base_model_dir)
    assert not torch.equal(base.model.embed_tokens.weight, model.model.embed_tokens.weight)  # SFT moved it
    train, test = read_parquet_rows(paths.train_file), read_parquet_rows(paths.test_file)
    assert len(train) == 64 and len(test) == 8
    assert not {r["extra_info"]["expression"] for r in train} & {r["extra_info"]["expression"] for r in test}
    # reused: nothing is rebuilt
    lines.clear()
    stamp = paths.manifest_file.stat().st_mtime_ns
    assert ensure_embedded_default(tmp_path, settings=settings, log=lines.append) == paths
    assert lines == [] and paths.manifest_file.stat().st_mtime_ns == stamp
    # other settings, other entry
    other = ensure_embedded_default(tmp_path, sft_steps=2, settings=settings, log=None)
    assert (
        other.root != paths.root and json.loads(other.manifest_file.read_text())["settings"]["sft_steps"] == 2
    )
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted(
        [paths.root.name, other.root.name]
    )


def test_teacher_rows_slip_only_on_chosen_operations():
    rows, _ = generate_splits(400, 1, seed=0, config=ArithmeticConfig(style="expr"))
    taught = teacher_rows(rows, slip_rate=0.7, slip_operations="-", seed=0)
    assert [r["extra_info"] for r in taught] == [r["extra_info"] for r in rows]  # copies, same problems
    assert all("response" not in r for r in rows)
    subtractions = [t for t in taught if "-" in t["extra_info"]["expression"]]
    slipped = [t for t in subtractions if t["response"].endswith(".")]
    for row in taught:
        truth = row["reward_model"]["ground_truth"]
        assert row["response"] in (truth, truth + ".")
        if "+" in row["extra_info"]["expression"]:
            assert row["response"] == truth
    assert 0.6 < len(slipped) / len(subtractions) < 0.8  # ~0.7 of about 200 rows
    assert teacher_rows(rows, 0.7, "-", seed=0) == taught
    assert all(t["response"] == t["reward_model"]["ground_truth"] for t in teacher_rows(rows, 0.0, "-"))


def test_sft_command_writes_a_checkpoint(tmp_path, rows, capsys):
    train, test = rows
    write_parquet(train, tmp_path / "train.parquet")
    write_parquet(test, tmp_path / "test.parquet")
    out = tmp_path / "ckpt"
    code = sft_main(
        [
            "--output",
            str(out),
            "--train",
            str(tmp_path / "train.parquet"),
            "--test",
            str(tmp_path / "test.parquet"),
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--log-every",
            "1",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "sft step 2" in text and "accuracy after" in text
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 260
    assert AutoTokenizer.from_pretrained(out).decode([37]) == "A"
    assert sft_main(["--output", str(out), "--train", str(tmp_path / "missing.parquet")]) == 2
    assert sft_main(["--output", str(out), "--steps", "0"]) == 2


def test_a_killed_build_leaves_no_staging_folder_after_the_next_build(tmp_path):
    # a build stopped by SIGKILL (or SIGTERM before Python unwinds) cannot clean up its staging folder
    settings = EmbeddedSettings(num_train=16, num_test=4, model=SMALL_MODEL, sft_steps=1, sft_batch_size=4)
    stale = tmp_path / f".{settings.key()}-killed"
    (stale / "model").mkdir(parents=True)
    other_key = tmp_path / ".someotherkey-killed"  # another settings' build may be running: left alone
    other_key.mkdir()
    paths = ensure_embedded_default(tmp_path, settings=settings, log=None)
    assert paths.manifest_file.exists() and not stale.exists() and other_key.exists()
