"""``fsdp2.shard_vocab``: the embedding and output layer sharded by rows give the numbers of the unsharded ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.spawn import spawn_and_load
from helpers.tiny_models import VOCAB, make_padded_batch, tiny_qwen2, tiny_qwen2_config


def entropy_bonus_loss(mb, logprobs, entropy, agg):
    """-(sum of logprob * advantage + 0.01 * entropy) / global_tokens: gradients through both heads."""
    mask = mb["response_mask"]
    return -((logprobs * mb["advantages"] + 0.01 * entropy) * mask).sum() / agg.global_tokens, {}


def _train(engine, rank: int) -> dict:
    """Two steps on this rank's own batch (ranks hold different rows and token counts)."""
    batch = make_padded_batch(rows=5 + rank, seed=rank + 1)
    engine.forward_backward(batch, entropy_bonus_loss, 2)
    grads = engine.full_gradients()
    metrics = [engine.optimizer_step()]
    engine.update_finished()
    metrics.append(engine.train_step(batch, entropy_bonus_loss, micro_batch_size=3))
    return {
        "grads": grads,
        "grad_norms": [m["grad_norm"] for m in metrics],
        "loss": metrics[1]["loss"],
        "logprobs": engine.compute_logprobs(batch, micro_batch_size=4)[0],
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from verity.engines import FSDP2Engine, OptimConfig
    from verity.engines.model_source import ModelSource
    from verity.resharding import iter_engine_weights

    world = int(Path(out_dir, "world").read_text())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    for shard_vocab in (False, True):
        torch.manual_seed(0)
        if world == 2:  # built in memory, tied weights, padding id 0 (its lookups give no gradient;
            # the batches' padding is id 0, so the gradients compared below would differ otherwise)
            from transformers import Qwen2ForCausalLM

            torch.manual_seed(1)
            model = Qwen2ForCausalLM(tiny_qwen2_config(tie_word_embeddings=True, pad_token_id=0))
        else:  # streamed from a folder: every rank built empty, filled by rank 0's reads
            model = ModelSource(os.path.join(out_dir, "model"))
        engine = FSDP2Engine(model, OptimConfig(lr=1e-2, grad_clip=1.0), shard_vocab=shard_vocab)
        run = _train(engine, rank)
        embedding = engine.model.get_input_embeddings().weight
        run["embedding_local_rows"] = embedding.to_local().shape[0]
        run["tied"] = embedding is engine.model.get_output_embeddings().weight
        run["weights"] = {name: t.clone() for name, t in iter_engine_weights(engine, device="cpu")}
        run["vocab_sharded"] = engine.vocab_sharded
        if world == 2 and shard_vocab:
            # the lookup alone: each row's gradient counts its ids over both ranks; the padding row none
            embedding.grad = None
            engine.model.get_input_embeddings()(torch.tensor([[0, 1, 2, 0, 60 + rank]])).sum().backward()
            run["lookup_grad"] = embedding.grad.full_tensor()
        if world == 2:
            import torch.distributed.checkpoint as dcp

            # saved in one layout, loaded into the other: the same Shard(0) DTensors to DCP
            path = os.path.join(out_dir, f"ckpt-{shard_vocab}")
            dcp.save(engine.state_dict_for_checkpoint(), checkpoint_id=path)
            other = FSDP2Engine(tiny_qwen2(seed=7), OptimConfig(lr=1e-2), shard_vocab=not shard_vocab)
            target = other.state_dict_for_checkpoint()
            dcp.load(target, checkpoint_id=path)
            other.load_checkpoint_state(target)
            run["reloaded"] = {name: t.clone() for name, t in iter_engine_weights(other, device="cpu")}
        else:
            # a critic: the same folder as a value model (no output layer; its head fresh)
            source = ModelSource(os.path.join(out_dir, "model"), kind="value_model")
            critic = FSDP2Engine(source, OptimConfig(lr=1e-2), shard_vocab=shard_vocab)
            run["values"] = critic.compute_values(make_padded_batch(rows=4, seed=rank), micro_batch_size=2)
        out[shard_vocab] = run
    # the default (None): on for a CPU device under full sharding, off when replicated
    out["default"] = [FSDP2Engine(tiny_qwen2(), None, sharding=s).vocab_sharded for s in ("full", "replicate")]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _assert_same_run(plain: dict, sharded: dict) -> None:
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(sharded["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert set(sharded["grads"]) == set(plain["grads"])
    assert sharded["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-5)
    assert sharded["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    torch.testing.assert_close(sharded["logprobs"], plain["logprobs"], rtol=1e-5, atol=1e-5)
    for name, tensor in plain["weights"].items():
        # after two AdamW steps of lr 1e-2: update = lr * m / (sqrt(v) + 1e-8) turns rounding-level
        # differences of ~1e-8 gradients into up to 5e-5 (the gradients are compared tightly above);
        # a parameter the optimizer missed would be ~1e-2 off
        torch.testing.assert_close(sharded["weights"][name], tensor, rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_vocabulary_trains_like_the_gathered_one(tmp_path, world):
    (tmp_path / "world").write_text(str(world))
    if world == 3:
        tiny_qwen2(seed=2, tie_word_embeddings=False).save_pretrained(tmp_path / "model")
    ranks = spawn_and_load(_worker, world, str(tmp_path))
    chunk = -(-VOCAB // world)
    for rank, run in enumerate(ranks):
        plain, sharded = run[False], run[True]
        assert sharded["vocab_sharded"] and not plain["vocab_sharded"]
        assert run["default"] == [True, False]
        # this rank's torch.chunk rows only (100 rows over 3 ranks: 34, 34, 32)
        assert sharded["embedding_local_rows"] == min(chunk, VOCAB - rank * chunk)
        assert sharded["tied"] == (world == 2)
        _assert_same_run(plain, sharded)
        if world == 2:
            counts = torch.zeros(VOCAB)
            counts[[1, 2, 60, 61]] = torch.tensor([2.0, 2.0, 1.0, 1.0])
            torch.testing.assert_close(sharded["lookup_grad"], counts[:, None].expand(VOCAB, 64))
            for layout in (False, True):
                for name, tensor in run[layout]["weights"].items():
                    torch.testing.assert_close(run[layout]["reloaded"][name], tensor, msg=name)
        else:
            torch.testing.assert_close(sharded["values"], plain["values"], rtol=1e-5, atol=1e-6)


def test_shard_vocab_is_refused_where_it_cannot_apply():
    from verity.engines import FSDP2Engine
    from verity.engines.options import FSDP2Options
    from verity.engines.vocab_sharding import vocab_unsupported_reason

    with pytest.raises(ValueError, match="shard_vocab=True .* sharding='full'"):
        FSDP2Engine(tiny_qwen2(), None, sharding="replicate", shard_vocab=True)
    with pytest.raises(ValueError, match="fsdp2.shard_vocab=true .* fsdp2.sharding=full"):
        FSDP2Options(shard_vocab=True, sharding="replicate").validate()
    from verity.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="actor.fsdp2.shard_vocab=true with actor.lora.rank=4"):
        load_config(["actor.lora.rank=4", "actor.fsdp2.shard_vocab=true", "actor.fsdp2.sharding=full"])
    model = tiny_qwen2()
    assert vocab_unsupported_reason(model) is None
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
    assert "bias" in vocab_unsupported_reason(model)
    model.model.embed_tokens.max_norm = 1.0
    assert "max_norm" in vocab_unsupported_reason(model)
