"""`verity eval` (held-out accuracy, pass@k of a model folder) and `verity config show`."""

from __future__ import annotations

import json

import pytest
from verity.cli.main import main as verity


@pytest.fixture(scope="module")
def model_and_file(tmp_path_factory) -> dict[str, str]:
    """A tiny model warm-started for a few seconds on 1-digit sums, so that it gets some right."""
    import torch
    from verity.sft import run_sft
    from verity_toyworld.build import teacher_rows
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tasks.arithmetic import ArithmeticConfig, read_parquet_rows, write_splits
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    config = ArithmeticConfig(digits=1, operations="+", style="expr")
    files = write_splits(root / "data", num_train=64, num_test=16, seed=0, config=config)
    run_sft(
        model,
        tokenizer,
        teacher_rows(read_parquet_rows(files["train"]), 0.0, ""),
        steps=150,
        lr=1e-2,
        batch_size=32,
    )
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return {"model": str(root / "model"), "test": str(files["test"])}


def test_eval_greedy_matches_the_warm_start_evaluator(model_and_file, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verity.evaluation.greedy import evaluate_greedy
    from verity_toyworld.tasks.arithmetic import read_parquet_rows

    out = tmp_path / "report.json"
    code = verity(["eval", model_and_file["model"], "--data", model_and_file["test"], "--max-new-tokens", "6",
                   "--json", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["prompts"] == 16 and report["responses"] == 16
    model = AutoModelForCausalLM.from_pretrained(model_and_file["model"])
    tokenizer = AutoTokenizer.from_pretrained(model_and_file["model"])
    rows = read_parquet_rows(model_and_file["test"])
    reference = evaluate_greedy(model, tokenizer, rows, max_new_tokens=6)
    assert reference > 0  # the comparison means something
    assert report["metrics"]["val/acc"] == pytest.approx(reference)  # the name verity train writes
    assert "val/acc" in capsys.readouterr().out


def test_eval_samples_k_per_prompt_and_reports_pass_at_k(model_and_file, tmp_path) -> None:
    out = tmp_path / "report.json"
    args = ["eval", model_and_file["model"], "--data", model_and_file["test"], "-k", "4", "--temperature", "1.0",
            "--max-new-tokens", "4", "--json", str(out)]  # fmt: skip
    assert verity(args) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert json.loads(out.read_text())["responses"] == 64
    assert metrics["val/k"] == 4.0 and "val/acc" not in metrics  # no greedy pass was made
    assert 0.0 <= metrics["val/avg_at_k"] <= metrics["val/pass_at_k"] <= 1.0  # a correct one counts in both
    again = tmp_path / "again.json"
    assert verity(args[:-1] + [str(again)]) == 0  # same seed, same samples
    assert json.loads(again.read_text())["metrics"] == metrics


@pytest.mark.parametrize(
    "extra, message",
    [
        (["-k", "2"], "need sampling: give a temperature > 0"),
        (["--data", "/no/such.parquet"], "no such file"),
    ],
)
def test_eval_bad_input_exits_2_with_a_sentence(model_and_file, extra, message, capsys) -> None:
    args = ["eval", model_and_file["model"]] + (
        ["--data", model_and_file["test"]] if "--data" not in extra else []
    )
    assert verity(args + extra) == 2
    assert message in capsys.readouterr().err


def test_eval_of_a_missing_model_exits_2(capsys) -> None:
    assert verity(["eval", "/no/such/model", "--data", "x.parquet"]) == 2
    assert "no such model folder or checkpoint" in capsys.readouterr().err


def test_config_show_prints_values_with_their_meaning(capsys) -> None:
    assert verity(["config", "show", "actor.optim", "actor.optim.lr=2e-5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("actor.optim:\n")
    assert "  lr: 2e-05  # peak learning rate" in out
    assert verity(["config", "show", "actor.nope"]) == 2
    assert "no config key 'actor.nope'; keys here: engine, fsdp2" in capsys.readouterr().err


def test_train_help_config_shows_the_composed_config_and_trains_nothing(capsys, tmp_path) -> None:
    assert (
        verity(["train", "--help-config", "trainer.total_steps=7", f"trainer.output_dir={tmp_path}/run"]) == 0
    )
    out = capsys.readouterr().out
    assert "  total_steps: 7  # RL steps" in out
    assert not (tmp_path / "run").exists()


def test_help_lists_only_commands_that_exist(capsys) -> None:
    import importlib

    from verity.cli.main import COMMANDS

    assert verity(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in COMMANDS:
        assert name in listed
        assert callable(importlib.import_module(f"verity.cli.{name}").main)


def test_eval_of_a_run_folder_takes_its_checkpoint_not_its_run_config(model_and_file, tmp_path, monkeypatch):
    """A run folder holds the run's own config.json; it is not an HF model folder."""
    from verity.cli import eval as eval_cli

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"trainer": {"total_steps": 3}, "actor": {}}))
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        eval_cli._resolve_model(str(run), "actor", tmp_path / "scratch")
    exported = []
    monkeypatch.setattr("verity.checkpoint.export.find_checkpoint", lambda path: run / "checkpoints" / "step_3")
    monkeypatch.setattr(
        "verity.checkpoint.export.export_hf", lambda ckpt, out, role: exported.append((ckpt, role)) or out
    )
    folder, _, _ = eval_cli._resolve_model(str(run), "actor", tmp_path / "scratch")
    assert exported == [(run / "checkpoints" / "step_3", "actor")] and folder == str(tmp_path / "scratch" / "hf")
    assert eval_cli._resolve_model(model_and_file["model"], "actor", tmp_path)[0] == model_and_file["model"]


REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if data_source == "acme/mult" else 0.5

def zero(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 0.0
"""


def test_eval_of_a_run_scores_with_the_runs_reward_settings(model_and_file, tmp_path, monkeypatch, capsys):
    """A run trained with reward.custom_path=myreward.py (relative) on its own data_source is evaluated
    with that function, its path read against the folder verity train ran in; reward.* arguments override."""
    import pyarrow.parquet as pq
    from verity.checkpoint import layout
    from verity.checkpoint.state import TrainerState
    from verity.config import config_to_dict, load_config

    table = pq.read_table(model_and_file["test"])
    test = tmp_path / "test.parquet"
    pq.write_table(table.set_column(table.column_names.index("data_source"), "data_source",
                                    [["acme/mult"] * table.num_rows]), test)  # fmt: skip
    workdir, run = tmp_path / "project", tmp_path / "project" / "outputs" / "run"
    workdir.mkdir()
    (workdir / "myreward.py").write_text(REWARD)
    monkeypatch.chdir(workdir)  # where verity train ran
    saved = config_to_dict(load_config(["reward.custom_path=myreward.py", f"trainer.output_dir={run}"]))
    assert saved["reward"]["custom_path"] == "myreward.py"
    tmp = run / "checkpoints" / "step_3.tmp"
    tmp.mkdir(parents=True)
    TrainerState(step=3, total_steps=3, dataloader={}, kl_coef=None, run_id=None, tracking_uri=None,
                 config_hash="h", config=saved, working_dir=str(workdir)).write(tmp)  # fmt: skip
    layout.commit(tmp, run / "checkpoints" / "step_3")
    monkeypatch.setattr("verity.checkpoint.export.export_hf", lambda ckpt, out, role: model_and_file["model"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # evaluated from another folder: myreward.py is not here

    def evaluate(*extra: str) -> tuple[int, dict, str]:
        report = tmp_path / "report.json"
        report.unlink(missing_ok=True)
        args = ["eval", *extra[:1], "--data", str(test), "--max-new-tokens", "4", "--json", str(report), *extra[1:]]
        code = verity(args)
        err = capsys.readouterr().err
        return code, json.loads(report.read_text()) if code == 0 else {}, err

    code, report, err = evaluate(str(run))
    assert code == 0, err
    assert report["mean_score"] == 1.0 and report["metrics"]["val/acme/mult/acc"] == 1.0
    assert f"reward settings of the run, from {run}/checkpoints/step_3/trainer_state.json" in err
    code, report, err = evaluate(str(run), "reward.custom_name=zero")  # a reward.* argument wins
    assert code == 0 and report["mean_score"] == 0.0, err
    code, report, err = evaluate(model_and_file["model"])  # an HF folder: the defaults know no acme/mult
    assert code == 2 and "data_source 'acme/mult': no reward function for it" in err
    code, report, err = evaluate(model_and_file["model"], f"reward.custom_path={workdir / 'myreward.py'}")
    assert code == 0 and report["mean_score"] == 1.0, err
    (workdir / "myreward.py").unlink()
    code, report, err = evaluate(str(run))
    assert code == 2 and f"reward.custom_path='{workdir / 'myreward.py'}' (the run's, from {run}" in err
    assert "no such file; give the reward function file with reward.custom_path=FILE.py" in err
