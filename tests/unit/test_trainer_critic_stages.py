"""Stages for critics and ReMax: stage lists, the greedy baseline, values/update_critic, critic warm-up."""

from __future__ import annotations

import pytest
import torch
from verity.batch import Batch
from verity.config import ConfigError, load_config
from verity.rollout import HFRollout, SamplingParams
from verity.trainer.stages import (
    StepContext,
    advantage,
    default_stages,
    generate,
    generate_baseline,
    needs_critic,
    update_actor,
    update_critic,
    values,
)

VOCAB, P, R, EOS = 50, 4, 5, 1


def names(overrides: list[str]) -> list[str]:
    return [stage.name for stage in default_stages(load_config(overrides))]


def test_stage_lists_follow_the_estimator():
    base = ["generate", "reward", "old_log_prob", "advantage", "update_actor"]
    assert names([]) == base  # grpo
    assert names(["algorithm.advantage.estimator=rloo"]) == base
    assert names(["algorithm.advantage.estimator=gae"]) == [
        "generate",
        "reward",
        "old_log_prob",
        "values",
        "advantage",
        "update_critic",
        "update_actor",
    ]
    assert names(["algorithm.advantage.estimator=gae", "algorithm.kl.use_kl_loss=true"])[3:5] == [
        "ref_log_prob",
        "values",
    ]
    assert names(["algorithm.advantage.estimator=remax"]) == ["generate_baseline", *base]
    assert names(["critic.enabled=true"]) == [
        "generate",
        "reward",
        "old_log_prob",
        "values",
        "advantage",
        "update_critic",
        "update_actor",
    ]
    assert needs_critic(load_config(["algorithm.advantage.estimator=gae"]))
    assert not needs_critic(load_config(["algorithm.advantage.estimator=reinforce_plus_plus"]))


def test_a_critic_switched_off_for_gae_is_a_config_error():
    with pytest.raises(ConfigError, match="needs critic values but critic.enabled=false"):
        load_config(["algorithm.advantage.estimator=gae", "critic.enabled=false"])
    with pytest.raises(ConfigError, match="critic.ppo_mini_batch_size"):
        load_config(["algorithm.advantage.estimator=gae", "critic.ppo_mini_batch_size=5"])
    with pytest.raises(ConfigError, match="critic.loss_agg_mode"):
        load_config(["critic.enabled=true", "critic.loss_agg_mode=mean"])
    load_config(["critic.enabled=false"])  # fine for an estimator without values


class RolloutActor:
    """Stands in for the actor group: ``generate`` as ``ActorRolloutRefWorker.generate`` does it."""

    def __init__(self, model):
        self.rollout = HFRollout(model, pad_token_id=0, eos_token_ids=EOS, seed=123)
        self.outputs: list[Batch] = []
        self.updates: list[Batch] = []

    def generate(self, batch: Batch) -> Batch:
        params = SamplingParams(**batch.meta.get("sampling", {}))
        out = self.rollout.generate(batch, params)
        self.outputs.append(out)
        return out

    def update_actor(self, batch: Batch) -> dict[str, float]:
        self.updates.append(batch)
        return {"actor/optimizer_steps": 1.0}


class LengthRewards:
    """Score = number of response tokens (so the baseline can be checked row by row)."""

    def score(self, batch: Batch):
        return batch["response_mask"].float().sum(-1), {}, {}


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return Qwen2ForCausalLM(cfg).eval()


def prompt_batch() -> Batch:
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    input_ids = torch.randint(2, VOCAB, (3, P), generator=torch.Generator().manual_seed(4)) * prompt_mask
    return Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": prompt_mask,
            "position_ids": (prompt_mask.cumsum(-1) - 1).clamp(min=0),
        },
        non_tensors={"data_source": ["t"] * 3, "ground_truth": ["1", "2", "3"]},
    )


def argmax_decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Reference greedy decode: full forward each step, next token = argmax of the last logits."""
    ids, mask = input_ids.clone(), attention_mask.clone()
    for _ in range(steps):
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return ids[:, input_ids.shape[1] :]


def test_remax_baseline_is_a_real_greedy_rollout_of_each_prompt():
    cfg = load_config(
        [
            "algorithm.advantage.estimator=remax",
            "reward.placement=driver",  # LengthRewards scores on the driver
            "rollout.n=3",
            "rollout.temperature=1.0",
            f"data.max_response_length={R}",
        ]
    )
    model = tiny_model()
    actor = RolloutActor(model)
    ctx = StepContext(cfg, actor, LengthRewards(), None, step=1)
    prompts = generate_baseline(ctx, prompt_batch())
    greedy = actor.outputs[0]
    assert len(greedy) == 3  # one greedy response per prompt, not per sample
    want = argmax_decode(model, prompt_batch()["input_ids"], prompt_batch()["attention_mask"], R)
    for row in range(3):
        length = int(greedy["response_mask"][row].sum())
        assert torch.equal(greedy["responses"][row, :length], want[row, :length]), row
        hit_eos = (want[row, :length] == EOS).any()
        assert length == R or hit_eos
    torch.testing.assert_close(prompts["baseline_scores"], greedy["response_mask"].float().sum(-1))
    # a second greedy rollout with another seed gives the same responses (no sampling involved)
    actor.rollout.set_seed(999)
    generate_baseline(ctx, prompt_batch())
    assert torch.equal(actor.outputs[1]["responses"], greedy["responses"])

    rows = generate(ctx, prompts)  # sampled, n=3 per prompt; the baseline follows each prompt
    assert torch.equal(rows["baseline_scores"], prompts["baseline_scores"].repeat_interleave(3))
    rows["token_rewards"] = torch.zeros_like(rows["response_mask"], dtype=torch.float32)
    rows["token_rewards"][:, 0] = torch.arange(9, dtype=torch.float32)  # sequence scores 0..8
    rows = advantage(ctx, rows)
    expected = torch.arange(9, dtype=torch.float32) - rows["baseline_scores"]
    mask = rows["response_mask"].float()
    torch.testing.assert_close(rows["advantages"], expected[:, None] * mask)


class FakeCritic:
    def __init__(self):
        self.calls: list[tuple[str, Batch]] = []

    def compute_values(self, batch: Batch) -> Batch:
        self.calls.append(("compute_values", batch))
        return Batch.from_dict({"values": torch.full(batch["responses"].shape, 0.5)})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        self.calls.append(("update_critic", batch))
        return {"critic/value_loss": 0.25}


def rl_rows() -> Batch:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ids = torch.tensor([[0, 7, 8, 9, 3, 2, 0], [6, 7, 8, 4, 2, 0, 0]])
    attention = torch.cat([torch.tensor([[0, 1, 1], [1, 1, 1]]), mask], 1)
    return Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, 3:],
            "response_mask": mask,
            "old_logprobs": torch.zeros(2, 4),
            "token_rewards": torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
            "group": torch.tensor([0, 1]),
            "scores": torch.tensor([1.0, 0.0]),
        }
    )


def test_values_gae_and_critic_update_stages():
    cfg = load_config(
        [
            "algorithm.advantage.estimator=gae",
            "algorithm.advantage.gae_whiten=false",
            "algorithm.advantage.lam=1.0",
            "critic.warmup_steps=1",
        ]
    )
    critic, actor = FakeCritic(), RolloutActor(tiny_model())
    ctx = StepContext(cfg, actor, None, None, step=1, critic=critic)
    batch = values(ctx, rl_rows())
    assert set(critic.calls[0][1].keys()) == {"input_ids", "attention_mask", "position_ids", "responses"}
    batch = advantage(ctx, batch)
    # gamma = lambda = 1, V = 0.5: A_t = (sum of rewards from t) - V_t; returns = A + V
    mask = batch["response_mask"].float()
    want_adv = torch.tensor([[0.5, 0.5, 0.5, 0.0], [-0.5, -0.5, 0.0, 0.0]])
    torch.testing.assert_close(batch["advantages"], want_adv)
    torch.testing.assert_close(batch["returns"], (want_adv + 0.5) * mask)
    batch = update_critic(ctx, batch)
    sent = critic.calls[1][1]
    assert set(sent.keys()) == {
        "input_ids",
        "attention_mask",
        "position_ids",
        "responses",
        "response_mask",
        "values",
        "returns",
    }
    assert ctx.metrics["critic/value_loss"] == 0.25
    update_actor(ctx, batch)  # step 1 <= critic.warmup_steps: the actor waits
    assert actor.updates == [] and ctx.metrics["actor/optimizer_steps"] == 0.0
    ctx.step = 2
    update_actor(ctx, batch)
    assert len(actor.updates) == 1


def test_critic_stages_without_a_critic_say_so():
    ctx = StepContext(load_config(["algorithm.advantage.estimator=gae"]), None, None, None, step=1)
    with pytest.raises(RuntimeError, match="critic"):
        values(ctx, rl_rows())
    with pytest.raises(RuntimeError, match="critic"):
        update_critic(ctx, rl_rows())
