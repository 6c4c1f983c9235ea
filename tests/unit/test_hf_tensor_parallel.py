"""The tensor-parallel HF rollout (2 gloo processes) against the HF rollout on the whole model.

One spawn of two ranks runs every scenario (a spawn costs most of the time on a 2-core
machine); the whole-model (TP=1) references are computed in the test process. The tiny
models are built with a wide initialiser (``INIT``) so that the next-token logits lie far
apart and greedy decoding does not hinge on the last bits (TP sums the attention and MLP
outputs in another order than one process does).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import tiny_qwen2_config
from verity.resharding import slice_for_tp
from verity.rollout import HFRollout, SamplingParams
from verity.rollout.hf_tensor_parallel import (
    TensorParallelHFRollout,
    build_tensor_parallel_model,
    check_tensor_parallel_size,
)

WORLD = 2
INIT = 0.5  # the models' initializer_range (see the module docstring)
EOS = list(range(3, 100, 9))  # ~11% of the vocabulary: rows finish at different steps
GREEDY = SamplingParams(do_sample=False, max_new_tokens=10, n=3)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, n=4)


def make_config(tied: bool = True, vocab: int = 100):
    config = tiny_qwen2_config(tie_word_embeddings=tied, initializer_range=INIT)
    config.vocab_size = vocab
    return config


def make_model(seed: int, tied: bool = True, vocab: int = 100):
    from transformers import Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(make_config(tied, vocab)).eval()


def prompts() -> dict[str, torch.Tensor]:
    """Three left-padded prompts of 5, 3 and 1 tokens."""
    ids = torch.tensor([[11, 12, 13, 14, 15], [0, 0, 21, 22, 23], [0, 0, 0, 0, 31]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def tokens(out) -> dict[str, torch.Tensor]:
    return {k: out[k].clone() for k in ("responses", "response_mask", "rollout_logprobs")}


def whole_model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _raises(fn) -> str:
    try:
        fn()
    except Exception as error:  # the test reads its type and message
        return f"{type(error).__name__}: {error}"
    return "no error"


def _worker(rank: int, port: int, out_dir: str) -> None:
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        out: dict = {}
        kwargs = {"tp_mesh": mesh, "eos_token_ids": EOS, "pad_token_id": 0, "seed": 5}

        # tied embeddings: three syncs of different weights, full, pre-sliced, full
        engine = TensorParallelHFRollout.from_config(make_config(), **kwargs)
        out["tp"] = (engine.tensor_parallel_size, engine.tensor_parallel_rank, engine.name)
        out["attention"] = engine.serving_attention  # the grouped CPU attention, on the local heads
        out["before_load"] = _raises(lambda: engine.generate(prompts(), GREEDY))
        for seed, sliced in ((0, False), (1, True), (2, False)):
            state = make_model(seed).state_dict()
            del state["lm_head.weight"]  # the trainer sends the tied embedding once
            pairs = [(n, slice_for_tp(n, t, rank, WORLD) if sliced else t) for n, t in state.items()]
            out[f"loaded{seed}"] = engine.load_weights(pairs)
            out[f"greedy{seed}"] = tokens(engine.generate(prompts(), GREEDY))
        engine.set_seed(9)
        out["sampled"] = tokens(engine.generate(prompts(), SAMPLED))
        out["weight_bytes"] = engine.weight_bytes()
        out["local_shapes"] = {n: tuple(_local(p).shape) for n, p in engine.model.named_parameters()}
        out["tied"] = engine.model.lm_head.weight is engine.model.model.embed_tokens.weight

        # logits and rotary buffers against a normal model of the same (last) weights
        whole = make_model(2)
        batch = prompts()
        with torch.no_grad():
            got = engine.model(**batch).logits
            want = whole(**batch).logits
        out["logit_diff"] = float((got - want).abs().max())
        out["inv_freq_equal"] = torch.equal(
            engine.model.model.rotary_emb.inv_freq, whole.model.rotary_emb.inv_freq
        )

        # sleep releases every local shard; wake gives storage back, unfilled until the next sync
        engine.sleep()
        out["asleep_bytes"] = engine.weight_bytes()
        engine.wake()
        out["awake_bytes"] = engine.weight_bytes()
        out["needs_sync_after_wake"] = engine.needs_weight_sync
        out["after_wake"] = _raises(lambda: engine.generate(prompts(), GREEDY))
        engine.load_weights(make_model(2).state_dict().items())
        out["needs_sync_after_load"] = engine.needs_weight_sync
        out["greedy_reloaded"] = tokens(engine.generate(prompts(), GREEDY))

        # errors: an unknown name, a wrong shape, ranks out of lockstep
        out["unknown"] = _raises(lambda: engine.load_weights([("model.nope.weight", torch.zeros(1))]))
        out["wrong_shape"] = _raises(lambda: engine.load_weights([("model.norm.weight", torch.zeros(3))]))
        skewed = prompts()
        skewed["input_ids"][0, -1] += rank
        out["skewed"] = _raises(lambda: engine.generate(skewed, GREEDY))
        indivisible = tiny_qwen2_config()
        indivisible.hidden_size, indivisible.num_attention_heads, indivisible.num_key_value_heads = 96, 6, 3
        out["indivisible"] = _raises(lambda: build_tensor_parallel_model(indivisible, mesh))

        # untied, with a vocabulary that does not divide (101 = 51 + 50 rows)
        untied = TensorParallelHFRollout.from_config(make_config(tied=False, vocab=101), **kwargs)
        full = make_model(3, tied=False, vocab=101).state_dict()
        out["untied_loaded"] = untied.load_weights(full.items())
        out["untied_rows"] = tuple(untied.model.lm_head.weight.to_local().shape)
        out["untied_greedy"] = tokens(untied.generate(prompts(), GREEDY))
        out["untied_slices_agree"] = all(  # the parts DTensor itself scatters from the whole tensors
            torch.equal(distribute_tensor(full[n], mesh, p.placements).to_local(), p.to_local())
            for n, p in untied.model.named_parameters()
            if isinstance(p, DTensor)
        )

        # a model folder: the config read from it, the weights from its safetensors file
        folder = os.path.join(out_dir, "model")
        from_folder = TensorParallelHFRollout.from_config(folder, **kwargs)
        out["folder_loaded"] = from_folder.load_weights(
            load_file(os.path.join(folder, "model.safetensors")).items()
        )
        out["folder_greedy"] = tokens(from_folder.generate(prompts(), GREEDY))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def folder_model(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tensor_parallel")
    model = make_model(4)
    model.save_pretrained(out_dir / "model")
    return str(out_dir), model


@pytest.fixture(scope="module")
def results(folder_model):
    return spawn_and_load(_worker, WORLD, folder_model[0])


def reference(model, params: SamplingParams = GREEDY, seed: int = 5) -> dict[str, torch.Tensor]:
    """The HF rollout on the whole model (TP=1)."""
    return tokens(HFRollout(model, eos_token_ids=EOS, pad_token_id=0, seed=seed).generate(prompts(), params))


def assert_same_tokens(got: dict, want: dict) -> None:
    assert torch.equal(got["responses"], want["responses"])
    assert torch.equal(got["response_mask"], want["response_mask"])
    torch.testing.assert_close(got["rollout_logprobs"], want["rollout_logprobs"], atol=1e-4, rtol=0)


def test_greedy_tokens_equal_the_whole_models_after_each_sync(results):
    for seed in (0, 1, 2):
        want = reference(make_model(seed))
        lengths = want["response_mask"].sum(-1)
        assert lengths.min() < GREEDY.max_new_tokens, "some rows must finish early (compaction)"
        assert lengths.max() > lengths.min()
        for res in results:
            assert res[f"loaded{seed}"] == 2 * 12 + 2  # layers, embedding, final norm; no lm_head
            assert_same_tokens(res[f"greedy{seed}"], want)
    assert not torch.equal(results[0]["greedy0"]["responses"], results[0]["greedy2"]["responses"])


def test_untied_model_with_uneven_vocabulary(results):
    want = reference(make_model(3, tied=False, vocab=101))
    for rank, res in enumerate(results):
        assert res["untied_loaded"] == 2 * 12 + 3
        assert res["untied_rows"] == ((51, 64), (50, 64))[rank]
        assert res["untied_slices_agree"]
        assert_same_tokens(res["untied_greedy"], want)


def test_model_folder(results, folder_model):
    want = reference(folder_model[1])
    for res in results:
        assert res["folder_loaded"] == 2 * 12 + 2  # save_pretrained drops the tied lm_head
        assert_same_tokens(res["folder_greedy"], want)


def test_sampling_is_in_lockstep(results):
    first, second = results[0]["sampled"], results[1]["sampled"]
    assert torch.equal(first["responses"], second["responses"])
    assert torch.equal(first["rollout_logprobs"], second["rollout_logprobs"])
    rows = first["responses"].view(3, SAMPLED.n, -1)
    assert any(not torch.equal(group[0], group[i]) for group in rows for i in range(1, SAMPLED.n))
    assert "different prompts" in results[0]["skewed"] and "different prompts" in results[1]["skewed"]


def test_logits_and_rotary_buffers_match_a_normal_model(results):
    for res in results:
        assert res["inv_freq_equal"]
        assert res["logit_diff"] < 1e-4
        assert res["tp"][0] == WORLD and res["tp"][2] == "hf"
        assert res["attention"] == "verity_sdpa_gqa"  # 2 query heads over 1 key/value head per rank
    assert [res["tp"][1] for res in results] == [0, 1]


def test_each_rank_holds_about_half_the_weights(results):
    whole = whole_model_bytes(make_model(0))
    for rank, res in enumerate(results):
        assert res["tied"], "the tied embedding stays one parameter after the split"
        assert abs(res["weight_bytes"] / whole - 0.5) < 0.1, (res["weight_bytes"], whole)
        shapes = res["local_shapes"]
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
        assert shapes["model.layers.0.self_attn.k_proj.bias"] == (16,)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 64)
        assert shapes["model.embed_tokens.weight"] == (50, 64)
        assert shapes["model.norm.weight"] == (64,)
        full = make_model(0).state_dict()
        for name, shape in shapes.items():
            assert shape == tuple(slice_for_tp(name, full[name], rank, WORLD).shape), name


def test_sleep_releases_and_wake_needs_a_sync(results):
    for res in results:
        assert res["asleep_bytes"] == 0
        assert res["awake_bytes"] == res["weight_bytes"]
        assert res["needs_sync_after_wake"] and not res["needs_sync_after_load"]
        assert res["after_wake"].startswith("RuntimeError") and "weight sync" in res["after_wake"]
        assert res["before_load"].startswith("RuntimeError")
        assert_same_tokens(res["greedy_reloaded"], res["greedy2"])


def test_load_weights_errors(results):
    res = results[0]
    assert res["unknown"].startswith("KeyError") and "model.nope.weight" in res["unknown"]
    assert res["wrong_shape"].startswith("ValueError") and "(64,)" in res["wrong_shape"]
    assert "(3,)" in res["wrong_shape"]


def test_indivisible_heads_raise_one_clear_sentence(results):
    message = "tensor-parallel size 2 must divide the model's 6 attention heads and 3 key/value heads"
    for res in results:
        assert res["indivisible"] == f"ValueError: {message}"
    with pytest.raises(ValueError, match="size 3 must divide the model's 4 attention heads and 2 key/value"):
        check_tensor_parallel_size(tiny_qwen2_config(), 3)
    check_tensor_parallel_size(tiny_qwen2_config(), 2)
