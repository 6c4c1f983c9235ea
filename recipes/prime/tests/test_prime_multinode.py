"""PRIME with its PRM on a worker group of its own, on the other node of a simulated two-node cluster."""

from __future__ import annotations

import json

import pytest
from helpers.sim_cluster import simulated_cluster
from test_prime_resume import run_args
from verity.config import load_config

pytestmark = pytest.mark.slow


def test_a_separate_prm_trains_on_the_other_node(prime_tiny_model_and_task, tmp_path):
    from verity.launch.run import run_training

    out = tmp_path / "prm-apart"
    with simulated_cluster(head={"num_cpus": 2}, nodes=[{"num_cpus": 2}]) as cluster:
        args = run_args(
            prime_tiny_model_and_task,
            out,
            f"trainer.ray_address={cluster.address}",
            "trainer.cpus_per_worker=1",
            "trainer.total_steps=2",
            "trainer.progress=false",
            "prm.placement=separate",
            "prm.n_workers=2",
        )
        summary = run_training(load_config(args[2:], config_file=args[1]))  # args[:2] is --config FILE
    ran = summary["ran"]
    actor_nodes = {span.rsplit(":", 1)[0] for span in ran["placement.actor"].split(",")}
    prm_nodes = {span.rsplit(":", 1)[0] for span in ran["placement.prm"].split(",")}
    assert len(actor_nodes) == 1 and len(prm_nodes) == 1 and actor_nodes != prm_nodes
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(row.get("prm/optimizer_steps", 0) > 0 for row in rows), sorted(rows[-1])  # the PRM trained
