"""Tracker: an embedded SQLite MLflow store that MLflow's own client reads back."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from verity.tracking import Tracker, names


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory) -> Path:
    # One private template-store cache for the module: the first Tracker builds it.
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, cache_home):
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("VERITY_MLFLOW_TEMPLATE", raising=False)


CONFIG = {
    "actor": {"optim": {"lr": 1e-6, "betas": [0.9, 0.999]}, "ppo_epochs": 1},
    "data": {"train_files": "train.parquet"},
    "long_note": "a" * 7000,
}


def test_params_and_per_step_metrics_read_back(tmp_path):
    tracker = Tracker(tmp_path, run_name="grpo-test", tags={"recipe": "grpo"})
    tracker.log_params(CONFIG)
    for step in range(5):
        tracker.log_metrics(
            {names.REWARD_MEAN: 0.25 * step, names.ACC_MEAN: 0.1 * step, "unused": None}, step
        )
    tracker.finish()

    assert (tmp_path / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "grpo-test"
    assert run.data.tags["recipe"] == "grpo"
    params = run.data.params
    assert params["actor.optim.lr"] == "1e-06"
    assert params["actor.optim.betas"] == "[0.9, 0.999]"
    assert params["actor.ppo_epochs"] == "1"
    assert params["data.train_files"] == "train.parquet"
    assert len(params["long_note"]) == 6000
    assert params["long_note"].endswith("[truncated 7000 chars]")
    history = client.get_metric_history(tracker.run_id, names.REWARD_MEAN)
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]
    assert "unused" not in run.data.metrics

    mlflow.set_tracking_uri(tracker.tracking_uri)
    try:
        frame = mlflow.search_runs(experiment_names=["verity"])
    finally:
        mlflow.set_tracking_uri(None)
    assert list(frame["run_id"]) == [tracker.run_id]
    assert frame.loc[0, "params.actor.optim.lr"] == "1e-06"
    assert frame.loc[0, f"metrics.{names.ACC_MEAN}"] == pytest.approx(0.4)


def test_artifacts_land_in_the_run_directory(tmp_path):
    note = tmp_path / "note.txt"
    note.write_text("hello")
    with Tracker(tmp_path) as tracker:
        tracker.log_artifact(note)
        tracker.log_dict({"seed": 3}, "config/resolved.json")
    artifact_uri = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(tracker.run_id).info.artifact_uri
    assert artifact_uri.startswith((tmp_path.resolve() / "mlartifacts").as_uri() + "/")
    artifacts = Path(artifact_uri.removeprefix("file://"))
    assert (artifacts / "note.txt").read_text() == "hello"
    assert json.loads((artifacts / "config" / "resolved.json").read_text()) == {"seed": 3}
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        Tracker(tmp_path).log_artifact(tmp_path / "missing.bin")


def test_continuing_a_run_appends_to_it(tmp_path):
    first = Tracker(tmp_path)
    first.log_params({"lr": 1.0})
    for step in range(3):
        first.log_metrics({names.ACTOR_KL: float(step)}, step)
    first.finish("KILLED")

    resumed = Tracker(tmp_path, run_id=first.run_id)
    client = MlflowClient(tracking_uri=resumed.tracking_uri)
    assert client.get_run(first.run_id).info.status == "RUNNING"
    resumed.log_params({"lr": 1.0, "resume": True})  # same value: skipped; new key: logged
    resumed.log_params({"lr": 2.0})  # changed value: kept as a tag, not an error
    for step in range(3, 5):
        resumed.log_metrics({names.ACTOR_KL: float(step)}, step)
    resumed.finish()

    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "1.0", "resume": "True"}
    assert run.data.tags["param_changed.lr"] == "2.0"
    history = client.get_metric_history(first.run_id, names.ACTOR_KL)
    assert sorted(m.step for m in history) == [0, 1, 2, 3, 4]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_large_batches_are_split_within_mlflow_limits(tmp_path):
    tracker = Tracker(tmp_path)
    tracker.log_params({f"p{i}": i for i in range(250)})
    tracker.log_metrics({f"m/{i}": float(i) for i in range(1500)}, step=0)
    tracker.finish()
    run = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(tracker.run_id)
    assert len(run.data.params) == 250
    assert len(run.data.metrics) == 1500
    assert run.data.metrics["m/1499"] == 1499.0


def test_bad_input_is_named(tmp_path):
    tracker = Tracker(tmp_path)
    with pytest.raises(ValueError, match="bad name!"):
        tracker.log_metrics({"bad name!": 1.0}, step=0)
    with pytest.raises(TypeError, match="'acc/mean'"):
        tracker.log_metrics({names.ACC_MEAN: "high"}, step=0)
    with pytest.raises(ValueError, match="step"):
        tracker.log_metrics({names.ACC_MEAN: 1.0}, step=-1)
    with pytest.raises(ValueError, match="status"):
        tracker.finish("DONE")
    tracker.finish()
    with pytest.raises(RuntimeError, match="finished"):
        tracker.log_metrics({names.ACC_MEAN: 1.0}, step=1)
    with pytest.raises(ValueError, match="run_id 'nope'"):
        Tracker(tmp_path, run_id="nope")


def test_exception_inside_with_marks_the_run_failed(tmp_path):
    with pytest.raises(ZeroDivisionError), Tracker(tmp_path) as tracker:
        1 / 0  # noqa: B018
    assert MlflowClient(tracking_uri=tracker.tracking_uri).get_run(tracker.run_id).info.status == "FAILED"


def test_store_without_template_cache_is_built_in_place_quietly(tmp_path, monkeypatch, capfd):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))  # cannot be created
    run_dir = tmp_path / "run"
    tracker = Tracker(run_dir)
    tracker.log_metrics({names.REWARD_MEAN: 1.0}, step=0)
    tracker.finish()
    captured = capfd.readouterr()
    assert captured.out == ""
    assert captured.err == ""
    assert MlflowClient(tracking_uri=tracker.tracking_uri).get_run(tracker.run_id).data.metrics == {
        names.REWARD_MEAN: 1.0
    }
    assert tracker.ui_command == f"mlflow ui --backend-store-uri sqlite:///{run_dir.resolve()}/mlflow.db"


def test_buffered_metrics_are_written_on_flush_and_on_finish(tmp_path):
    tracker = Tracker(tmp_path, buffer_seconds=3600.0)
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    for step in range(3):
        tracker.log_metrics({names.REWARD_MEAN: float(step)}, step)
    assert client.get_metric_history(tracker.run_id, names.REWARD_MEAN) == []  # still in memory
    tracker.flush()
    assert [m.step for m in client.get_metric_history(tracker.run_id, names.REWARD_MEAN)] == [0, 1, 2]
    tracker.log_metrics({names.REWARD_MEAN: 3.0}, 3)
    tracker.finish("FAILED")  # a failing run still keeps what it logged
    history = client.get_metric_history(tracker.run_id, names.REWARD_MEAN)
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert client.get_run(tracker.run_id).info.status == "FAILED"


def test_unbuffered_metrics_are_written_at_once_and_a_bad_buffer_is_named(tmp_path):
    tracker = Tracker(tmp_path)
    tracker.log_metrics({names.REWARD_MEAN: 1.0}, 0)
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    assert len(client.get_metric_history(tracker.run_id, names.REWARD_MEAN)) == 1
    tracker.finish()
    with pytest.raises(ValueError, match="buffer_seconds"):
        Tracker(tmp_path / "other", buffer_seconds=-1.0)
