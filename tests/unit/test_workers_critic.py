"""The critic: value model from an actor checkpoint, values at P-1..P+R-2, value loss, updates (one process)."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import VOCAB, P, R, tiny_qwen2
from verity.algorithms.configs import ValueLossConfig
from verity.batch import Batch
from verity.config import load_config
from verity.engines import FSDP2Engine, OptimConfig
from verity.workers.critic import CriticWorker, load_value_model, make_value_loss

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny Qwen2 causal LM (the actor checkpoint) and the module itself."""
    model = tiny_qwen2(seed=0).eval()
    path = tmp_path_factory.mktemp("actor") / "ckpt"
    model.save_pretrained(path)
    return str(path), model


def make_batch(rows: int = 7, seed: int = 1) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses of varying length, old values and returns."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, P + 1, (rows,), generator=g)
    response_lens = torch.randint(1, R + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(P) >= P - prompt_lens[:, None]).long()
    response_mask = (torch.arange(R) < response_lens[:, None]).long()
    prompts = torch.randint(1, VOCAB, (rows, P), generator=g) * prompt_mask
    responses = torch.randint(1, VOCAB, (rows, R), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask.float(),
        "values": 0.8 * torch.randn(rows, R, generator=g),
        "returns": torch.randn(rows, R, generator=g),
    }


def test_value_model_keeps_the_backbone_and_starts_at_zero(checkpoint):
    path, causal = checkpoint
    critic = load_value_model(path)
    assert critic.score.out_features == 1 and critic.dropout.p == 0.0
    assert torch.count_nonzero(critic.score.weight) == 0 and torch.count_nonzero(critic.score.bias) == 0
    for name, param in causal.model.named_parameters():
        torch.testing.assert_close(dict(critic.model.named_parameters())[name], param, msg=name)
    values = FSDP2Engine(critic, None).compute_values(make_batch(), micro_batch_size=3)
    assert values.shape == (7, R) and values.dtype == torch.float32
    assert torch.count_nonzero(values) == 0


def test_values_are_read_at_positions_p_minus_1_to_p_plus_r_minus_2(checkpoint):
    path, causal = checkpoint
    critic = load_value_model(path)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        critic.score.weight.copy_(torch.randn(1, 64, generator=g))
        critic.score.bias.fill_(0.25)
    batch = make_batch()
    engine = FSDP2Engine(critic, None)
    v1 = engine.compute_values(batch, micro_batch_size=1)
    v4 = engine.compute_values(batch, micro_batch_size=4)
    with torch.no_grad():
        hidden = causal.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).last_hidden_state  # [B, P+R, H] of the same backbone
        by_position = hidden @ critic.score.weight[0] + 0.25  # [B, P+R]
    # response token j (input position P+j) takes the value of position P-1+j; padding reads 0
    real = batch["attention_mask"][:, P:].float()
    torch.testing.assert_close(v1, by_position[:, P - 1 : P + R - 1] * real, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(v4, v1, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(v1, by_position[:, P : P + R] * real)  # not the positions of the tokens themselves


def hand_value_loss(batch: dict[str, torch.Tensor], values: torch.Tensor, clip: float) -> float:
    """0.5 * token-mean over the mask of max((V-G)^2, (V_old + clip(V-V_old, -c, c) - G)^2)."""
    old, ret, mask = batch["values"], batch["returns"], batch["response_mask"]
    clipped = old + torch.clamp(values - old, -clip, clip)
    per_token = torch.maximum((values - ret) ** 2, (clipped - ret) ** 2)
    return float(0.5 * (per_token * mask).sum() / mask.sum())


def test_value_loss_through_the_engine_matches_a_hand_computation(checkpoint):
    path, _ = checkpoint
    engine = FSDP2Engine(load_value_model(path), OptimConfig(lr=1e-2))
    batch = make_batch()
    loss_fn = make_value_loss(ValueLossConfig(cliprange_value=0.5, loss_agg_mode="token-mean"))
    out = engine.forward_backward_values(batch, loss_fn, micro_batch_size=3)
    engine.optimizer.zero_grad(set_to_none=True)
    # the head is zero, so the current values are 0 everywhere
    assert out["loss"] == pytest.approx(hand_value_loss(batch, torch.zeros(7, R), 0.5), rel=1e-5)
    assert out["critic/vpred_mean"] == 0.0
    assert 0.0 < out["critic/vf_clip_frac"] < 1.0  # some old values are further than 0.5 from 0


@pytest.mark.parametrize("mode", MODES)
def test_critic_gradient_does_not_depend_on_micro_batch_size(checkpoint, mode):
    path, _ = checkpoint
    model = load_value_model(path)
    with torch.no_grad():  # a non-zero head, so the backbone gets gradient too
        model.score.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    engine = FSDP2Engine(model, OptimConfig(lr=1e-2))
    loss_fn = make_value_loss(ValueLossConfig(cliprange_value=0.2, loss_agg_mode=mode))
    batch = make_batch()
    grads = {}
    for mbs in (1, 4, 7):
        engine.forward_backward_values(batch, loss_fn, mbs)
        grads[mbs] = engine.full_gradients()
        engine.optimizer.zero_grad(set_to_none=True)
    assert grads[1]["model.layers.0.mlp.up_proj.weight"].abs().max() > 1e-5
    for mbs in (4, 7):
        for name, grad in grads[1].items():
            scale = float(grad.abs().max())  # float32 summation-order noise grows with the magnitude
            torch.testing.assert_close(grads[mbs][name], grad, rtol=1e-4, atol=1e-6 * max(scale, 1.0))


def test_critic_worker_update_fits_the_returns(checkpoint):
    path, _ = checkpoint
    cfg = load_config(
        [
            "algorithm.advantage.estimator=gae",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=2",
            "critic.ppo_mini_batch_size=2",
            "critic.ppo_epochs=1",
            "critic.micro_batch_size=4",
            "critic.cliprange_value=null",
            "critic.optim.lr=5e-2",
            "trainer.n_workers=1",
        ]
    )
    worker = CriticWorker(cfg, path)
    worker.engine = FSDP2Engine(load_value_model(path), OptimConfig(lr=5e-2))
    worker.loss_fn = make_value_loss(ValueLossConfig(cliprange_value=None))
    batch = Batch.from_dict(make_batch(rows=8, seed=5))
    batch["returns"] = torch.where(batch["response_mask"] > 0, 1.5, 0.0)  # a target the head can reach
    first = worker.update_critic(batch)
    assert first["critic/optimizer_steps"] == 2.0  # 8 rows / (2 prompts x n=2 rows), 1 epoch
    assert first["critic/value_loss"] > 0.5
    for _ in range(6):
        last = worker.update_critic(batch)
    assert last["critic/value_loss"] < 0.25 * first["critic/value_loss"]
    values = worker.compute_values(batch.select("input_ids", "attention_mask", "position_ids", "responses"))
    mask = batch["response_mask"]
    assert abs(float((values["values"] * mask).sum() / mask.sum()) - 1.5) < 0.5
    with pytest.raises(KeyError, match="returns"):
        worker.update_critic(batch.select("input_ids", "attention_mask", "position_ids", "responses"))


def test_a_checkpoint_that_is_not_a_folder_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="critic model path"):
        load_value_model(str(tmp_path / "missing"))


def test_critic_checkpoint_round_trip(checkpoint, tmp_path):
    path, _ = checkpoint
    cfg = load_config(["algorithm.advantage.estimator=gae", "trainer.n_workers=1"])
    batch = Batch.from_dict(make_batch(rows=4, seed=9))
    loss_fn = make_value_loss(ValueLossConfig(cliprange_value=None))
    a, b = CriticWorker(cfg, path), CriticWorker(cfg, path)
    a.engine = FSDP2Engine(load_value_model(path), OptimConfig(lr=1e-2))
    b.engine = FSDP2Engine(load_value_model(path), OptimConfig(lr=1e-2))
    a.engine.value_train_step(batch, loss_fn, 4)
    a.save_checkpoint(str(tmp_path / "critic"))
    b.load_checkpoint(str(tmp_path / "critic"))
    assert b.engine.global_step == 1
    a.engine.value_train_step(batch, loss_fn, 4)
    b.engine.value_train_step(batch, loss_fn, 4)  # same weights and AdamW moments: same step
    torch.testing.assert_close(b.engine.compute_values(batch, 4), a.engine.compute_values(batch, 4))
