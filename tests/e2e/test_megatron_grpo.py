"""GRPO with ``actor.engine=megatron`` (TP=2 over 2 Ray workers, gloo) and the HF rollout; kill and resume.

A real `verity train` process on the tiny model: 2 steps uninterrupted, then the same run
SIGKILLed after step 1 (its checkpoint written) and resumed, which must give exactly the
uninterrupted metrics. The dense digit reward makes every step move the weights, so a
resume that lost optimizer moments, the LR schedule, the sampler position or RNG would drift.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from helpers.dense_reward import DIGIT_REWARD  # noqa: E402
from test_checkpoint_resume import assert_same_metrics, latest, rows, train  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 2


def megatron_args(paths: dict[str, str], out: Path, *extra: str) -> list[str]:
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
        "actor.engine=megatron",
        "actor.megatron.tensor_parallel_size=2",
        "algorithm.kl.use_kl_loss=true",
        f"reward.custom_path={paths['reward']}",
        f"trainer.total_steps={STEPS}",
        "trainer.n_workers=2",
        "trainer.cpus_per_worker=0.5",
        "trainer.progress=false",
        "trainer.checkpoint.every=1",
        f"trainer.output_dir={out}",
        *extra,
    ]


@pytest.fixture(scope="module")
def paths(tiny_model_and_task, tmp_path_factory) -> dict[str, str]:
    reward = tmp_path_factory.mktemp("reward") / "digits.py"
    reward.write_text(DIGIT_REWARD)
    return {**tiny_model_and_task, "reward": str(reward)}


@pytest.fixture(scope="module")
def uninterrupted(paths, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("megatron_uninterrupted")
    done = train(megatron_args(paths, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_grpo_trains_with_the_megatron_engine(uninterrupted):
    history = rows(uninterrupted / "metrics.jsonl")
    assert len(history) == STEPS
    assert all(r["actor/grad_norm"] > 0 for r in history)  # the policy really moves
    assert history[0]["actor/loss"] != history[1]["actor/loss"]
    workers = json.loads((uninterrupted / "workers.json").read_text())["actor"]
    assert len(workers) == 2
    meta = json.loads((uninterrupted / "checkpoints" / f"step_{STEPS}" / "actor" / "meta.json").read_text())
    assert meta["engine"] == "MegatronEngine"


def test_killed_megatron_run_resumes_exactly(paths, uninterrupted, tmp_path):
    out = tmp_path / "run"
    args = megatron_args(paths, out)
    first = train(args, VERITY_DEBUG_CRASH_AT="step_end:1")  # SIGKILL after step 1 and its checkpoint
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert latest(out) == "step_1" and len(rows(out / "metrics.jsonl")) == 1
    second = train(args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stderr and "step_1" in second.stderr
    assert_same_metrics(out, uninterrupted, steps=STEPS)


def test_megatron_checkpoint_exports_to_an_hf_folder(paths, uninterrupted, tmp_path):
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "verity.cli.main", "export", str(uninterrupted), str(hf_dir)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(paths["model"]).state_dict()
    assert set(exported) == set(initial)
    changed = [k for k in initial if not torch.equal(exported[k], initial[k])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.norm.weight" in changed
