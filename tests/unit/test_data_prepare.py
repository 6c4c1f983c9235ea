"""Raw GSM8K / MATH / AIME files (written here in their published formats) -> verl-schema rows,
and the ``verity data`` command."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from verity.cli import data as data_cli
from verity.data.prepare import RawFormatError, aime_rows, gsm8k_rows, math_rows, prepare_file
from verity.data.verl_dataset import PromptDataset, check_rows, read_rows
from verity.rewards import RewardManager
from verity_toyworld.char_tokenizer import CharTokenizer

GSM8K_RAW = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A farm has 1,200 cows and buys 300 more. How many cows?",
        "answer": "1200+300=1500\n#### 1,500",
    },
]
MATH_RAW = [
    {
        "problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?",
        "solution": "We have $\\frac{1}{2}+\\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
        "level": "Level 1",
        "type": "Prealgebra",
    },
    {"problem": "Solve $x+1=3$.", "solution": "So $x=\\boxed{2}$.", "level": "Level 2", "type": "Algebra"},
]
AIME_RAW = [
    {"ID": "2024-I-1", "Year": 2024, "Problem": "Find the remainder when 1000 is divided by 7.", "Answer": 6},
    {"ID": "2024-I-2", "Year": 2024, "Problem": "Compute 20+13.", "Answer": "033"},
]


def test_gsm8k_conversion():
    rows = gsm8k_rows(GSM8K_RAW)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "1500"]
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["prompt"][0]["role"] == "user"
    assert first["prompt"][0]["content"].endswith('output the final answer after "####".')
    assert first["extra_info"]["answer"].endswith("#### 72") and first["extra_info"]["index"] == 0
    assert check_rows(rows) == []


def test_math_conversion_takes_the_last_boxed_answer():
    rows = math_rows(MATH_RAW, split="test")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{3}{4}", "2"]
    assert rows[0]["data_source"] == "lighteval/MATH"
    assert rows[0]["extra_info"] == {"split": "test", "index": 0}
    assert list(rows[0])[:2] == ["level", "type"] and rows[0]["level"] == "Level 1"
    assert rows[0]["prompt"][0]["content"].endswith("within \\boxed{}.")


def test_aime_conversion_accepts_both_column_spellings():
    rows = aime_rows(AIME_RAW) + aime_rows([{"problem": "p", "answer": "7"}])
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["6", "33", "7"]
    assert rows[0]["extra_info"]["id"] == "2024-I-1" and rows[0]["extra_info"]["year"] == "2024"
    assert rows[0]["data_source"] == "aime"


@pytest.mark.parametrize(
    ("converter", "raw", "message"),
    [
        (gsm8k_rows, [{"question": "q", "answer": "no marker"}], "gsm8k row 0: 'answer' has no"),
        (gsm8k_rows, [{"answer": "#### 1"}], "needs a 'question'"),
        (math_rows, [{"problem": "p", "solution": "no box"}], "math row 0: 'solution' has no"),
        (aime_rows, [{"Problem": "p", "Answer": "1/2"}], "aime row 0: answer '1/2' is not an integer"),
    ],
)
def test_raw_errors_name_the_row(converter, raw, message):
    with pytest.raises(RawFormatError, match=message):
        converter(raw)


def test_every_bad_raw_row_is_listed_not_only_the_first(tmp_path, capsys):
    raw = [GSM8K_RAW[0], {"question": "q", "answer": "no marker"}, GSM8K_RAW[1], {"answer": "#### 1"}]
    source = tmp_path / "raw.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in raw))
    out = tmp_path / "out.parquet"
    assert data_cli.main(["prepare", "--format", "gsm8k", "--input", str(source), "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "2 of 4 raw rows cannot be converted" in err
    assert "gsm8k row 1: 'answer' has no" in err and "gsm8k row 3: needs a 'question'" in err
    assert not out.exists()


def test_prepared_gsm8k_concatenates_with_a_verl_prepared_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # the schema verl's examples/data_preprocess/gsm8k.py writes (field order and types)
    verl_schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [
                        ("split", pa.string()),
                        ("index", pa.int64()),
                        ("answer", pa.string()),
                        ("question", pa.string()),
                    ]
                ),
            ),
        ]
    )
    verl_row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "q"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1"},
        "extra_info": {"split": "train", "index": 0, "answer": "#### 1", "question": "q"},
    }
    raw = tmp_path / "gsm8k.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_RAW))
    prepare_file("gsm8k", raw, tmp_path / "ours.parquet")
    pq.write_table(pa.Table.from_pylist([verl_row], schema=verl_schema), tmp_path / "verl.parquet")
    ours, theirs = pq.read_table(tmp_path / "ours.parquet"), pq.read_table(tmp_path / "verl.parquet")
    assert ours.schema.equals(theirs.schema), ours.schema
    assert pa.concat_tables([ours, theirs]).num_rows == 3


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_prepare_file_round_trip_and_rewards(tmp_path, suffix):
    raw = tmp_path / f"gsm8k{suffix}"
    frame = pd.DataFrame(GSM8K_RAW)
    if suffix == ".jsonl":
        frame.to_json(raw, orient="records", lines=True)
    elif suffix == ".parquet":
        frame.to_parquet(raw)
    else:
        frame.to_csv(raw, index=False)
    out = tmp_path / "train.parquet"
    assert prepare_file("gsm8k", raw, out) == 2
    rows = read_rows(out)
    assert rows[1]["reward_model"] == {"style": "rule", "ground_truth": "1500"}
    dataset = PromptDataset(out, CharTokenizer(), max_prompt_length=400)
    assert len(dataset) == 2
    # the converted ground truth and data_source score with the default reward table
    scored = [
        {"data_source": r["data_source"], "solution_str": "... #### 1,500", "ground_truth": "1500"}
        for r in rows[1:]
    ]
    assert RewardManager({"num_workers": 0}).score(scored)[0].tolist() == [1.0]


def test_cli_prepare_synth_and_check(tmp_path, capsys):
    raw = tmp_path / "math.jsonl"
    raw.write_text("\n".join(json.dumps(r) for r in MATH_RAW) + "\n")
    out = tmp_path / "math.parquet"
    assert data_cli.main(["prepare", "--format", "math", "--input", str(raw), "--output", str(out)]) == 0
    assert "wrote 2 rows" in capsys.readouterr().out
    synth = tmp_path / "countdown.jsonl"
    args = ["synth", "--task", "countdown", "--n", "6", "--seed", "3", "--output", str(synth)]
    assert data_cli.main([*args, "--difficulty", "num_count=4", "max_number=9"]) == 0
    rows = read_rows(synth)
    assert len(rows) == 6 and all(
        len(json.loads(r["reward_model"]["ground_truth"])["numbers"]) == 4 for r in rows
    )
    arithmetic = tmp_path / "arith.parquet"
    assert data_cli.main(["synth", "--task", "arithmetic", "--n", "5", "--output", str(arithmetic)]) == 0
    assert len(read_rows(arithmetic)) == 5
    assert data_cli.main(["check", str(out), str(synth)]) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "data_source": "d"}) + "\n")
    assert data_cli.main(["check", str(bad)]) == 1
    assert "row 0: 'prompt' must be" in capsys.readouterr().out
    assert data_cli.main(["synth", "--task", "nope", "--n", "1", "--output", str(tmp_path / "x.jsonl")]) == 1
    assert "known tasks" in capsys.readouterr().err


def test_cli_difficulty_parsing():
    knobs = data_cli.parse_difficulty(["steps=3", "operations=+-*", "kinds=arithmetic,repeat"])
    assert knobs == {"steps": 3, "operations": "+-*", "kinds": ["arithmetic", "repeat"]}
    with pytest.raises(ValueError, match="key=value"):
        data_cli.parse_difficulty(["steps"])
