"""A run whose stage, estimator, role and config section all come from a plug-in package.

``verity-demo-plugin`` (tests/plugins/demo, installed by ``nox -s tests``) reaches the
runtime only through the entry-point group ``verity.plugins``; no file of the runtime
names it. The run goes through the harness, so the result file's engine fields are
checked against what the workers reported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("verity_demo_plugin", reason="the demo plug-in is installed by `nox -s tests`")


def _recipe_folder(root: Path) -> Path:
    """A throw-away recipe ``demo`` whose cpu config switches the plug-in on."""
    folder = root / "recipes" / "demo"
    configs = folder / "src" / "verity_recipe_demo" / "configs"
    configs.mkdir(parents=True)
    (folder / "pyproject.toml").write_text('[project]\nname = "verity-recipe-demo"\nversion = "0.0.1"\n')
    (configs / "cpu.yaml").write_text(
        "defaults: [verity, _self_]\nplugins: [verity-demo-plugin]\n"
        "demo: {enabled: true, bonus: 0.25}\nalgorithm: {advantage: {estimator: demo_centered}}\n"
    )
    return root / "recipes"


@pytest.mark.slow
def test_a_plugin_stage_estimator_role_and_section_run_in_the_workers(
    tiny_model_and_task, tmp_path, monkeypatch
) -> None:
    from verity_harness.runner import run_recipe

    paths = tiny_model_and_task
    monkeypatch.setenv("VERITY_RECIPES_DIR", str(_recipe_folder(tmp_path)))
    outcome = run_recipe(
        "demo",
        "cpu",
        hardware="cpu",
        overrides=[
            f"model.path={paths['model']}",
            f"data.train_files=[{paths['train']}]",
            f"data.val_files=[{paths['test']}]",
            "data.train_batch_size=4",
            "data.max_prompt_length=32",
            "data.max_response_length=4",
            "data.val_max_samples=8",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=2",
            "actor.micro_batch_size=8",
            "trainer.total_steps=2",
            "trainer.n_workers=2",
            "trainer.cpus_per_worker=0.5",
            "trainer.progress=false",
        ],
        output_root=tmp_path / "harness",
        results_dir=tmp_path / "results",
    )
    run_dir = Path(outcome.result["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stage_plan"][:3] == ["generate", "reward", "demo_bonus"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["demo/probe_processes"] == 2.0  # both worker ranks ran the plug-in's role
        assert row["demo/driver_in_probe"] == 0.0  # ... in their own processes, not the driver's
        assert row["demo/registered_in_workers"] == 1.0  # where the plug-in's registrations exist
        assert row["reward/mean"] >= 0.25  # the stage's bonus reached the scores
    # the harness records what the workers reported running, never the config's string
    assert summary["ran"].pop("device_name")  # the CPU's model name: machine-dependent
    # where the ranks ran: one node (this machine), each pool on it
    assert summary["ran"].pop("nodes") == "1"
    assert summary["ran"].pop("placement.actor").count(",") == 0
    assert summary["ran"] == {
        "actor": "fsdp2",
        "actor_sharding": "full",
        "actor_compute_dtype": "float32",
        "actor_attention": "verity_packed_sdpa",  # sdpa, rows kept apart in packed passes
        "actor_packed": "true",  # fsdp2.packed: on by default on a CPU
        "actor_weights_loaded": "streamed",  # built empty, each rank given its shard of the folder
        "actor_vocab_sharded": "true",  # two ranks on a CPU: the vocabulary in row shards by default
        "rollout": "hf",
        "rollout_dtype": "float32",
        "rollout_attention": "verity_sdpa_gqa",  # grouped key/value heads read in place on CPU
        "mode": "sync",  # no rollout worker group of its own
        "device": "cpu",
    }
    assert (outcome.result["backend"], outcome.result["train_engine"]) == ("hf", "fsdp2")
    assert os.path.exists(outcome.result_path)
