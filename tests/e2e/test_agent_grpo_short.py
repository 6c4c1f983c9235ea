"""A 2-worker RL run with the agent loop: a scripted tool-using policy, misbehaving tools, probes.

The run is an ordinary ``verity train`` with ``rollout.agent.enabled``; the test plug-in
(``helpers.agent_plugin``, loaded in the driver and both workers through
``VERITY_PLUGINS``) adds three things through the seams: the rollout engine ``scripted``
(the policy's tokens come from a script and are teacher-forced through the real model,
so every token's author is known), the training engine ``fsdp2_grad_probe`` (FSDP2 that
records the loss gradient reaching each response position's log-prob and entropy), and a
stage that saves each step's rows. The tools include one that hangs, one that kills its
process, one that returns bytes and one that raises.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from helpers.agent_plugin import TOOL_TEMPLATE, expected_response, scripted_tools

ROWS = [  # (prompt, ground truth): step 1 takes the first four, step 2 the rest (no shuffling)
    ("task:calculator:12*34|", "408"),
    ("task:hang:a|", "-"),
    ("task:crash:b|", "-"),
    ("task:echo:hi|", "-"),
    ("task:calculator:6*7|", "42"),
    ("task:garbage:c|", "-"),
    ("task:fail:d|", "-"),
    ("task:badjson:e|", "-"),
]

# a score of 1 needs the right final answer read from the trajectory's turns (assistant, tool,
# assistant) and the tool's answer in the decoded exchange: the calculator rows score 1 only if the
# reward function received both
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    trajectory = extra_info.get("trajectory")
    if trajectory is None:  # the start-up check calls it once on a row's ground truth, no rollout yet
        return 0.0
    final = [m for m in trajectory["messages"] if m["role"] == "assistant"][-1]["content"]
    read_all = len(trajectory["messages"]) >= 3 and "[" + ground_truth + "]" in solution_str
    return 1.0 if final == "=" + ground_truth and read_all else 0.0
"""


def _write_inputs(root: Path) -> dict[str, str]:
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tasks.arithmetic import write_parquet
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    tokenizer = CharTokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    model = build_tiny_qwen2_for(tokenizer, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rows = [
        {
            "prompt": [{"role": "user", "content": prompt}],
            "data_source": "agent_test",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": i, "tools_kwargs": {"echo": {"create_kwargs": {"row": i}}}},
        }
        for i, (prompt, truth) in enumerate(ROWS)
    ]
    write_parquet(rows, root / "data.parquet")
    (root / "reward.py").write_text(REWARD)
    config = {
        "defaults": ["verity", "_self_"],
        "rollout": {"agent": {"enabled": True, "max_turns": 3, "tools": scripted_tools(hang_timeout_s=2.0)}},
    }
    (root / "agent.yaml").write_text(yaml.safe_dump(config))
    return {
        k: str(root / v) for k, v in [("model", "model"), ("data", "data.parquet"), ("reward", "reward.py")]
    }


@pytest.mark.slow
def test_multi_turn_rl_on_two_workers_trains_only_the_models_tokens(tmp_path, monkeypatch) -> None:
    from transformers import AutoTokenizer
    from verity.config import load_config
    from verity.launch.run import run_training

    tests_dir = str(Path(__file__).resolve().parents[1])
    probes = tmp_path / "probes"
    probes.mkdir()
    # the Ray workers and tool processes import helpers/ (and the same verity as this process)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("VERITY_PLUGINS", "helpers.agent_plugin:register")
    monkeypatch.setenv("VERITY_AGENT_PROBE_DIR", str(probes))
    paths = _write_inputs(tmp_path)
    cfg = load_config(
        [
            f"model.path={paths['model']}",
            f"data.train_files=[{paths['data']}]",
            f"data.val_files=[{paths['data']}]",
            "data.val_max_samples=4",
            "data.shuffle=false",
            "data.train_batch_size=4",
            "data.max_prompt_length=32",
            "data.max_response_length=192",
            "rollout.engine=scripted",
            "rollout.n=2",
            "actor.engine=fsdp2_grad_probe",
            "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size=3",
            "actor.entropy_coeff=0.01",
            "actor.old_logprobs=recompute",  # the trainer's own forward, compared with the rollout's below
            "algorithm.advantage.estimator=reinforce_plus_plus",
            "algorithm.kl.use_kl_loss=true",
            f"reward.custom_path={paths['reward']}",
            "trainer.total_steps=2",
            "trainer.n_workers=2",
            "trainer.cpus_per_worker=0.5",
            "trainer.progress=false",
            "trainer.checkpoint.save_final=false",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        config_file=tmp_path / "agent.yaml",
    )
    summary = run_training(cfg)
    assert summary["ran"].pop("device_name")  # the CPU's model name: machine-dependent
    # where the ranks ran: one node (this machine), each pool on it
    assert summary["ran"].pop("nodes") == "1"
    assert summary["ran"].pop("placement.actor").count(",") == 0
    assert summary["ran"] == {
        "actor": "fsdp2_grad_probe",
        "actor_sharding": "full",
        "actor_compute_dtype": "float32",
        "actor_attention": "verity_packed_sdpa",  # sdpa, rows kept apart in packed passes
        "actor_packed": "true",  # fsdp2.packed: on by default on a CPU
        "actor_vocab_sharded": "true",  # two ranks on a CPU: the vocabulary in row shards by default
        "rollout": "scripted",
        "rollout_dtype": "float32",
        "rollout_attention": "sdpa",  # what the plug-in's own generate runs, not HFRollout's decode
        "rollout_wrappers": "agent",
        "mode": "sync",  # no rollout worker group of its own
        "device": "cpu",
    }
    assert summary["stage_plan"][:4] == ["generate", "agent_metrics", "reward", "old_log_prob"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for step in metrics:
        # the loss gradient never reaches a tool position's log-prob or entropy; it does reach the model's
        assert step["actor/probe/tool_positions"] > 0
        assert step["actor/probe/tool_grad_max"] == 0.0
        assert step["actor/probe/model_grad_max"] > 0.0
        assert step["agent/tool_call_rate"] == 1.0
        assert step["reward/errors"] == 0.0
        # the request-level loop's own measures came back from both workers
        assert step["agent/tool_wait_s_mean"] > 0.0 and step["agent/tool_queue_s_mean"] >= 0.0
        assert 0.0 < step["agent/engine_busy_fraction"] <= 1.0
        assert 1.0 <= step["agent/requests_in_flight_mean"] <= step["agent/requests_in_flight_max"] <= 4.0
    first, second = metrics
    # each misbehaving tool cost one error message per sample (n=2) and was counted
    assert first["agent/tool_errors/timeout"] == 2.0 and first["agent/tool_errors/crash"] == 2.0
    assert second["agent/tool_errors/bad_result"] == 2.0 and second["agent/tool_errors/exception"] == 2.0
    assert second["agent/tool_errors/parse"] == 2.0
    assert first["agent/tool_error_rate"] == 0.5 and second["agent/tool_error_rate"] == 0.75
    # the calculator rows: the reward function read the trajectory and the decoded exchange (REWARD)
    assert first["reward/mean"] == 0.25 and second["reward/mean"] == 0.25
    validation = [
        json.loads(line) for line in (tmp_path / "run" / "validation.jsonl").read_text().splitlines()
    ]
    assert [v["val/agent/tool_call_rate"] for v in validation] == [1.0, 1.0]  # before and after training
    assert [v["val/agent/tool_error_rate"] for v in validation] == [0.5, 0.5]  # the hang and the crash

    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    for step in (1, 2):
        data = torch.load(probes / f"step_{step}.pt", weights_only=False)
        prompts = [p for p, _ in ROWS[(step - 1) * 4 : step * 4] for _ in range(2)]
        width = data["responses"].shape[1]
        for row, trajectory in enumerate(data["trajectory"]):
            tokens, mask = expected_response(tokenizer, "<bos>" + prompts[row], trajectory)
            n = len(tokens)
            assert data["responses"][row, :n].tolist() == tokens
            assert data["response_mask"][row].tolist() == mask + [0] * (width - n)
            assert data["attention_mask"][row, -width:].tolist() == [1] * n + [0] * (width - n)
        model_tokens = data["response_mask"].bool()
        # the trainer's log-probs (FSDP2, 2 ranks) of the model's tokens are the rollout's
        gap = (data["old_logprobs"] - data["rollout_logprobs"])[model_tokens].abs().max()
        assert float(gap) < 1e-5
        assert bool((data["rollout_logprobs"][~model_tokens] == 0).all())
