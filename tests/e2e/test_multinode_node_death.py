"""A node that dies mid-run on a simulated cluster: the run stops naming the node and the rank lost,
and a resume on a cluster of the same shape repeats the uninterrupted run's metrics exactly."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from helpers.dense_reward import write_digit_reward
from helpers.sim_cluster import simulated_cluster
from verity.checkpoint import list_checkpoints
from verity.config import load_config

pytestmark = pytest.mark.slow

STEPS = 4
DETERMINISTIC_KEYS = ("reward/mean", "actor/loss", "actor/grad_norm", "response_length/mean", "actor/kl_loss")


def _saved_step(out: Path) -> int:
    """The newest complete checkpoint's step under ``out`` (0: none yet)."""
    return max((step for step, _ in list_checkpoints(out / "checkpoints")), default=0)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_node_death_is_named_and_the_resume_repeats_the_run(tiny_grpo_overrides, tmp_path, capsys):
    from verity.cli.train import execute
    from verity.launch.run import run_training

    reward = write_digit_reward(tmp_path)

    def overrides(out: Path, address: str, *extra: str) -> list[str]:
        return tiny_grpo_overrides(
            str(out),
            f"trainer.ray_address={address}",
            "trainer.cpus_per_worker=1",
            "trainer.nnodes=2",
            "trainer.n_workers_per_node=1",
            f"trainer.total_steps={STEPS}",
            "trainer.checkpoint.every=1",
            "algorithm.kl.use_kl_loss=true",
            f"reward.custom_path={reward}",
            *extra,
        )

    with simulated_cluster(head={"num_cpus": 1}, nodes=[{"num_cpus": 1}]) as cluster:
        reference = tmp_path / "reference"
        run_training(load_config(overrides(reference, cluster.address)))

        out = tmp_path / "interrupted"
        worker_node = cluster.list_all_nodes()[1]
        killed_at: list[float] = []

        def kill_after_two_steps() -> None:
            deadline = time.monotonic() + 300
            # after step 2's checkpoint is committed: its metrics row is written first (the step-end
            # hooks' order), so a kill on the row alone may land mid-save and resume from step 1
            while _saved_step(out) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            killed_at.append(time.monotonic())
            cluster.remove_node(worker_node, allow_graceful=False)  # its raylet and workers go at once

        killer = threading.Thread(target=kill_after_two_steps, daemon=True)
        killer.start()
        code, _ = execute(load_config(overrides(out, cluster.address)), "verity train")
        stopped_at = time.monotonic()
        killer.join(timeout=10)
        err = capsys.readouterr().err
        assert code == 1, err
        assert killed_at and stopped_at - killed_at[0] < 60, "the run did not stop within 60 s of the node's death"
        assert "WorkerDiedError" in err and "rank 1 died on node" in err, err
        assert worker_node.node_id[:8] in err  # the node that was lost, by its id
        assert "Traceback" not in err
        done = len(_rows(out))
        assert 2 <= done < STEPS

        cluster.add_node(num_cpus=1)  # the same shape again: a new second node
        cluster.wait_for_nodes()
        summary = run_training(load_config(overrides(out, cluster.address)))

    assert summary["resumed_from_step"] >= 2
    got, want = _rows(out), _rows(reference)
    assert [r["train/step"] for r in got] == [float(s) for s in range(1, STEPS + 1)]
    for a, b in zip(got, want, strict=True):
        for key in DETERMINISTIC_KEYS:
            assert a[key] == b[key], (a["train/step"], key, a[key], b[key])
    assert all(r["actor/grad_norm"] > 0 for r in want)
