"""Bad inputs end in one sentence naming the input and the documented exit code (docs/failures.md).

The commands run in this process (every case fails before any worker or Ray starts, so an
uncaught exception would fail the test with its traceback).
"""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from verity.cli import data as data_cli
from verity.cli import export as export_cli
from verity.cli import train as train_cli


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    root = tmp_path_factory.mktemp("inputs")
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=32)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    for name, edit in (
        ("corrupt", lambda text: "{not json"),
        ("unknown", lambda text: text.replace("qwen2", "qwen99")),
    ):
        shutil.copytree(root / "model", root / f"model_{name}")
        config = root / f"model_{name}" / "config.json"
        config.write_text(edit(config.read_text()))
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "data_source": "verity/arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        }
        for i in range(8)
    ]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, root / "good.parquet")
    pq.write_table(table.slice(0, 0), root / "empty.parquet")
    (root / "text.parquet").write_text("these are not parquet bytes\n")
    pq.write_table(pa.Table.from_pylist([{**rows[0], "data_source": "my/dataset"}]), root / "mystery.parquet")
    (root / "reward_text.py").write_text("def compute_score(**kwargs):\n    return 'correct'\n")
    (root / "a_file").write_text("x")
    return root


def train(root, *overrides: str, model: str = "model", train_file: str = "good.parquet") -> list[str]:
    return [
        f"model.path={root / model}",
        f"data.train_files=[{root / train_file}]",
        f"data.val_files=[{root / 'good.parquet'}]",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        f"trainer.output_dir={root / 'out'}",
        *overrides,
    ]


CASES = {
    "empty parquet": ({"train_file": "empty.parquet"}, "empty.parquet: the file holds no rows"),
    "not parquet": ({"train_file": "text.parquet"}, "text.parquet: not a readable parquet file"),
    "corrupt config.json": ({"model": "model_corrupt"}, "model_corrupt/config.json is not valid JSON"),
    "unknown model_type": ({"model": "model_unknown"}, "has model_type 'qwen99', which transformers"),
    "unknown data_source": ({"train_file": "mystery.parquet"}, "'my/dataset': 1 rows of data.train_files"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_train_refuses_bad_input_with_one_sentence_and_exit_2(inputs, capsys, case):
    where, sentence = CASES[case]
    code = train_cli.main(train(inputs, **where))
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert sentence in err and "Traceback" not in err
    assert "checkpoint" not in err  # no misleading resume hint for an input error


def test_train_names_a_tracking_store_mlflow_cannot_open(inputs, capsys):
    code = train_cli.main(train(inputs, "trainer.tracking_uri=nosuchscheme://host/x"))
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "trainer.tracking_uri='nosuchscheme://host/x': MLflow could not open this tracking store" in err
    assert "Traceback" not in err


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="trainer.device=gpu is available on this machine"
)
def test_train_names_a_device_this_machine_lacks(inputs, capsys):
    code = train_cli.main(train(inputs, "trainer.device=gpu"))
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "trainer.device=gpu: hardware backend 'gpu'" in err and "Traceback" not in err


def test_train_refuses_a_reward_function_returning_text(inputs, capsys):
    code = train_cli.main(train(inputs, f"reward.custom_path={inputs / 'reward_text.py'}"))
    err = capsys.readouterr().err
    assert code == 2 and "reward_text.py" in err and "reward.custom_name='compute_score'" in err
    assert "returned str; expected a float or a dict with 'score'" in err


def test_too_many_failed_reward_samples_exit_1_with_the_reason(inputs, capsys, monkeypatch):
    from verity.rewards.failures import RewardFailureError

    def failing_run(cfg):
        raise RewardFailureError("reward: 6 of 8 samples failed (6 errors, 0 timeouts), more than ...")

    monkeypatch.setattr("verity.launch.run.run_training", failing_run)
    assert train_cli.main(train(inputs)) == 1
    err = capsys.readouterr().err
    assert "RewardFailureError: reward: 6 of 8 samples failed" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["empty.parquet", "text.parquet"])
def test_data_check_does_not_call_an_empty_or_unreadable_file_fine(inputs, capsys, name):
    assert data_cli.main(["check", str(inputs / name)]) == 1
    captured = capsys.readouterr()
    assert name in captured.out + captured.err and "Traceback" not in captured.err


def test_export_onto_an_existing_file_is_refused(inputs, capsys):
    assert export_cli.main([str(inputs / "out"), str(inputs / "a_file")]) == 2
    err = capsys.readouterr().err
    assert "a_file: exists and is not a folder" in err


def test_zero_training_steps_are_refused_pointing_to_verity_eval(inputs, capsys):
    from verity.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"trainer.total_steps must be >= 1 .*got 0; .*use verity eval MODEL"
    ):
        load_config(["trainer.total_steps=0"])
    code = train_cli.main(train(inputs, "trainer.total_steps=0"))
    err = capsys.readouterr().err
    assert code == 2 and "verity train: trainer.total_steps must be >= 1" in err, err[-2000:]


def _fail_with(monkeypatch, error: BaseException) -> None:
    def failing_run(cfg):
        raise error

    monkeypatch.setattr("verity.launch.run.run_training", failing_run)


def test_the_resume_hint_is_printed_only_when_a_checkpoint_exists(inputs, tmp_path, capsys, monkeypatch):
    from verity.checkpoint import layout
    from verity.checkpoint.state import TrainerState
    from verity.controller import WorkerMethodError

    error = WorkerMethodError(
        "actor.generate failed on rank 0: ...", group="g", role="actor", method="m", rank=0
    )
    _fail_with(monkeypatch, error)
    out = tmp_path / "out"
    args = [*train(inputs), f"trainer.output_dir={out}"]
    args.remove(f"trainer.output_dir={inputs / 'out'}")
    assert train_cli.main(args) == 1
    err = capsys.readouterr().err
    assert "WorkerMethodError: actor.generate failed on rank 0" in err
    assert "checkpoint" not in err, err  # nothing to resume: no hint about checkpoints
    tmp = out / "checkpoints" / "step_2.tmp"
    tmp.mkdir(parents=True)
    TrainerState(
        step=2, total_steps=4, dataloader={}, kl_coef=None, run_id=None, tracking_uri=None,
        config_hash="h", config={},
    ).write(tmp)  # fmt: skip
    layout.commit(tmp, out / "checkpoints" / "step_2")
    assert train_cli.main(args) == 1
    err = capsys.readouterr().err
    assert (
        f"last complete checkpoint: {out / 'checkpoints' / 'step_2'}; continue with trainer.resume=auto"
        in err
    )


def test_a_plugin_error_raised_on_purpose_is_one_sentence_with_its_exit_code(inputs, capsys, monkeypatch):
    from verity.controller import WorkerMethodError
    from verity.errors import RunError
    from verity_recipe_dapo.dynamic_sampling import DynamicSamplingExhausted

    sentence = "dynamic sampling, step 3: after 2 generation rounds ... Raise dapo.dynamic_sampling.max_num_gen_batches"
    _fail_with(monkeypatch, DynamicSamplingExhausted(sentence))
    assert train_cli.main(train(inputs)) == 1
    err = capsys.readouterr().err
    assert (
        err == f"verity train: {sentence}\n"
    )  # no traceback, no class name, no checkpoint hint (none exists)

    _fail_with(monkeypatch, RunError("mine.threshold=3 is above every score of the data", exit_code=2))
    assert train_cli.main(train(inputs)) == 2
    assert capsys.readouterr().err == "verity train: mine.threshold=3 is above every score of the data\n"

    # raised in a worker (a plug-in role's method): the same sentence, not the worker's traceback
    cause = RunError("prm: the reward model folder holds no value head", exit_code=2)
    _fail_with(monkeypatch, WorkerMethodError("...", group="g", role="prm", method="m", rank=0, cause=cause))
    assert train_cli.main(train(inputs)) == 2
    assert capsys.readouterr().err == "verity train: prm: the reward model folder holds no value head\n"


def test_an_error_raised_in_a_guarded_stage_reaches_the_caller_unwrapped():
    from verity.errors import RunError
    from verity.trainer.stage_guard import StageGuard

    error = RunError("stop here")
    with pytest.raises(RunError) as caught, StageGuard(timeout_s=60).stage("dynamic_sampling", step=1):
        raise error
    assert caught.value is error


def test_a_run_rejected_before_training_leaves_no_output_folder(inputs, tmp_path, capsys):
    out = tmp_path / "fresh" / "out"
    args = [*train(inputs, train_file="mystery.parquet"), f"trainer.output_dir={out}"]
    args.remove(f"trainer.output_dir={inputs / 'out'}")
    assert train_cli.main(args) == 2  # refused inside the run (its data_source has no reward function)
    assert "'my/dataset': 1 rows of data.train_files" in capsys.readouterr().err
    assert not (tmp_path / "fresh").exists()  # neither the lock nor the folders the run made


def test_the_embedded_model_on_your_data_needs_your_held_out_file(inputs, tmp_path, capsys, monkeypatch):
    """Never the embedded task's accuracy reported for a run on the user's own data (nor trained on it)."""

    def no_embedded_build(*args, **kwargs):
        raise AssertionError("refused before the embedded model is built")

    monkeypatch.setattr("verity_toyworld.build.ensure_embedded_default", no_embedded_build)
    out = tmp_path / "out"
    mine = inputs / "good.parquet"
    reward = inputs / "reward_text.py"
    for given, sentence in (
        (f"data.train_files=[{mine}]", "data.val_files is empty: give a held-out parquet/jsonl file of your task"),
        (f"data.val_files=[{mine}]", "data.train_files is empty: give the parquet/jsonl file(s) of your task"),
    ):
        code = train_cli.main([given, f"reward.custom_path={reward}", f"trainer.output_dir={out}"])
        err = capsys.readouterr().err
        assert code == 2, err[-2000:]
        assert f"verity train: {sentence}" in err and "embedded 'default' preset's task, not on yours" in err
        assert "Traceback" not in err and not out.exists()


def test_a_file_without_a_prompt_column_is_one_sentence_naming_its_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from verity.data.verl_dataset import MalformedDatasetError, read_nonempty_rows

    path = tmp_path / "raw.parquet"
    rows = [{"question": f"{i}+1?", "answer": str(i + 1), "data_source": "acme"} for i in range(45)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(MalformedDatasetError) as caught:
        read_nonempty_rows(path)
    message = str(caught.value)
    assert "no 'prompt' column" in message and "['question', 'answer', 'data_source']" in message
    assert "'question' is probably meant" in message and "\n" not in message and "row " not in message
