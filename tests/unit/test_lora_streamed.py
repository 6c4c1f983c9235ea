"""LoRA over a streamed base: two ranks build the model empty, each receives its shard of the base,
and the adapters start bitwise as on a whole-loaded model (``verity.engines.lora.apply_lora_to_empty``)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.spawn import spawn_and_load
from helpers.tiny_models import make_padded_batch, push_up_loss, tiny_qwen2
from verity.engines.lora import LoRAConfig, apply_lora, apply_lora_to_empty
from verity.engines.model_source import ModelSource

pytest.importorskip("peft")

LORA = LoRAConfig(rank=4, alpha=8.0)
SEED = 11


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapters_on_an_empty_model_start_as_on_the_whole_model(tmp_path, dtype):
    tiny_qwen2(seed=3).save_pretrained(tmp_path)
    source = ModelSource(str(tmp_path), dtype=dtype)
    whole = source.load_whole()
    apply_lora(whole, LORA, seed=SEED)
    empty = source.build_empty()
    _, initial = apply_lora_to_empty(empty, LORA, seed=SEED)

    expected = {n: p for n, p in whole.named_parameters() if p.requires_grad}
    assert sorted(initial) == sorted(expected) and len(initial) == 28  # 2 layers x 7 linears x (A, B)
    for name, value in initial.items():
        assert torch.equal(value, expected[name]), name
    # everything is on meta again, frozen as peft leaves the base, the tie of the embedding kept
    assert all(p.device.type == "meta" for p in empty.parameters())
    assert [n for n, p in empty.named_parameters() if p.requires_grad] == list(expected)
    assert empty.lm_head.weight is empty.model.embed_tokens.weight
    # another seed draws other adapters
    _, other = apply_lora_to_empty(source.build_empty(), LORA, seed=SEED + 1)
    name = next(n for n in initial if ".lora_A." in n)
    assert not torch.equal(other[name], initial[name])


# ------------------------------------------------------------------ two ranks over gloo
def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from helpers.tiny_models import make_padded_batch
    from verity.batch import Batch
    from verity.engines import OptimConfig
    from verity.engines.fsdp2_lora import FSDP2LoRAEngine
    from verity.engines.registry import EngineBuildContext, build_training_engine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(100 + rank)  # the global RNG differs per rank: the adapters must not
    source = ModelSource(os.path.join(out_dir, "model"))
    ctx = EngineBuildContext(
        role="actor",
        load_model=source.load_whole,
        model_path=source.path,
        device=torch.device("cpu"),
        source=source,
        optim=OptimConfig(lr=1e-2),
        lora=LORA,
        seed=SEED,
    )
    engine = build_training_engine("fsdp2", ctx)
    assert isinstance(engine, FSDP2LoRAEngine)
    out: dict = {"streamed": engine.streamed, "base_model": engine.base_model_path}
    out["local_base"] = sum(p.to_local().numel() for p in engine.model.parameters() if not p.requires_grad)
    out["adapters"] = {n: _full(p) for n, p in engine.model.named_parameters() if p.requires_grad}
    out["base"] = {n: _full(p) for n, p in engine.model.named_parameters() if not p.requires_grad}
    batch = make_padded_batch()
    out["before"] = engine.compute_logprobs(batch, micro_batch_size=4)[0]
    out["ref"] = engine.adapter_free_reference().compute_logprobs(batch, 4, compute_entropy=False)[0]
    local = Batch.from_dict(batch).split(2)[rank]
    for _ in range(2):
        engine.train_step(local, push_up_loss, 4)
    out["after"] = engine.compute_logprobs(batch, micro_batch_size=4)[0]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_ranks_stream_the_frozen_base_and_start_as_the_whole_lora_model(tmp_path):
    from verity.engines import FSDP2Engine

    tiny_qwen2(seed=3).save_pretrained(tmp_path / "model")
    ranks = spawn_and_load(_worker, 2, str(tmp_path))

    source = ModelSource(str(tmp_path / "model"))
    whole = source.load_whole()
    total = sum(p.numel() for p in whole.parameters())
    single = FSDP2Engine(whole, None).compute_logprobs(make_padded_batch(), micro_batch_size=4)[0]
    adapted = source.load_whole()
    apply_lora(adapted, LORA, seed=SEED)
    expected = {n: p.detach() for n, p in adapted.named_parameters()}
    for rank in ranks:
        assert rank["streamed"] is True and rank["base_model"] == str(tmp_path / "model")
        # each rank holds about half of the frozen base: dim-0 chunks
        assert 0.4 * total < rank["local_base"] < 0.6 * total
        # the base is the checkpoint, bit for bit, under peft's names
        for name, value in rank["base"].items():
            assert torch.equal(value, expected[name]), name
        # the adapters: identical on both ranks, A drawn (non-zero), B zero, as a whole-loaded run draws them
        assert sorted(rank["adapters"]) == sorted(n for n, p in adapted.named_parameters() if p.requires_grad)
        for name, value in rank["adapters"].items():
            assert torch.equal(value, ranks[0]["adapters"][name]), name
            assert torch.equal(value, expected[name]), name
            if ".lora_A." in name:
                assert torch.count_nonzero(value) == value.numel(), name
            else:
                assert torch.count_nonzero(value) == 0, name
        # B = 0: the adapted model starts as the base model
        torch.testing.assert_close(rank["before"], single, rtol=0, atol=1e-5)
        torch.testing.assert_close(rank["ref"], single, rtol=0, atol=1e-5)
        # it learns: push_up_loss raises the responses' log-probs
        mask = make_padded_batch()["response_mask"].bool()
        assert rank["after"][mask].mean() > rank["before"][mask].mean() + 1e-3
    torch.testing.assert_close(ranks[0]["after"], ranks[1]["after"], rtol=0, atol=0)
