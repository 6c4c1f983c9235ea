"""GRPO on a tiny Qwen3-MoE with ``actor.engine=megatron`` at EP=2 (gloo), HF rollout.

A real `verity train` process, 3 steps on 2 Ray workers: each worker holds 4 of the 8 experts of
every layer, tokens cross between the two by all-to-all, the rollout gets the experts gathered
back after every update; the actor adds the router losses and replays the rollout's routes. The dense digit reward makes every step move the weights. Then EP=2 x
DP=2 on a simulated 2-node cluster (2 workers a node): each EP group is placed on one node.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from helpers.dense_reward import DIGIT_REWARD  # noqa: E402
from test_checkpoint_resume import rows, train  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 3


@pytest.fixture(scope="module")
def moe_paths(tiny_model_and_task, tmp_path_factory) -> dict[str, str]:
    """The tiny task's files, a tiny Qwen3-MoE (8 experts, top-2) with its character tokenizer, a reward."""
    import torch
    from helpers.tiny_models import tiny_moe_config
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_and_task["model"])
    config = tiny_moe_config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model_dir = tmp_path_factory.mktemp("tiny_moe")
    Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    reward = tmp_path_factory.mktemp("reward") / "digits.py"
    reward.write_text(DIGIT_REWARD)
    return {**tiny_model_and_task, "model": str(model_dir), "reward": str(reward)}


def moe_args(paths: dict[str, str], out: Path, *extra: str) -> list[str]:
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
        "actor.megatron.expert_parallel_size=2",
        "algorithm.kl.use_kl_loss=true",
        f"reward.custom_path={paths['reward']}",
        f"trainer.total_steps={STEPS}",
        "trainer.n_workers=2",
        "trainer.cpus_per_worker=0.5",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *extra,
    ]


def test_grpo_trains_an_moe_at_ep2(moe_paths, tmp_path):
    out = tmp_path / "run"
    router = ["actor.moe.aux_loss_coef=0.01", "actor.moe.z_loss_coef=0.001", "actor.moe.routing_replay=true"]
    done = train(moe_args(moe_paths, out, *router))
    assert done.returncode == 0, done.stderr[-3000:]
    history = rows(out / "metrics.jsonl")
    assert len(history) == STEPS
    assert all(r["actor/grad_norm"] > 0 for r in history)
    assert len({r["actor/loss"] for r in history}) == STEPS
    for r in history:  # the router terms of the Megatron forward, the rollout's routes replayed
        assert 1.0 <= r["moe/expert_load_max_over_mean"] <= r["moe/expert_load_max_over_mean_max"] <= 4.0
        assert r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0 and r["moe/router_entropy"] > 0
        # before the update the float32 trainer computes what the float32 sampler did (the log-probs
        # recomputed with the rollout's routes equal the sampler's to rounding)
        assert r["actor/rollout_logprob_gap"] < 1e-3
        # the replayed routes reached the update. The agreement is read over both mini-batches of the
        # step: the second runs after an optimizer step (lr 1e-3) has moved this randomly initialised,
        # nearly uniform router (entropy ~ log 8), so part of its own routes differ from the replayed ones
        assert 0.5 < r["moe/replay_route_agreement"] <= 1.0
    summary = json.loads((out / "summary.json").read_text())
    ran = summary["ran"]
    assert ran["actor"] == "megatron" and ran["actor_model_parallel_nodes"] == "1"
    assert ran["actor_moe_layers"] == "2" and ran["actor_routing_replay"] == "true"


def test_ep2_x_dp2_on_two_nodes_keeps_each_expert_group_on_a_node(moe_paths, tmp_path):
    from helpers.sim_cluster import simulated_cluster
    from verity.config import load_config
    from verity.launch.run import run_training

    with simulated_cluster(head={"num_cpus": 2}, nodes=[{"num_cpus": 2}]) as cluster:
        args = moe_args(moe_paths, tmp_path / "run", f"trainer.ray_address={cluster.address}")
        args = [a for a in args if not a.startswith(("trainer.n_workers=", "trainer.total_steps="))]
        args += [
            "trainer.n_workers=4",
            "trainer.nnodes=2",
            "trainer.cpus_per_worker=1",
            "trainer.total_steps=2",
        ]
        summary = run_training(load_config(args))
    ran = summary["ran"]
    spans = ran["placement.actor"].split(",")
    assert [span.rsplit(":", 1)[1] for span in spans] == ["0-1", "2-3"]  # ranks node by node
    assert len({span.rsplit(":", 1)[0] for span in spans}) == 2
    # each rank all-gathered its EP group's NODE_RANKs: one node per group (rank 0's answer)
    assert ran["actor"] == "megatron" and ran["actor_model_parallel_nodes"] == "1"
