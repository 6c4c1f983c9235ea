"""The harness simulates the nodes a config spans when it names no cluster, and only then.

The decision and the shape are read from the config alone (no Ray); the two slow tests start a
simulated cluster: one torn down after a failure inside it, one running grpo's cpu-2node config
through ``verity-harness run`` for two steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from verity.config import ConfigError
from verity_harness.recipes import find_recipe
from verity_harness.simulated_cluster import SimulatedShape, shape_to_simulate, simulated_cluster

REPO = Path(__file__).resolve().parents[2]
GRPO = find_recipe("grpo", REPO)
TWO_NODES = GRPO.config_path("cpu-2node")


def test_a_config_spanning_two_nodes_without_a_cluster_gets_two_simulated_nodes(monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert shape_to_simulate([], TWO_NODES) == SimulatedShape(nodes=2, cpus_per_node=1)
    # each node holds its share of the pools: workers per node x cpus_per_worker, rounded up
    assert shape_to_simulate(["trainer.cpus_per_worker=1.5"], TWO_NODES) == SimulatedShape(2, 2)
    wide = ["trainer.n_workers=4", "trainer.n_workers_per_node=2", "trainer.cpus_per_worker=0.5"]
    assert shape_to_simulate(wide, TWO_NODES) == SimulatedShape(2, 1)
    # a separate critic of 2 workers over 2 nodes: one more worker on each node
    critic = [
        "algorithm.advantage.estimator=gae",
        "critic.placement=separate",
        "critic.n_workers=2",
        "critic.nnodes=2",
    ]
    assert shape_to_simulate(critic, TWO_NODES) == SimulatedShape(2, 2)
    # a separate role asking for 3 nodes while the actor spans 2: the cluster has 3
    assert shape_to_simulate([*critic[:2], "critic.n_workers=3", "critic.nnodes=3"], TWO_NODES).nodes == 3


def test_a_named_cluster_or_one_node_is_not_simulated(monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert shape_to_simulate(["trainer.ray_address=auto"], TWO_NODES) is None  # a real cluster: join it
    assert shape_to_simulate(["trainer.ray_address=10.0.0.1:6379"], TWO_NODES) is None
    assert shape_to_simulate([], GRPO.config_path("cpu")) is None  # a private single-node cluster
    assert shape_to_simulate(["trainer.nnodes=1", "trainer.n_workers_per_node=2"], TWO_NODES) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # `ray job submit` sets it: the run joins that
    assert shape_to_simulate([], TWO_NODES) is None


def test_other_refusals_stay_and_only_a_cpu_run_simulates(monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=r"trainer.val_every must be >= 0"):
        shape_to_simulate(["trainer.val_every=-1"], TWO_NODES)
    with pytest.raises(ConfigError, match=r"unknown"):
        shape_to_simulate(["trainer.nnodez=2"], TWO_NODES)
    with pytest.raises(ConfigError) as err:
        shape_to_simulate(["trainer.device=cuda"], TWO_NODES, family="cuda")
    assert "needs a Ray cluster to join" in str(err.value)
    assert "simulates 2 nodes on a CPU only: on cuda devices pass trainer.ray_address" in str(err.value)


def test_no_shape_starts_nothing() -> None:
    with simulated_cluster(None) as address:
        assert address is None


def _sim_folders() -> set[Path]:
    return set(Path("/tmp").glob("vh-sim-*"))


@pytest.mark.slow
def test_the_simulated_cluster_is_torn_down_when_the_run_fails() -> None:
    import os

    import ray
    from verity.controller.reaper import cluster_processes

    before = _sim_folders()
    folder = None
    with (
        pytest.raises(RuntimeError, match="the run failed"),
        simulated_cluster(SimulatedShape(nodes=2, cpus_per_node=1)) as address,
    ):
        folder = os.environ["RAY_TMPDIR"]
        assert cluster_processes(folder), "the nodes' processes carry the reaper's marker"
        ray.init(address=address)
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert len(alive) == 2 and all(n["Resources"].get("CPU") == 1.0 for n in alive)
        raise RuntimeError("the run failed")
    assert not ray.is_initialized()
    assert folder is not None and not Path(folder).exists() and cluster_processes(folder) == []
    assert _sim_folders() <= before
    assert os.environ.get("RAY_TMPDIR") != folder


@pytest.mark.slow
def test_harness_runs_grpo_cpu_2node_on_two_simulated_nodes(tmp_path: Path, monkeypatch, capsys) -> None:
    from verity_harness.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = _sim_folders()
    out = tmp_path / "result.json"
    code = main(
        [
            "run",
            "grpo",
            "--config",
            "cpu-2node",
            "--hardware",
            "cpu",
            "--output-root",
            str(tmp_path / "harness"),
            "--results-dir",
            str(tmp_path / "results"),  # never the tracked leaderboards/results
            "--result-out",
            str(out),
            "trainer.total_steps=2",
            "trainer.val_before_train=false",
            "data.val_max_samples=16",
            "model.embedded_sft_steps=50",
            f"model.embedded_cache_dir={tmp_path / 'embedded'}",
        ]
    )
    printed = capsys.readouterr().out
    assert code in (0, 1), printed  # 1: two steps miss the 200-step accuracy, as they should
    result = json.loads(out.read_text())
    assert (result["config"], result["nodes"], result["simulated_nodes"]) == ("cpu-2node", 2, 2)
    assert result["ran"]["nodes"] == "2"
    spans = result["ran"]["placement.actor"].split(",")
    assert len({span.rsplit(":", 1)[0] for span in spans}) == 2  # one worker on each node
    assert result["expected_source"] == "config:cpu"
    nodes_check = next(c for c in result["checks"] if c["metric"] == "nodes")
    assert nodes_check["passed"] and nodes_check["value"] == 2
    assert "simulated a Ray cluster of 2 nodes x 1 CPU(s)" in printed
    assert "2 nodes (simulated on this machine)" in printed
    written = list((tmp_path / "results" / "grpo").glob("*-cpu-2node.json"))
    assert len(written) == 1
    assert _sim_folders() <= before  # the cluster is gone with its folder
