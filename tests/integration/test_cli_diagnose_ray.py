"""verity diagnose --ray: a private local start, and a joined (simulated) cluster's nodes and layout check."""

from __future__ import annotations

import json

import pytest
from verity.cli import diagnose, diagnose_ray


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("VERITY_DEVICE", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)


def test_ray_flag_starts_a_local_instance(monkeypatch, capsys):
    ray = pytest.importorskip("ray")
    assert diagnose.main(["--ray", "--json"]) == 0
    local = json.loads(capsys.readouterr().out)["ray"]["local_start"]
    assert local["ok"] is True, local
    assert local["resources"]["CPU"] == 1.0
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def gpu_cluster():
    """A head of 1 CPU plus two nodes of 2 CPUs and 8 declared GPUs (nothing computes on them)."""
    ray = pytest.importorskip("ray")
    from helpers.sim_cluster import simulated_cluster

    gpu_node = {"num_cpus": 2, "num_gpus": 8, "object_store_memory": 100 * 2**20}
    head = {"num_cpus": 1, "object_store_memory": 100 * 2**20}
    with simulated_cluster(head=head, nodes=[gpu_node, gpu_node]) as cluster:
        ray.shutdown()  # diagnose joins (and leaves) the cluster itself
        yield cluster


@pytest.fixture
def no_local_start(monkeypatch):
    """The local Ray start is the test above's; here only the joined cluster matters."""
    monkeypatch.setattr(diagnose_ray, "start_local_ray", lambda: {"ok": True, "skipped": "by the test"})


def test_joined_cluster_lists_its_nodes_and_resources(gpu_cluster, no_local_start, monkeypatch, capsys):
    import ray

    monkeypatch.setenv("RAY_ADDRESS", gpu_cluster.address)
    assert diagnose.main(["--ray", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "placement" not in report
    join = report["ray"]["cluster_join"]
    assert join["ok"] is True, join
    assert join["nodes"] == 3
    assert join["resources"]["GPU"] == 16.0
    rows = join["node_list"]
    assert sorted((row["resources"]["CPU"], row["resources"].get("GPU", 0.0)) for row in rows) == [
        (1.0, 0.0),
        (2.0, 8.0),
        (2.0, 8.0),
    ]
    assert sum(row["driver"] for row in rows) == 1
    assert not ray.is_initialized()

    assert diagnose.main(["--ray"]) == 0
    text = capsys.readouterr().out
    listing = text.split("== ray nodes ==\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(listing) == 3
    assert sum("{CPU: 2, GPU: 8}" in line for line in listing) == 2
    assert sum("(this driver)" in line for line in listing) == 1


def test_a_layout_that_fits_prints_its_plan(gpu_cluster, no_local_start, capsys):
    layout = ["trainer.nnodes=2", "trainer.n_workers_per_node=2", "trainer.device=cuda"]
    argv = ["--ray", *layout, f"trainer.ray_address={gpu_cluster.address}"]
    assert diagnose.main([*argv, "--json"]) == 0
    placement = json.loads(capsys.readouterr().out)["placement"]
    assert placement["fits"] is True, placement
    assert placement["backend"] == "cuda"
    assert placement["requests"] == ["actor (actor): 4 workers of {CPU: 1, GPU: 1} on 2 node(s)"]
    assert placement["nodes_used"] == 2
    assert len(placement["plan"]) == 2
    assert "ranks 0-1" in placement["plan"][0] and "ranks 2-3" in placement["plan"][1]
    # the two GPU nodes, not the head
    assert all("{CPU: 1, GPU: 1} each" in line for line in placement["plan"])
    assert (
        placement["plan"][0].split("node ")[1].split()[0] != placement["plan"][1].split("node ")[1].split()[0]
    )

    assert diagnose.main(argv) == 0
    text = capsys.readouterr().out
    section = text.split("== placement ==\n", 1)[1].split("\n\n", 1)[0]
    assert "fits" in section and "True" in section
    assert "    actor  node " in section and "ranks 2-3" in section


def test_a_layout_that_does_not_fit_says_why_and_exits_2(gpu_cluster, no_local_start, capsys):
    address = f"trainer.ray_address={gpu_cluster.address}"
    # four nodes of 2 GPU workers: only two nodes have GPUs (more could join)
    argv = [
        "--ray",
        "--json",
        "trainer.nnodes=4",
        "trainer.n_workers_per_node=2",
        "trainer.device=cuda",
        address,
    ]
    assert diagnose.main(argv) == 2
    placement = json.loads(capsys.readouterr().out)["placement"]
    assert placement["fits"] is False
    assert "plan" not in placement
    error = placement["error"]
    assert error.startswith(
        "the 'actor' pool asked for 8 workers of {CPU: 1, GPU: 1} on 4 node(s), 2 per node"
    )
    assert "trainer.placement_timeout_s" in error

    # four workers per node: no node, even idle, has 4 CPUs
    argv = ["--ray", "trainer.nnodes=2", "trainer.n_workers_per_node=4", "trainer.device=cuda", address]
    assert diagnose.main(argv) == 2
    text = capsys.readouterr().out
    assert "no node of this cluster, even idle, holds one node's share of actor" in text
