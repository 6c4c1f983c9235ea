"""Checkpoint folders: atomic commit, the latest pointer, pruning, resume choice, driver state, SIGTERM flag."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time

import numpy as np
import pytest
import torch
from verity.checkpoint import layout
from verity.checkpoint.replay import ReplayAwareTracker
from verity.checkpoint.resume import config_differences, resolve_resume
from verity.checkpoint.signals import GracefulStop, TrainingStopped
from verity.checkpoint.state import TrainerState, capture_rng, restore_rng
from verity.config import ConfigError, load_config
from verity.testing.faults import parse_crash_at, parse_stall


def make_state(step: int = 3, **overrides) -> TrainerState:
    values = dict(
        step=step,
        total_steps=10,
        dataloader={"epoch": 1, "position": 16},
        kl_coef=0.05,
        run_id="abc",
        tracking_uri="sqlite:///x.db",
        config_hash="h",
        config={"trainer": {"seed": 0}},
        history=[{"loss": 0.1 + i / 3} for i in range(step)],
    )
    values.update(overrides)
    return TrainerState(**values)


def commit_step(root, step: int) -> None:
    tmp = root / f"step_{step}.tmp"
    (tmp / "actor").mkdir(parents=True)
    (tmp / "actor" / "shard").write_text(str(step))
    make_state(step).write(tmp)
    layout.commit(tmp, root / f"step_{step}")


def test_commit_renames_and_moves_latest(tmp_path):
    commit_step(tmp_path, 2)
    commit_step(tmp_path, 4)
    assert (tmp_path / "latest").read_text().strip() == "step_4"
    assert [s for s, _ in layout.list_checkpoints(tmp_path)] == [2, 4]
    assert not list(tmp_path.glob("*.tmp"))
    assert layout.find_latest(tmp_path) == tmp_path / "step_4"


def test_an_interrupted_save_is_never_picked(tmp_path):
    commit_step(tmp_path, 2)
    # a save of step 4 that died before trainer_state.json / the rename
    (tmp_path / "step_4.tmp" / "actor").mkdir(parents=True)
    # and a final-named folder without its state file (e.g. copied by hand, half-way)
    (tmp_path / "step_6" / "actor").mkdir(parents=True)
    assert layout.find_latest(tmp_path) == tmp_path / "step_2"
    removed = layout.remove_unfinished(tmp_path)
    assert [p.name for p in removed] == ["step_4.tmp"]


def test_latest_lagging_behind_a_committed_step_is_overruled(tmp_path):
    commit_step(tmp_path, 2)
    commit_step(tmp_path, 4)
    (tmp_path / "latest").write_text("step_2\n")  # crash between the rename and the pointer update
    assert layout.find_latest(tmp_path) == tmp_path / "step_4"
    (tmp_path / "latest").write_text("step_9\n")  # names nothing complete
    assert layout.find_latest(tmp_path) == tmp_path / "step_4"


def test_committing_a_step_again_replaces_it(tmp_path):
    commit_step(tmp_path, 2)
    tmp = tmp_path / "step_2.tmp"
    (tmp / "actor").mkdir(parents=True)
    (tmp / "actor" / "shard").write_text("new")
    make_state(2).write(tmp)
    layout.commit(tmp, tmp_path / "step_2")
    assert (tmp_path / "step_2" / "actor" / "shard").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2"]


def test_prune_keeps_the_newest_and_the_protected(tmp_path):
    for step in (1, 2, 3, 4):
        commit_step(tmp_path, step)
    removed = layout.prune(tmp_path, keep=2, protect=tmp_path / "step_4")
    assert sorted(p.name for p in removed) == ["step_1", "step_2"]
    assert [s for s, _ in layout.list_checkpoints(tmp_path)] == [3, 4]
    assert layout.prune(tmp_path, keep=0) == []  # 0 keeps all
    assert not list(tmp_path.glob("*.tmp"))  # deleted folders were renamed, then removed


def test_step_names():
    assert layout.step_dir_name(12) == "step_12"
    assert layout.step_of("a/step_12") == 12
    assert layout.step_of("step_12.tmp") is None
    with pytest.raises(ValueError, match="step"):
        layout.step_dir_name(-1)


def test_trainer_state_round_trips_floats_bit_for_bit(tmp_path):
    history = [{"x": 0.1 + 0.2, "nan": float("nan"), "inf": float("inf"), "tiny": 5e-324}]
    make_state(1, history=history).write(tmp_path)
    back = TrainerState.read(tmp_path)
    row = back.history[0]
    assert row["x"] == 0.1 + 0.2 and row["tiny"] == 5e-324 and row["inf"] == float("inf")
    assert math.isnan(row["nan"])
    assert back.dataloader == {"epoch": 1, "position": 16} and back.kl_coef == 0.05


def test_trainer_state_rejects_other_formats(tmp_path):
    data = json.loads(make_state().to_json())
    data["format_version"] = 99
    (tmp_path / layout.STATE_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format 99"):
        TrainerState.read(tmp_path)
    with pytest.raises(FileNotFoundError, match="complete checkpoint"):
        TrainerState.read(tmp_path / "nowhere")


def test_rng_states_restore_the_same_draws():
    state = capture_rng()
    json.dumps(state)  # JSON-able
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng(json.loads(json.dumps(state)))
    again = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert first == again


def test_fault_specs_parse_and_reject_garbage():
    assert parse_crash_at("save:4") == ("save", 4)
    assert parse_crash_at("step_end:12") == ("step_end", 12)
    with pytest.raises(ValueError, match="VERITY_DEBUG_CRASH_AT"):
        parse_crash_at("later:4")
    assert parse_stall("update_actor:3:1.5") == ("update_actor", 3, 1.5)
    with pytest.raises(ValueError, match="VERITY_DEBUG_STALL"):
        parse_stall("update_actor")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_sets_the_flag_and_the_handlers_are_restored(signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with GracefulStop() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signum)
        assert stop.requested and stop.received == signum  # the process is still alive
    assert {s: signal.getsignal(s) for s in before} == before
    err = TrainingStopped(7, "/x/step_7", signum)
    assert err.step == 7 and "trainer.resume=auto" in str(err)
    assert err.exit_code == 128 + signum


def test_a_second_ctrl_c_interrupts_even_when_sigint_was_ignored_at_start():
    # a run launched in the background by a non-interactive shell inherits SIGINT ignored:
    # re-sending the signal would then do nothing, so the second Ctrl-C must raise by itself
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with GracefulStop() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(100):  # the handler runs at the next bytecode boundary
                    time.sleep(0.01)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored as found
    finally:
        signal.signal(signal.SIGINT, previous)


class _RecordingTracker:
    run_id = "r1"

    def __init__(self) -> None:
        self.calls: list[tuple[dict, int]] = []

    def log_metrics(self, metrics, step):
        self.calls.append((dict(metrics), step))


def test_replayed_steps_are_not_logged_twice():
    inner = _RecordingTracker()
    tracker = ReplayAwareTracker(inner, {("loss", 3), ("acc", 3), ("loss", 4)})
    tracker.log_metrics({"loss": 1.0, "acc": 0.5}, step=3)  # all already there
    tracker.log_metrics({"loss": 2.0, "acc": 0.7}, step=4)  # acc missing at step 4
    tracker.log_metrics({"loss": 3.0}, step=5)
    assert inner.calls == [({"acc": 0.7}, 4), ({"loss": 3.0}, 5)]
    assert tracker.skipped == 3
    assert tracker.run_id == "r1"  # everything else passes through


def test_config_differences_ignore_bookkeeping():
    saved = {"trainer": {"resume": "auto", "checkpoint": {"every": 2}, "seed": 0}, "actor": {"lr": 1.0}}
    current = {"trainer": {"resume": "off", "checkpoint": {"every": 5}, "seed": 1}, "actor": {"lr": 1.0}}
    assert config_differences(saved, current) == ["trainer.seed: 0 -> 1"]


def test_a_section_the_saved_run_lacked_is_no_change_at_its_defaults():
    """A run saved before a plug-in was installed resumes where it is: its section at defaults is no change."""
    defaults = {"trainer": {"seed": 0}, "mine": {"enabled": False, "bonus": {"weight": 0.5}}}
    saved = {"trainer": {"seed": 0}}
    current = {"trainer": {"seed": 0}, "mine": {"enabled": False, "bonus": {"weight": 0.5}}}
    assert config_differences(saved, current, defaults) == []
    assert config_differences(current, saved, defaults) == []  # or saved with it, resumed without
    current["mine"]["bonus"]["weight"] = 2.0
    assert config_differences(saved, current, defaults) == ["mine.bonus.weight: '<absent>' -> 2.0"]
    unknown = {"trainer": {"seed": 0}, "gone": {"x": 1}}  # a section this environment has no default for
    assert config_differences(unknown, saved, defaults) == ["gone.x: 1 -> '<absent>'"]


def test_a_run_saved_without_the_installed_plugin_sections_resumes(tmp_path):
    from verity.checkpoint.resume import require_same_config
    from verity.config import config_to_dict
    from verity.config.sections import plugin_sections

    cfg = load_config([f"trainer.output_dir={tmp_path}"])
    sections = plugin_sections(cfg)
    if not sections:
        pytest.skip("no plug-in with a config section is installed")
    current = config_to_dict(cfg)
    saved = {k: v for k, v in current.items() if k not in sections}  # made before they were installed
    require_same_config(saved, current, tmp_path / "step_3")  # no ConfigError
    name = next(iter(sections))
    node, path = current[name], [name]
    while isinstance(node[next(iter(node))], dict):  # the section's first leaf, set away from its default
        path.append(next(iter(node)))
        node = node[path[-1]]
    leaf = next(iter(node))
    node[leaf] = "changed"
    changed = config_differences(saved, current)
    assert changed == [f"{'.'.join(path)}.{leaf}: '<absent>' -> 'changed'"]


def test_resume_choice(tmp_path):
    out = tmp_path / "run"
    base = [f"trainer.output_dir={out}"]
    assert resolve_resume(load_config(base)) is None  # auto, nothing there: fresh start
    root = out / "checkpoints"
    root.mkdir(parents=True)
    commit_step(root, 2)
    commit_step(root, 5)
    assert resolve_resume(load_config(base)) == root / "step_5"
    assert resolve_resume(load_config([*base, f"trainer.resume={root / 'step_5'}"])) == root / "step_5"
    assert resolve_resume(load_config([*base, f"trainer.resume={out}"])) == root / "step_5"
    assert (
        resolve_resume(load_config([*base, "trainer.resume=off"])) is None
    )  # fresh (the run moves the old aside)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resolve_resume(load_config([*base, f"trainer.resume={tmp_path / 'empty'}"]))


def test_an_explicit_checkpoint_never_mixes_two_histories(tmp_path):
    first = tmp_path / "first" / "checkpoints"
    first.mkdir(parents=True)
    commit_step(first, 2)
    commit_step(first, 5)
    own = [f"trainer.output_dir={tmp_path / 'first'}"]
    with pytest.raises(ConfigError, match=r"newer than step_2 \(step_5\)"):
        resolve_resume(load_config([*own, f"trainer.resume={first / 'step_2'}"]))
    # a new run starting from another run's checkpoint: fine while its own folder is empty
    second = [f"trainer.output_dir={tmp_path / 'second'}", f"trainer.resume={first / 'step_2'}"]
    assert resolve_resume(load_config(second)) == first / "step_2"
    (tmp_path / "second" / "checkpoints").mkdir(parents=True)
    commit_step(tmp_path / "second" / "checkpoints", 3)
    with pytest.raises(ConfigError, match="continue it with trainer.resume=auto"):
        resolve_resume(load_config(second))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.checkpoint.every=-1", "trainer.checkpoint.every"),
        ("trainer.checkpoint.keep=-2", "trainer.checkpoint.keep"),
        ("trainer.stage_timeout_s=-1", "trainer.stage_timeout_s"),
        ("trainer.resume=/no/such/checkpoint", "trainer.resume"),
        ("data.on_malformed=ignore", "data.on_malformed"),
    ],
)
def test_bad_fault_tolerance_settings_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([override])


def test_a_model_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config([f"model.path={tmp_path}"])
