"""trainer.mode=async end to end: it trains with staleness 1, survives kill -> resume exactly, and a dead
rollout worker stops the run naming the role and rank.

Each run is a real `verity train` process on the tiny model: one actor worker and one rollout worker
(their own Ray actors), FSDP2 over gloo, a dense reward (share of digits) so every step moves the weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 3
RUN_TIMEOUT_S = 400
DIGIT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Share of digit characters in the response: dense, so every sample moves the policy."""
    return sum(ch.isdigit() for ch in solution_str) / max(1, len(solution_str))
'''


def run_args(paths: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [
        f"model.path={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['test']}]",
        "data.train_batch_size=8",
        "data.max_prompt_length=32",
        "data.max_response_length=6",
        "data.val_max_samples=16",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=8",
        "actor.optim.lr=1e-3",
        "actor.off_policy.is_cap=2.0",
        f"reward.custom_path={paths['reward']}",
        f"trainer.total_steps={STEPS}",
        "trainer.mode=async",
        "trainer.n_workers=1",
        "rollout.n_workers=1",
        "trainer.cpus_per_worker=0.5",
        "trainer.progress=false",
        "trainer.checkpoint.every=1",
        f"trainer.output_dir={out}",
        *extra,
    ]


def train(args: list[str], **env: str) -> subprocess.CompletedProcess:
    import os

    environ = {k: v for k, v in os.environ.items() if not k.startswith("VERITY_DEBUG_")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "verity.cli.main", "train", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def rows(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def deterministic(row: dict[str, float]) -> dict[str, float]:
    """The metrics that must repeat exactly (not wall-clock timings or throughputs)."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(("timing/", "perf/", "memory/")) and not k.endswith(("_per_s", "_seconds", "_wait_s"))
    }


@pytest.fixture(scope="module")
def paths(tiny_model_and_task, tmp_path_factory) -> dict[str, str]:
    reward = tmp_path_factory.mktemp("reward") / "digits.py"
    reward.write_text(DIGIT_REWARD)
    return {**tiny_model_and_task, "reward": str(reward)}


@pytest.fixture(scope="module")
def uninterrupted(paths, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("async_uninterrupted")
    done = train(run_args(paths, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_async_run_trains_one_step_off_policy(uninterrupted) -> None:
    history = rows(uninterrupted / "metrics.jsonl")
    assert [r["train/step"] for r in history] == [1.0, 2.0, 3.0]
    # step 1 trains the batch of the starting weights; every later one a batch one update old
    assert [r["async/staleness_max"] for r in history] == [0.0, 1.0, 1.0]
    assert [r["async/staleness_mean"] for r in history] == [0.0, 1.0, 1.0]
    assert [r["async/rollout_version"] for r in history] == [1.0, 2.0, 3.0]
    for r in history:
        assert r["async/weight_sync_bytes"] > 100_000  # the tiny model's float32 weights
        assert r["async/weight_sync_seconds"] > 0
        assert r["actor/optimizer_steps"] == 2.0
        assert 0.0 < r["actor/is_weight_mean"] <= 2.0
    # the rollout is not the trainer's process: a stale batch differs from what the trainer would sample
    assert any(r["actor/behaviour_logprob_gap"] > 0 for r in history[1:])
    # the sampler-vs-trainer gap before the update: step 1 samples and recomputes with the starting weights
    # (float32 on both sides), every later step's batch is one update older than the trainer
    gaps = [r["actor/rollout_logprob_gap"] for r in history]
    assert gaps[0] < 1e-4 and all(gap > 10 * gaps[0] for gap in gaps[1:]), gaps
    summary = json.loads((uninterrupted / "summary.json").read_text())
    assert summary["stage_plan"][0] == "generate" and summary["stage_plan"][-1] == "rollout_sync"
    workers = json.loads((uninterrupted / "workers.json").read_text())
    assert set(workers) >= {"actor", "rollout"}
    assert workers["actor"][0]["pid"] != workers["rollout"][0]["pid"]


def test_async_kill_and_resume_reproduces_the_run(paths, uninterrupted, tmp_path) -> None:
    out = tmp_path / "killed"
    crashed = train(run_args(paths, out), VERITY_DEBUG_CRASH_AT="step_end:2")
    assert crashed.returncode != 0
    assert (out / "checkpoints" / "step_2" / "rollout" / "in_flight.pt").is_file()  # step 3's batch
    resumed = train(run_args(paths, out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = rows(out / "metrics.jsonl"), rows(uninterrupted / "metrics.jsonl")
    assert [r["train/step"] for r in got] == [1.0, 2.0, 3.0]
    for a, b in zip(got, want, strict=True):
        assert deterministic(a) == deterministic(b), a["train/step"]
    assert rows(out / "validation.jsonl") == rows(uninterrupted / "validation.jsonl")


def test_a_dead_rollout_worker_stops_the_run_naming_it(paths, tmp_path) -> None:
    import os
    import signal

    out = tmp_path / "dead"
    args = run_args(paths, out, "trainer.checkpoint.every=0", "trainer.val_before_train=false")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VERITY_DEBUG_")}
    environ["VERITY_DEBUG_STALL"] = "generate:3:120"  # the rollout holds step 3's batch (generated in step 2)
    process = subprocess.Popen(
        [sys.executable, "-m", "verity.cli.main", "train", *args],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first step never finished"
            time.sleep(0.1)
        pid = json.loads((out / "workers.json").read_text())["rollout"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
        stopped_in = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    assert "rollout" in stderr and "rank 0" in stderr, stderr[-3000:]
    assert stopped_in < 30, stopped_in
