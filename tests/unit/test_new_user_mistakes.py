"""Mistakes a new user makes with paths, knobs and output files: one sentence naming the input.

Each case is a row of docs/failures.md ("Data, model folders, export"); every check runs
before any worker starts, so an uncaught exception fails the test with its traceback.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from verity.cli import data as data_cli

ROW = {
    "prompt": [{"role": "user", "content": "1+1="}],
    "data_source": "verity/arithmetic",
    "reward_model": {"style": "rule", "ground_truth": "2"},
}


@pytest.fixture
def dataset_folder(tmp_path):
    folder = tmp_path / "gsm8k"
    (folder / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([ROW]), folder / "main" / "train.parquet")
    return folder


def test_a_folder_given_as_a_data_file_is_named_as_a_folder_with_its_files(dataset_folder):
    from verity.config import ConfigError, load_config

    with pytest.raises(ConfigError) as caught:
        load_config([f"data.train_files=[{dataset_folder}]", f"data.val_files=[{dataset_folder}]"])
    message = str(caught.value)
    assert f"data.train_files: file '{dataset_folder}' is a folder, not a data file" in message
    assert str(dataset_folder / "main" / "train.parquet") in message
    assert "does not exist" not in message


def test_data_check_of_a_folder_says_folder_not_missing(dataset_folder, capsys):
    assert data_cli.main(["check", str(dataset_folder)]) == 1
    err = capsys.readouterr().err
    assert f"'{dataset_folder}' is a folder, not a data file" in err and "does not exist" not in err


def test_a_reward_file_path_that_is_a_folder_is_named_as_a_folder(tmp_path):
    from verity.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"reward.custom_path: file '.*' is a folder, not a \.py file"):
        load_config([f"reward.custom_path={tmp_path}"])


def test_an_unknown_difficulty_knob_lists_the_tasks_knobs(tmp_path, capsys):
    out = tmp_path / "rows.parquet"
    code = data_cli.main(
        ["synth", "--task", "arithmetic", "--n", "3", "--output", str(out), "--difficulty", "digts=3"]
    )
    err = capsys.readouterr().err
    assert code == 1 and not out.exists()
    assert "--difficulty: task 'arithmetic' has no knob 'digts'; its knobs: ['digits'," in err
    assert "__init__()" not in err


@pytest.mark.parametrize("where", ["under a file", "a folder"])
def test_an_output_that_cannot_be_written_is_one_sentence(tmp_path, capsys, where):
    (tmp_path / "a_file.parquet").write_text("x")
    (tmp_path / "folder.parquet").mkdir()
    out = (
        tmp_path / "a_file.parquet" / "rows.parquet"
        if where == "under a file"
        else tmp_path / "folder.parquet"
    )
    code = data_cli.main(["synth", "--task", "arithmetic", "--n", "3", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err and err.startswith(f"verity data synth: output: '{out}' ")
    assert ("is a file, not a folder" if where == "under a file" else "is a folder; give the path") in err


def _saved_run(root, model_path):
    """A run folder whose complete step_2 names ``model_path`` as the model it started from."""
    from verity.checkpoint.state import TrainerState

    step = root / "run" / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    state = TrainerState(
        step=2,
        total_steps=2,
        dataloader={},
        kl_coef=0.0,
        run_id="r",
        tracking_uri="",
        config_hash="h",
        config={},
        model_path=str(model_path),
        working_dir=str(root),
    )
    state.write(step)
    return step


@pytest.mark.parametrize("onto", ["the checkpoint", "a folder in the checkpoint", "the starting model"])
def test_export_never_overwrites_what_it_reads(tmp_path, capsys, onto):
    from verity.cli import export as export_cli

    model = tmp_path / "Qwen2.5-0.5B"
    model.mkdir()
    (model / "config.json").write_text("{}")
    step = _saved_run(tmp_path, "Qwen2.5-0.5B")  # relative to the folder the run was started in
    out = {"the checkpoint": step, "a folder in the checkpoint": step / "hf", "the starting model": model}[
        onto
    ]
    assert export_cli.main([str(tmp_path / "run"), str(out)]) == 2
    err = capsys.readouterr().err
    expected = (
        "is the model folder this run started from"
        if onto == "the starting model"
        else "is inside the checkpoint"
    )
    assert err.startswith(f"verity export: {out}: {expected}") and "Traceback" not in err
    assert (model / "config.json").read_text() == "{}"


@pytest.mark.parametrize(
    "case",
    ["output is a file", "output under a file", "zero steps", "no prompt column", "no answer", "folder"],
)
def test_sft_refuses_bad_input_before_training_in_one_sentence(tmp_path, capsys, case):
    from verity.cli import sft as sft_cli

    (tmp_path / "a_file").write_text("x")
    pq.write_table(pa.Table.from_pylist([{"question": "1+1", "answer": "2"}]), tmp_path / "raw.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": ROW["prompt"]}]), tmp_path / "noanswer.parquet")
    (tmp_path / "data").mkdir()
    output, extra, expected = {
        "output is a file": ("a_file", [], "--output '{t}/a_file' exists and is not a folder"),
        "output under a file": ("a_file/ckpt", [], "cannot be created: '{t}/a_file' is a file, not a folder"),
        "zero steps": (
            "ckpt",
            ["--steps", "0", "--lr", "-1"],
            "--steps must be >= 1, got 0; --lr must be > 0",
        ),
        "no prompt column": ("ckpt", ["--train", "{t}/raw.parquet"], "raw.parquet: no 'prompt' column"),
        "no answer": (
            "ckpt",
            ["--train", "{t}/noanswer.parquet"],
            "row 0 (0-based) has no answer to train on",
        ),
        "folder": ("ckpt", ["--train", "{t}/data"], "'{t}/data' is a folder, not a data file"),
    }[case]
    argv = ["--output", f"{tmp_path}/{output}", "--steps", "1", *(a.format(t=tmp_path) for a in extra)]
    assert sft_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert expected.format(t=tmp_path) in err and "Traceback" not in err
    assert not (tmp_path / "ckpt").exists()


def test_a_config_file_that_is_not_text_is_named(tmp_path):
    from verity.config import ConfigError, load_config

    data_file = tmp_path / "train.parquet"
    data_file.write_bytes(b"PAR1\x15\x04\xe2\x28\xa1\xff" * 16)  # parquet's magic, then bytes no text holds
    with pytest.raises(
        ConfigError, match=r"config file '.*train.parquet' is not text \(a data or model file\?\)"
    ):
        load_config([], config_file=data_file)
