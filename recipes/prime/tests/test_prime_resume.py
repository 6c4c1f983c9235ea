"""PRIME runs that survive: `verity train` killed mid-run and resumed reproduces the PRM and the actor
step for step; the PRM exports as an HF model; a separate PRM worker group trains too.

Each run is a real `verity train` process with the recipe's plug-in on the tiny untrained model
(FSDP2 over gloo), a dense digit-share reward whose `acc` (more than half digits) splits most
groups, and learning rates high enough that every step moves both models: a resume that lost
any PRM or actor state (weights, AdamW moments, LR schedule, sampler position, RNG) would drift.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 4
RUN_TIMEOUT_S = 600
CONFIG = Path(__file__).resolve().parents[1] / "src" / "verity_recipe_prime" / "configs" / "cpu.yaml"


def run_args(paths: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(CONFIG),
        f"model.path={paths['model']}",
        "model.embedded_sft_steps=null",  # the config's warm-start of the embedded model: not this one
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
        "prm.mini_batch_size=4",
        "prm.micro_batch_size=8",
        "prm.optim.lr=1e-3",
        "prime.filter.accuracy_lower=0.25",
        "prime.filter.accuracy_upper=0.75",
        f"reward.custom_path={paths['reward']}",
        f"trainer.total_steps={STEPS}",
        "trainer.val_every=0",
        "trainer.n_workers=2",
        "trainer.cpus_per_worker=0.5",
        f"trainer.output_dir={out}",
        *extra,
    ]


def train(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("VERITY_DEBUG_")}
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-m", "verity.cli.main", "train", *args],
        env=environment,
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
        if not k.startswith(("timing/", "perf/", "memory/")) and not k.endswith(("_per_s", "_seconds"))
    }


def model_state(out: Path, role: str) -> dict:
    from verity.checkpoint.export import read_model_state

    return read_model_state(out / "checkpoints" / f"step_{STEPS}" / role)


@pytest.fixture(scope="module")
def uninterrupted(prime_tiny_model_and_task, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prime-uninterrupted")
    done = train(run_args(prime_tiny_model_and_task, out, "trainer.checkpoint.every=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    history = rows(out / "metrics.jsonl")
    assert len(history) == STEPS
    trained = [r for r in history if "prm/loss" in r]
    assert len(trained) >= 3, [r.get("prime/kept_share") for r in history]  # the filter keeps groups
    assert all(r["prm/grad_norm"] > 0 and r["actor/grad_norm"] > 0 for r in trained)  # both models move
    assert len({round(r["prm/loss"], 9) for r in trained}) == len(trained)
    return out


def test_killed_and_resumed_run_reproduces_the_prm_and_the_actor_step_for_step(
    prime_tiny_model_and_task, uninterrupted, tmp_path
) -> None:
    import torch

    out = tmp_path / "run"
    args = run_args(prime_tiny_model_and_task, out, "trainer.checkpoint.every=2")
    first = train(args, VERITY_DEBUG_CRASH_AT="step_end:3")  # SIGKILL after step 3; checkpoint at 2
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert (out / "checkpoints" / "step_2" / "prm").is_dir()  # the PRM is in every checkpoint
    second = train(args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stderr and "step_2" in second.stderr

    got, want = rows(out / "metrics.jsonl"), rows(uninterrupted / "metrics.jsonl")
    assert [r["train/step"] for r in got] == [float(s) for s in range(1, STEPS + 1)]
    for a, b in zip(got, want, strict=True):
        assert deterministic(a) == deterministic(b), a["train/step"]  # prm/*, actor/*, prime/* alike
    for role in ("prm", "actor"):
        resumed, straight = model_state(out, role), model_state(uninterrupted, role)
        assert set(resumed) == set(straight)
        for name, tensor in straight.items():
            assert torch.equal(resumed[name], tensor), (role, name)


def test_the_prm_exports_as_an_hf_causal_lm_that_moved(
    prime_tiny_model_and_task, uninterrupted, tmp_path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "verity.cli.main",
            "export",
            str(uninterrupted),
            str(tmp_path / "prm"),
            "--role",
            "prm",
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    prm = AutoModelForCausalLM.from_pretrained(tmp_path / "prm")
    start = AutoModelForCausalLM.from_pretrained(prime_tiny_model_and_task["model"])
    saved = model_state(uninterrupted, "prm")
    assert any(not torch.equal(t, start.state_dict()[k]) for k, t in prm.state_dict().items())
    for name, tensor in prm.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name


def test_a_separate_prm_worker_group_trains_beside_the_actor(prime_tiny_model_and_task, tmp_path) -> None:
    out = tmp_path / "separate"
    args = run_args(
        prime_tiny_model_and_task,
        out,
        "trainer.n_workers=1",
        "prm.placement=separate",
        "prm.n_workers=1",
        "trainer.total_steps=2",
        "trainer.checkpoint.save_final=false",
    )
    done = train(args)
    assert done.returncode == 0, done.stderr[-3000:]
    workers = json.loads((out / "workers.json").read_text())
    assert set(workers) == {"actor", "prm"}  # two groups, each in its own process
    assert workers["actor"][0]["pid"] != workers["prm"][0]["pid"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ran"].pop("device_name")  # the CPU's model name: machine-dependent
    # where the ranks ran: one node (this machine), each pool on it
    assert summary["ran"].pop("nodes") == "1"
    assert summary["ran"].pop("placement.actor").count(",") == 0
    assert summary["ran"].pop("placement.prm").count(",") == 0
    assert summary["ran"] == {
        "actor": "fsdp2",
        "actor_sharding": "full",
        "actor_compute_dtype": "float32",
        "actor_attention": "verity_packed_sdpa",  # sdpa, rows kept apart in packed passes
        "actor_packed": "true",  # fsdp2.packed: on by default on a CPU
        "actor_weights_loaded": "streamed",  # built empty, each rank given its shard of the folder
        "rollout": "hf",
        "rollout_dtype": "float32",
        "rollout_attention": "verity_sdpa_gqa",  # grouped key/value heads read in place on CPU
        "prm": "fsdp2",
        "prm_sharding": "full",
        "prm_compute_dtype": "float32",
        "prm_attention": "verity_packed_sdpa",  # sdpa, rows kept apart in packed passes
        "prm_packed": "true",  # fsdp2.packed: on by default on a CPU
        "prm_weights_loaded": "streamed",
        "mode": "sync",  # no rollout worker group of its own
        "device": "cpu",
    }
    assert any("prm/loss" in r for r in rows(out / "metrics.jsonl"))
