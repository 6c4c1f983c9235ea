"""`verity train` with LoRA adapters (actor.lora.rank=4) on the tiny model, 2 Ray workers:

- killed after step 3 and resumed from its step-2 checkpoint (adapters + their optimizer state only),
  it reproduces every metric of the uninterrupted run;
- the merged export generates, greedily, exactly what the trainer's rollout generates from that
  checkpoint (loaded by one worker although two wrote it); the --adapter export loads with peft;
- with a critic (GAE): the critic stays a full model beside the LoRA actor.

The KL loss is on, so the reference log-probs come from the actor with its adapters disabled.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.dense_reward import DIGIT_REWARD
from test_checkpoint_resume import (
    RUN_TIMEOUT_S,
    STEPS,
    assert_same_run,
    latest,
    rows,
    run_args,
    train,
)

pytestmark = pytest.mark.slow

LORA_ARGS = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=1e-2"]


def lora_args(paths: dict[str, str], out: Path, *extra: str) -> list[str]:
    return run_args(paths, out, *LORA_ARGS, *extra)


@pytest.fixture(scope="module")
def paths(tiny_model_and_task, tmp_path_factory) -> dict[str, str]:
    reward = tmp_path_factory.mktemp("reward") / "digits.py"
    reward.write_text(DIGIT_REWARD)
    return {**tiny_model_and_task, "reward": str(reward)}


@pytest.fixture(scope="module")
def uninterrupted(paths, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora-uninterrupted")
    done = train(lora_args(paths, out, "trainer.checkpoint.every=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    history = rows(out / "metrics.jsonl")
    assert len(history) == STEPS and len({round(r["actor/loss"], 9) for r in history}) == STEPS
    assert (
        history[-1]["actor/kl_loss"] > 0
    )  # the adapters moved the policy away from the base (the reference)
    return out


def test_lora_run_records_the_adapter_and_checkpoints_only_adapters(uninterrupted: Path) -> None:
    from verity.checkpoint.export import read_model_state

    summary = json.loads((uninterrupted / "summary.json").read_text())
    assert summary["ran"]["actor"] == "fsdp2"
    assert summary["ran"]["actor_adapter"] == "lora(rank=4, alpha=8, targets=all-linear)"
    assert summary["ran"]["actor_weights_loaded"] == "streamed"  # 2 workers: each read its shard of the base
    saved = read_model_state(uninterrupted / "checkpoints" / f"step_{STEPS}" / "actor")
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved)


def test_lora_run_killed_and_resumed_reproduces_the_uninterrupted_run(paths, uninterrupted, tmp_path) -> None:
    out = tmp_path / "run"
    args = lora_args(paths, out, "trainer.checkpoint.every=2")
    first = train(args, VERITY_DEBUG_CRASH_AT="step_end:3")  # SIGKILL after step 3 (checkpoint at 2)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert latest(out) == "step_2" and len(rows(out / "metrics.jsonl")) == 3
    second = train(args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stderr and "step_2" in second.stderr
    assert_same_run(out, uninterrupted)


def test_lora_exports_generate_like_the_trainer_rollout(paths, uninterrupted, tmp_path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verity.config import load_config
    from verity.controller import ResourcePool, WorkerGroup, init_ray, shutdown_ray
    from verity.data.prompt_loader import PromptDataLoader
    from verity.data.verl_dataset import PromptDataset
    from verity.workers.actor_rollout import ActorRolloutRefWorker

    def export(*extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "verity.cli.main", "export", str(uninterrupted), *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    for done in (export(str(merged_dir)), export(str(adapter_dir), "--adapter")):
        assert done.returncode == 0, done.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    base = AutoModelForCausalLM.from_pretrained(paths["model"])
    assert any(not torch.equal(t, base.state_dict()[k]) for k, t in model.state_dict().items())

    prompts = PromptDataLoader(
        PromptDataset([paths["test"]], tokenizer, max_prompt_length=32), 16, shuffle=False
    ).next_batch()
    prompts.meta["sampling"] = {"do_sample": False, "temperature": 0.0, "max_new_tokens": 6, "n": 1}
    cfg = load_config(lora_args(paths, tmp_path / "unused", "trainer.n_workers=1"))
    init_ray(num_cpus=2)
    pool = ResourcePool([1], cpus_per_bundle=0.5, name="lora-export-check")
    try:
        group = WorkerGroup(pool, ActorRolloutRefWorker, cfg, paths["model"], paths["model"], name="actor")
        report = group.init_model()[0]
        assert report.reference_engine == "adapters-disabled" and report.n_trainable_params < report.n_params
        info = group.load_checkpoint(str(uninterrupted / "checkpoints" / f"step_{STEPS}" / "actor"))
        assert info[0]["saved_world_size"] == 2
        rollout = group.generate(prompts)
        responses = rollout["responses"]  # read while the workers that hold them are up
        group.shutdown()
    finally:
        pool.remove()
        shutdown_ray()

    width = prompts["input_ids"].shape[1]
    mask = rollout["response_mask"]
    assert mask.sum() > 0
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    for generator in (model, peft_model):
        with torch.no_grad():
            generated = generator.generate(
                input_ids=prompts["input_ids"],
                attention_mask=prompts["attention_mask"],
                do_sample=False,
                max_new_tokens=6,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )[:, width:]
        for i in range(len(prompts)):
            n = int(mask[i].sum())
            assert generated[i, :n].tolist() == responses[i, :n].tolist(), (
                type(generator).__name__,
                i,
            )


def test_lora_actor_beside_a_full_critic(paths, tmp_path) -> None:
    from verity.config import load_config
    from verity.launch.run import run_training

    out = tmp_path / "gae"
    extra = ["algorithm.advantage.estimator=gae", "critic.ppo_mini_batch_size=8", "trainer.total_steps=2"]
    summary = run_training(load_config(lora_args(paths, out, *extra)))
    assert summary["steps"] == 2 and summary["ran"]["actor_adapter"].startswith("lora(rank=4")
    last = rows(out / "metrics.jsonl")[-1]
    assert last["critic/optimizer_steps"] == 1.0 and last["critic/grad_norm"] > 0
    assert last["actor/grad_norm"] > 0
    checkpoint = out / "checkpoints" / "step_2"
    assert "adapter" in json.loads((checkpoint / "actor" / "meta.json").read_text())
    assert "adapter" not in json.loads((checkpoint / "critic" / "meta.json").read_text())
