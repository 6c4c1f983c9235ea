"""One run per output folder: the lock, moving an old run aside, readable run names, embedded defaults."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

import pytest
from verity.config import load_config
from verity.launch.run_dir import LOCK_FILE, OutputDirBusyError, claim_output_dir, move_aside, run_name


def test_the_lock_refuses_a_second_holder_and_frees_with_the_process(tmp_path) -> None:
    out = tmp_path / "run"
    probe = (
        "import sys; from pathlib import Path; from verity.launch.run_dir import claim_output_dir\n"
        "try:\n    with claim_output_dir(Path(sys.argv[1])): print('got it')\n"
        "except Exception as err: print(type(err).__name__, err)\n"
    )
    with claim_output_dir(out):
        busy = subprocess.run(
            [sys.executable, "-c", probe, str(out)], capture_output=True, text=True, timeout=60
        )
        assert busy.stdout.startswith("OutputDirBusyError") and "pid" in busy.stdout
        with pytest.raises(OutputDirBusyError), claim_output_dir(out):  # the same process: also refused
            pass
    free = subprocess.run([sys.executable, "-c", probe, str(out)], capture_output=True, text=True, timeout=60)
    assert free.stdout.strip() == "got it"


def test_move_aside_keeps_everything_and_takes_outside_checkpoints(tmp_path) -> None:
    out, ckpt = tmp_path / "run", tmp_path / "elsewhere"
    assert move_aside(out.parent / "missing", ckpt) is None
    (out / "checkpoints").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / LOCK_FILE).write_text("")
    (ckpt / "step_2").mkdir(parents=True)
    moved = move_aside(out, ckpt)
    assert moved is not None and moved.name.startswith("run.moved-")
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    assert (moved / "summary.json").read_text() == "{}"
    assert (moved / "checkpoints.elsewhere" / "step_2").is_dir() and not ckpt.exists()
    assert move_aside(out, ckpt) is None  # nothing left to move


def test_run_names_are_readable() -> None:
    assert run_name("quickstart", "1f3a9c2e7b", dt.datetime(2026, 11, 23, 14, 25, 1)) == (
        "quickstart-20261123-142501-1f3a9c2e"
    )


def test_embedded_defaults_learn_and_user_keys_win(tmp_path) -> None:
    cfg = load_config([])
    assert (cfg.actor.optim.lr, cfg.trainer.total_steps, cfg.data.max_response_length) == (3e-5, 100, 8)
    assert load_config(["actor.optim.lr=1e-6"]).actor.optim.lr == 1e-6
    path = tmp_path / "mine.yaml"
    path.write_text("defaults: [verity, _self_]\ntrainer: {total_steps: 7}\n")
    assert load_config([], config_file=path).trainer.total_steps == 7
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen2"}')
    real = load_config([f"model.path={tmp_path / 'model'}"])
    assert (real.actor.optim.lr, real.trainer.total_steps) == (1e-6, 200)  # verl-like for real checkpoints


def test_yaml_errors_name_the_place_and_type_errors_the_key(tmp_path) -> None:
    from verity.config import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: [verity, _self_]\ntrainer:\n  total_steps: [1\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line 4, column 1"):
        load_config([], config_file=bad)
    bad.write_text("defaults: [verity, _self_]\ntrainer:\n  total_steps: abc\n")
    with pytest.raises(
        ConfigError, match="'abc' of type 'str' could not be converted to Integer full_key: trainer"
    ):
        load_config([], config_file=bad)


def test_a_run_that_fails_before_training_removes_its_lock_and_the_folder_it_made(tmp_path) -> None:
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError), claim_output_dir(out):
        assert (out / LOCK_FILE).is_file()
        raise ValueError("rejected before training")
    assert not (tmp_path / "new").exists()  # the lock, and both folders the claim made
    kept = tmp_path / "kept"
    (kept / "notes").mkdir(parents=True)
    with pytest.raises(ValueError), claim_output_dir(kept):
        raise ValueError("rejected before training")
    assert sorted(p.name for p in kept.iterdir()) == ["notes"]  # a folder that was there stays, lock gone
    with pytest.raises(ValueError), claim_output_dir(kept) as claim:
        claim.training_started = True
        raise ValueError("failed while training")
    assert (kept / LOCK_FILE).is_file()  # a run that trained keeps its folder as it is
    with claim_output_dir(kept):  # and the folder can be claimed again
        pass
