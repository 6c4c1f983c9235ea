"""Run A, then a different config B in the same folder: refused naming the keys; A again resumes; off moves A aside."""

from __future__ import annotations

import json

import pytest
from verity.config import ConfigError, load_config


def _args(paths: dict[str, str], out: str, *extra: str) -> list[str]:
    return [
        f"model.path={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['test']}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=32",
        "data.max_response_length=4",
        "data.val_max_samples=8",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=2",
        "trainer.n_workers=1",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *extra,
    ]


@pytest.mark.slow
def test_a_new_config_never_continues_an_old_run(tiny_model_and_task, tmp_path, capsys) -> None:
    from verity.launch.run import run_training

    out = tmp_path / "run"
    first = run_training(load_config(_args(tiny_model_and_task, str(out), "trainer.total_steps=1")))
    assert first["steps"] == 1 and (out / "checkpoints" / "step_1").is_dir()

    with pytest.raises(ConfigError) as err:  # B: another estimator into A's folder
        run_training(load_config(_args(tiny_model_and_task, str(out), "trainer.total_steps=2",
                                       "algorithm.advantage.estimator=rloo")))  # fmt: skip
    assert "algorithm.advantage.estimator: 'grpo' -> 'rloo'" in str(err.value)
    assert not (out / "checkpoints" / "step_2").exists()

    again = run_training(load_config(_args(tiny_model_and_task, str(out), "trainer.total_steps=2")))
    assert again["steps"] == 2 and again["run_id"] == first["run_id"]  # A continued, in the same MLflow run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["train/step"]) for r in rows] == [1, 2]

    fresh = run_training(load_config(_args(tiny_model_and_task, str(out), "trainer.total_steps=1",
                                           "trainer.resume=off")))  # fmt: skip
    assert fresh["steps"] == 1 and fresh["run_id"] != first["run_id"]
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.moved-")]
    assert len(moved) == 1 and (moved[0] / "checkpoints" / "step_2").is_dir()  # A kept whole, beside
    assert "were moved to" in capsys.readouterr().out
