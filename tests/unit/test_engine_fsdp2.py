"""FSDP2Engine in a single process (no process group): log-probs, train step, contracts."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import P, R, make_padded_batch, seq_mean_token_mean_loss, tiny_qwen2
from verity.engines import EngineBuildContext, FSDP2Engine, OptimConfig, build_training_engine
from verity.registry import UnknownNameError


def token_mean_loss(mb, logprobs, entropy, agg):
    """-(sum over tokens of logprob * advantage) / global_tokens."""
    from verity.algorithms import AggregationContext

    assert isinstance(agg, AggregationContext)
    mask = mb["response_mask"]
    loss = -(logprobs * mb["advantages"] * mask).sum() / agg.global_tokens
    return loss, {"micro_rows": float(mask.shape[0])}


def grads_after_backward(engine, batch, loss_fn, mbs):
    engine.forward_backward(batch, loss_fn, mbs)
    grads = engine.full_gradients()
    engine.optimizer.zero_grad(set_to_none=True)
    return grads


@pytest.fixture(scope="module")
def engine():
    return FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2, grad_clip=1.0))


def test_compute_logprobs_matches_direct_forward_for_any_micro_batch(engine):
    batch = make_padded_batch()
    lp1, ent1 = engine.compute_logprobs(batch, micro_batch_size=1, temperature=0.9)
    lp4, ent4 = engine.compute_logprobs(batch, micro_batch_size=4, temperature=0.9)
    with torch.no_grad():
        logits = (
            engine.model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            ).logits[:, P - 1 : P + R - 1]
            / 0.9
        )
    ref = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    ref = ref * batch["attention_mask"][:, P:]  # response padding reads 0
    assert lp1.shape == (7, R) and ent1.shape == (7, R) and lp1.dtype == torch.float32
    assert torch.allclose(lp1, ref, atol=1e-5)
    assert torch.allclose(lp4, lp1, atol=1e-5) and torch.allclose(ent4, ent1, atol=1e-5)


@pytest.mark.parametrize("loss_fn", [token_mean_loss, seq_mean_token_mean_loss])
def test_gradient_is_independent_of_micro_batch_size(engine, loss_fn):
    batch = make_padded_batch()
    g1 = grads_after_backward(engine, batch, loss_fn, 1)
    g4 = grads_after_backward(engine, batch, loss_fn, 4)
    g7 = grads_after_backward(engine, batch, loss_fn, 7)
    assert set(g1) == set(g4) and len(g1) > 10
    assert any(g.abs().max() > 1e-4 for g in g1.values())
    for name in g1:
        torch.testing.assert_close(g4[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(g7[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)


def test_padding_rows_with_empty_mask_change_nothing(engine):
    batch = make_padded_batch()
    padded = {k: torch.cat([v, v[:1]]) for k, v in batch.items()}
    padded["response_mask"][-1] = 0
    g_ref = grads_after_backward(engine, batch, seq_mean_token_mean_loss, 2)
    g_pad = grads_after_backward(engine, padded, seq_mean_token_mean_loss, 2)
    for name in g_ref:
        torch.testing.assert_close(g_pad[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_split_padding_rows_of_a_batch_are_skipped(engine):
    from verity.batch import Batch

    batch = make_padded_batch()
    padded = Batch.from_dict(batch).split(2)[1]  # rows 4, 5, 6 and a copy of row 0
    assert padded.pad_rows == 1
    real = {k: v[4:] for k, v in batch.items()}
    for loss_fn in (token_mean_loss, seq_mean_token_mean_loss):
        g_ref = grads_after_backward(engine, real, loss_fn, 2)
        g_pad = grads_after_backward(engine, padded, loss_fn, 2)
        for name in g_ref:
            torch.testing.assert_close(g_pad[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    lp, _ = engine.compute_logprobs(padded, 3)
    assert lp.shape == (4, R)  # log-probs cover every row; Batch.concat drops the padding


def test_train_step_metrics_and_learning():
    eng = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2, warmup_steps=2))
    batch = make_padded_batch()
    batch["advantages"] = torch.ones_like(batch["advantages"])  # push logprobs of the responses up
    before = eng.compute_logprobs(batch, 4)[0]
    first = eng.train_step(batch, token_mean_loss, micro_batch_size=3)
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "tokens",
        "response_tokens",
        "tokens_per_s",
        "entropy",
        "micro_rows",
    ):
        assert key in first, key
    assert first["lr"] == pytest.approx(5e-3)  # warm-up step 1 of 2
    assert first["response_tokens"] == pytest.approx(float(batch["response_mask"].sum()))
    assert first["tokens"] == pytest.approx(float(batch["attention_mask"].sum()))
    assert first["micro_rows"] == pytest.approx(7 / 3)  # rows 3, 3, 1 averaged over micro-batches
    mask = batch["response_mask"]
    assert first["loss"] == pytest.approx(float(-(before * mask).sum() / mask.sum()), rel=1e-4)
    for _ in range(3):
        last = eng.train_step(batch, token_mean_loss, micro_batch_size=3)
    assert last["lr"] == pytest.approx(1e-2)
    assert eng.global_step == 4
    after = eng.compute_logprobs(batch, 4)[0]
    assert (after * mask).sum() > (before * mask).sum() + 1.0


def test_checkpoint_state_round_trip_through_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = OptimConfig(lr=1e-2, warmup_steps=3)
    batch = make_padded_batch()
    a = FSDP2Engine(tiny_qwen2(seed=0), cfg)
    a.train_step(batch, token_mean_loss, 4)
    state = a.state_dict_for_checkpoint()
    assert set(state) == {"model", "optimizer", "lr_scheduler", "global_step"}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    b = FSDP2Engine(tiny_qwen2(seed=5), cfg)
    target = b.state_dict_for_checkpoint()
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    b.load_checkpoint_state(target)
    assert b.global_step == 1
    ma = a.train_step(batch, token_mean_loss, 4)
    mb = b.train_step(batch, token_mean_loss, 4)
    assert ma["lr"] == mb["lr"] == pytest.approx(cfg.lr * 2 / 3)  # warm-up step 2 of 3
    for (na, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, msg=na)


def test_bad_inputs_are_rejected_before_compute(engine):
    batch = make_padded_batch()
    with pytest.raises(ValueError, match="micro_batch_size"):
        engine.compute_logprobs(batch, 0)
    missing = {k: v for k, v in batch.items() if k != "position_ids"}
    with pytest.raises(KeyError, match="position_ids"):
        engine.compute_logprobs(missing, 2)
    wrong = dict(batch, responses=batch["responses"].flip(-1))
    with pytest.raises(ValueError, match="must equal responses"):
        engine.compute_logprobs(wrong, 2)
    no_tokens = dict(batch, response_mask=torch.zeros_like(batch["response_mask"]))
    with pytest.raises(ValueError, match="all zero"):
        engine.train_step(no_tokens, token_mean_loss, 2)
    with pytest.raises(TypeError, match="scalar loss"):
        engine.forward_backward(batch, lambda mb, lp, ent, agg: (lp, {}), 2)
    engine.optimizer.zero_grad(set_to_none=True)


def test_inference_only_engine_refuses_to_train():
    ref = FSDP2Engine(tiny_qwen2(), None)
    assert all(not p.requires_grad for p in ref.model.parameters())
    with pytest.raises(RuntimeError, match="inference only"):
        ref.train_step(make_padded_batch(), token_mean_loss, 2)
    assert set(ref.state_dict_for_checkpoint()) == {"model", "global_step"}


def test_unknown_engines_are_refused_with_the_known_ones():
    ctx = EngineBuildContext(
        role="actor", load_model=tiny_qwen2, model_path="unused", device=torch.device("cpu")
    )
    with pytest.raises(UnknownNameError, match="known training engines: fsdp2"):
        build_training_engine("deepspeed", ctx)
    assert build_training_engine("fsdp2", ctx).name == "fsdp2"


def test_model_path_loads_a_saved_checkpoint(tmp_path):
    model = tiny_qwen2()
    model.save_pretrained(tmp_path / "ckpt")
    eng = FSDP2Engine(tmp_path / "ckpt", None)
    batch = make_padded_batch()
    lp_path = eng.compute_logprobs(batch, 4)[0]
    lp_mod = FSDP2Engine(model, None).compute_logprobs(batch, 4)[0]
    torch.testing.assert_close(lp_path, lp_mod)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        FSDP2Engine(tmp_path / "missing", None)


def test_aggregation_context_counts_and_max_response_len_override(engine):
    batch = make_padded_batch()
    seen = []

    def spy(mb, logprobs, entropy, agg):
        seen.append(agg)
        return (logprobs * 0).sum(), {}

    engine.forward_backward(batch, spy, 3)
    engine.forward_backward(batch, spy, 3, max_response_len=50)
    engine.optimizer.zero_grad(set_to_none=True)
    assert len(seen) == 6  # 3 micro-batches per call
    assert seen[0].global_tokens == float(batch["response_mask"].sum())
    assert seen[0].global_seqs == 7.0 and seen[0].max_response_len == R
    assert seen[3].max_response_len == 50


def test_gradient_checkpointing_gives_the_same_gradient():
    batch = make_padded_batch()
    checkpointed = FSDP2Engine(tiny_qwen2(), OptimConfig(), gradient_checkpointing=True)
    model = (
        checkpointed.model
    )  # transformers >= 5.20: is_activation_checkpointing; 5.17-5.19: is_gradient_checkpointing
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    g_ref = grads_after_backward(FSDP2Engine(tiny_qwen2(), OptimConfig()), batch, token_mean_loss, 4)
    g_ckpt = grads_after_backward(checkpointed, batch, token_mean_loss, 4)
    for name in g_ref:
        torch.testing.assert_close(g_ckpt[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_bare_cuda_device_gets_the_current_index(monkeypatch):
    """``device="cuda"`` (no index) is torch's current CUDA device: ``set_device`` refuses a bare one."""
    from verity.engines.device import default_device, resolve_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) == default_device()
