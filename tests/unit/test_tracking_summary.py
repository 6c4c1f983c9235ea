"""summary.json (atomic), config hashing, config flattening, best-metric bookkeeping."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest
import torch
from verity.tracking import (
    BestMetrics,
    config_hash,
    flatten_config,
    names,
    read_summary,
    to_mlflow_params,
    write_summary,
)
from verity.tracking import summary as summary_module


def test_summary_holds_metrics_wall_time_hash_and_extra(tmp_path):
    path = write_summary(
        tmp_path,
        final_metrics={names.ACC_MEAN: np.float32(0.5), names.ACTOR_KL: float("nan")},
        best_metrics={names.ACC_MEAN: {"value": torch.tensor(0.75), "step": 7}},
        wall_seconds=12.5,
        config_hash="abc123",
        extra={"accuracy_before": 0.25, "accuracy_after": 0.5, "steps": 10, "output_dir": tmp_path},
    )
    assert path == tmp_path / "summary.json"
    data = json.loads(path.read_text())
    assert data["final_metrics"] == {names.ACC_MEAN: 0.5, names.ACTOR_KL: None}
    assert data["best_metrics"] == {names.ACC_MEAN: {"value": 0.75, "step": 7}}
    assert data["wall_seconds"] == 12.5
    assert data["config_hash"] == "abc123"
    assert (data["accuracy_before"], data["accuracy_after"], data["steps"]) == (0.25, 0.5, 10)
    assert data["output_dir"] == str(tmp_path)
    assert read_summary(tmp_path) == data
    assert os.listdir(tmp_path) == ["summary.json"]  # no temp file left behind


def test_summary_write_is_atomic_old_file_survives_a_failed_replace(tmp_path, monkeypatch):
    write_summary(tmp_path, {"acc/mean": 0.1}, {}, 1.0, "first")
    seen = []

    def failing_replace(src, dst):
        seen.append((os.path.dirname(src), os.path.basename(dst)))
        raise OSError("disk full")

    monkeypatch.setattr(summary_module.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_summary(tmp_path, {"acc/mean": 0.9}, {}, 2.0, "second")
    assert seen == [(str(tmp_path), "summary.json")]  # temp file was beside the target
    assert read_summary(tmp_path)["config_hash"] == "first"
    assert os.listdir(tmp_path) == ["summary.json"]


def test_summary_rejects_clashing_extra_and_bad_values(tmp_path):
    with pytest.raises(ValueError, match="wall_seconds"):
        write_summary(tmp_path, {}, {}, 1.0, "h", extra={"wall_seconds": 3})
    with pytest.raises(ValueError, match="wall_seconds"):
        write_summary(tmp_path, {}, {}, -1.0, "h")
    with pytest.raises(ValueError, match="config_hash"):
        write_summary(tmp_path, {}, {}, 1.0, "")
    with pytest.raises(TypeError, match="object"):
        write_summary(tmp_path, {"x": object()}, {}, 1.0, "h")


def test_config_hash_is_sha256_of_sorted_compact_json():
    expected = hashlib.sha256(b'{"a":1,"b":[1,2],"c":{"d":"x"}}').hexdigest()
    assert config_hash({"c": {"d": "x"}, "b": [1, 2], "a": 1}) == expected
    assert config_hash({"a": 1, "b": [1, 2], "c": {"d": "x"}}) == expected
    assert config_hash({"a": 2, "b": [1, 2], "c": {"d": "x"}}) != expected
    assert config_hash({"a": 1, "b": [2, 1], "c": {"d": "x"}}) != expected  # list order matters


@dataclasses.dataclass
class Optim:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)


@dataclasses.dataclass
class Actor:
    optim: Optim = dataclasses.field(default_factory=Optim)
    dtype: torch.dtype = torch.bfloat16


def test_config_hash_treats_dataclasses_like_dicts_and_names_bad_leaves():
    as_dict = {"optim": {"lr": 1e-6, "betas": [0.9, 0.999]}, "dtype": "torch.bfloat16"}
    assert config_hash(Actor()) == config_hash(as_dict)
    with pytest.raises(TypeError, match=r"config\.model\.fn"):
        config_hash({"model": {"fn": print}})


def test_flatten_config_joins_nested_keys_with_dots():
    flat = flatten_config({"actor": Actor(), "seed": 1, "extras": {}})
    assert flat == {
        "actor.optim.lr": 1e-6,
        "actor.optim.betas": (0.9, 0.999),
        "actor.dtype": torch.bfloat16,
        "seed": 1,
        "extras": {},
    }
    with pytest.raises(TypeError, match="mapping or a dataclass"):
        flatten_config([1, 2])


def test_mlflow_params_fit_mlflow_rules():
    params = to_mlflow_params({"a b": {"c@d": [1, 2]}, "k" * 300: "v", "none": None})
    assert params["a b.c_d"] == "[1, 2]"
    assert params["none"] == "None"
    long_keys = [key for key in params if key.startswith("kkk")]
    assert len(long_keys) == 1 and len(long_keys[0]) == 250 and "~" in long_keys[0]


def test_best_metrics_tracks_value_and_step_by_goal():
    best = BestMetrics({names.ACC_MEAN: "max", "actor/pg_loss": "min"})
    best.update({names.ACC_MEAN: 0.2, "actor/pg_loss": 1.5}, step=1)
    best.update({names.ACC_MEAN: 0.6, "actor/pg_loss": 2.0}, step=2)
    best.update({names.ACC_MEAN: float("nan"), "actor/pg_loss": np.float64(0.5)}, step=3)
    best.update({names.ACC_MEAN: 0.4}, step=4)
    assert best.as_dict() == {
        names.ACC_MEAN: {"value": 0.6, "step": 2},
        "actor/pg_loss": {"value": 0.5, "step": 3},
    }
    assert set(BestMetrics().goals) >= {names.ACC_MEAN, names.REWARD_MEAN}
    with pytest.raises(ValueError, match="'max' or 'min'"):
        BestMetrics({"x": "up"})


def test_atomic_writes_get_the_mode_open_would_give_not_mkstemps_0600(tmp_path):
    import os
    import stat

    from verity.tracking import atomic_write_text

    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "summary.json", "{}")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # readable by a teammate, as other run files are
        os.umask(0o077)
        assert stat.S_IMODE(atomic_write_text(tmp_path / "private.json", "{}").stat().st_mode) == 0o600
    finally:
        os.umask(old)
