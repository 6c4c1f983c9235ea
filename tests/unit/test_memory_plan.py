"""The memory plan: its terms against hand-computed numbers, Qwen2.5 plans on 80 GiB GPUs, the docs'
table, a refused plan through `verity train` (exit 2 before Ray starts) and `verity diagnose`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config
from verity.config import load_config
from verity.launch import memory_plan
from verity.launch.memory_plan import MemoryCapacity, plan_memory, run_pools
from verity.launch.memory_terms import (
    GIB,
    ModelShape,
    activation_bytes,
    activation_bytes_per_token,
    kv_cache_bytes,
    logprob_head_bytes,
)

ROOT = Path(__file__).resolve().parents[2]


def _table_module():
    spec = importlib.util.spec_from_file_location("gen_memory_table", ROOT / "docs" / "gen_memory_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE = _table_module()

# hidden 64, 2 layers, 4 heads / 2 KV heads (head dim 16), MLP 128, vocabulary 100, untied
TINY = Qwen2Config(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=100,
    tie_word_embeddings=False,
)


def test_tiny_qwen2_is_counted_exactly_on_the_meta_device():
    shape = ModelShape.from_hf_config(TINY)
    # a layer: q 64x64+64, k and v 64x32+32 each, o 64x64, gate/up/down 3x64x128, two norms of 64
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    root = 100 * 64 + 64 + 64 * 100  # embeddings, final norm, output layer
    assert (shape.layer_params, shape.root_params, shape.n_params) == (layer, root, 2 * layer + root)
    assert (shape.kv_width, shape.head_dim, shape.lm_head_params) == (32, 16, 6400)


def test_the_terms_match_hand_computed_bytes():
    shape = ModelShape.from_hf_config(TINY)
    # bf16: norms 2 (4 + 2) 64 = 768, q k v 2 (64 + 64) = 256, attention out 2 2 64 = 256, SwiGLU 4 2 128 = 1024
    assert activation_bytes_per_token(shape, 2) == 768 + 256 + 256 + 1024
    # eager attention adds scores and probabilities: 2 x 2 bytes x 4 heads x 10 positions
    assert activation_bytes_per_token(shape, 2, eager_positions=10) == 2304 + 160
    # 10 tokens, 2 layers, plus the final norm's (4 + 2) 64; checkpointed: inputs 2 x 2 x 64 + one layer
    assert activation_bytes(shape, 10, 2, checkpointing=False) == 10 * (2 * 2304 + 384)
    assert activation_bytes(shape, 10, 2, checkpointing=True) == 10 * (2 * 2 * 64 + 2304 + 384)
    # the loss head: logits + their gradient in bf16, two float32 chunks of min(4096, 50) rows
    assert logprob_head_bytes(shape, 50, 2, 4096) == 2 * 50 * 100 * 2 + 2 * 50 * 100 * 4
    assert logprob_head_bytes(shape, 50, 2, 4096, entropy_grad=True) == 50 * 100 * (4 + 12)
    # K and V: 2 x 2 layers x 32 wide x 2 bytes x 3 rows x 20 positions
    assert kv_cache_bytes(shape, 3, 20, 2) == 2 * 2 * 32 * 2 * 3 * 20


def test_a_tiny_run_on_cpu_adds_up_its_terms():
    overrides = [
        "trainer.device=cpu",
        "trainer.n_workers=2",
        "algorithm.kl.use_kl_loss=true",
        "actor.fsdp2.sharding=full",
        "data.max_prompt_length=12",
        "data.max_response_length=8",
        "actor.micro_batch_size=4",
        "rollout.micro_batch_size=16",
    ]
    cfg = load_config(overrides)
    shape = ModelShape.from_hf_config(TINY)
    plan = plan_memory(cfg, {"actor": shape}, run_pools(cfg), "cpu", MemoryCapacity(8 * GIB, "test"))
    worker = plan.workers[0]
    terms = {t.name: t for t in worker.terms}
    n = shape.n_params
    assert terms["actor.params"].bytes == -(-n * 4 // 2)  # float32, sharded over 2 workers
    assert terms["actor.optimizer"].bytes == 2 * terms["actor.params"].bytes
    assert terms["reference.params"].bytes == terms["actor.params"].bytes
    # the HF rollout's copy exists from a weight sync to the end of generate (released while asleep)
    assert terms["rollout.weights"].bytes == n * 4 and terms["rollout.weights"].stage == "generate"
    assert terms["rollout.weights_at_sync"].bytes == n * 4 and terms["rollout.weights_at_sync"].stage == "weight_sync"
    assert terms["actor.activations"].bytes == activation_bytes(shape, 4 * 20, 4, checkpointing=False)
    assert all(t.where == "host" for t in worker.terms)  # on a CPU every term is host memory
    peak, stage = worker.peak("host")
    resident = sum(t.bytes for t in worker.terms if t.stage == "resident")
    stages = {}
    for t in worker.terms:
        if t.stage != "resident":
            stages[t.stage] = stages.get(t.stage, 0) + t.bytes
    assert set(stages) >= {"update_actor", "generate", "weight_sync"}
    assert (peak, stage) == (resident + max(stages.values()), max(stages, key=stages.get))
    assert plan.fits() is True and plan.refusal() is None
    assert plan.record()["plan/actor/peak_gb"] == round(peak / GIB, 3)


@pytest.mark.parametrize(("n_workers", "safetensors", "split"), [(1, True, 1), (2, True, 2), (2, False, 1)])
def test_the_reward_model_params_divide_over_its_ranks_when_it_streams(
    tmp_path, n_workers, safetensors, split
):
    from transformers import Qwen2ForCausalLM

    # the plan reads no weights, only their format (the config check reads the safetensors headers)
    model = Qwen2ForCausalLM(TINY)
    if safetensors:
        model.save_pretrained(tmp_path)
    else:  # a folder of .bin weights loads whole
        TINY.save_pretrained(tmp_path)
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    cfg = load_config(
        [
            "trainer.device=cpu",
            f"trainer.n_workers={n_workers}",
            "reward_model.enabled=true",
            f"reward_model.model_path={tmp_path}",
            "reward_model.micro_batch_size=4",
            "reward_model.max_length=32",
        ]
    )
    shape = ModelShape.from_hf_config(TINY)
    shapes = {"actor": shape, "reward_model": shape}
    plan = plan_memory(cfg, shapes, run_pools(cfg), "cpu", MemoryCapacity(8 * GIB, "test"))
    terms = {t.name: t for t in plan.workers[0].terms}
    whole = (shape.n_params - shape.lm_head_params) * 4  # float32, no output layer
    assert terms["reward_model.params"].bytes == -(-whole // split)
    assert terms["reward_model.params"].stage == "resident"
    gathered = terms.get("reward_model.gathered_weights")
    if split == 1:  # one rank, or .bin weights: the whole model in every rank, nothing gathered
        assert gathered is None
    else:  # the embedding, the final norm and two layers gathered for a pass
        assert gathered.bytes == (shape.root_params - shape.lm_head_params + 2 * shape.layer_params) * 4
        assert gathered.stage == "compute_rm_score"


def test_shard_vocab_takes_the_vocabulary_out_of_the_gathered_and_whole_terms():
    base = [
        "trainer.device=cpu",
        "trainer.n_workers=2",
        "actor.fsdp2.sharding=full",
        "data.max_prompt_length=12",
        "data.max_response_length=8",
        "actor.micro_batch_size=4",
    ]
    shape = ModelShape.from_hf_config(TINY)
    terms = {}
    for shard_vocab in (False, True):
        cfg = load_config([*base, f"actor.fsdp2.shard_vocab={str(shard_vocab).lower()}"])
        plan = plan_memory(cfg, {"actor": shape}, run_pools(cfg), "cpu", MemoryCapacity(8 * GIB, "test"))
        terms[shard_vocab] = {t.name: t.bytes for t in plan.workers[0].terms}
    plain, sharded = terms[False], terms[True]
    vocab_weights = 2 * 100 * 64  # untied: the embedding and the output layer, float32 compute
    assert plain["actor.gathered_weights"] - sharded["actor.gathered_weights"] == vocab_weights * 4
    assert plain["actor.embedding_grads"] == 2 * 100 * 64 * 4 == 2 * sharded["actor.embedding_grads"]
    assert sharded["actor.vocab_exchange"] == 2 * 4 * (8 + 1) * 100 * 4  # rows x (response + 1) x V x 4 B
    assert "actor.vocab_exchange" not in plain
    assert sharded["actor.params"] == plain["actor.params"]
    # null (the default) is on for a CPU run
    cfg = load_config(base)
    plan = plan_memory(cfg, {"actor": shape}, run_pools(cfg), "cpu", MemoryCapacity(8 * GIB, "test"))
    assert {t.name: t.bytes for t in plan.workers[0].terms} == sharded
    # a worker whose largest term is the vocabulary's is told about shard_vocab, until it is on
    cfg = load_config([*base, "actor.fsdp2.shard_vocab=false"])
    assert "actor.fsdp2.shard_vocab=true" in memory_plan._remedy("actor.embedding_grads", cfg)
    cfg = load_config([*base, "actor.fsdp2.shard_vocab=true"])
    assert "shard_vocab" not in memory_plan._remedy("actor.embedding_grads", cfg)
    # the reward model has no fsdp2 section: its remedy names its own keys
    remedy = memory_plan._remedy("reward_model.params", cfg)
    assert "reward_model.n_workers" in remedy and "fsdp2" not in remedy


@pytest.mark.parametrize(
    ("name", "fits", "largest"),
    [
        ("Qwen2.5-7B", {1: True, 2: True, 4: True}, "rollout.weights"),
        ("Qwen2.5-32B", {1: False, 2: False, 4: False}, None),
        ("Qwen2.5-72B", {1: False, 2: False, 4: False}, "rollout.weights"),
    ],
)
def test_qwen25_plans_on_80_gib_gpus(name, fits, largest):
    for nodes, expected in fits.items():
        for offload in (False, True):
            plan = TABLE.plan(name, nodes, offload)
            assert plan.fits() is expected, (name, nodes, offload)
            worker = plan.workers[0]
            if largest is not None:
                assert worker.largest("device").name == largest
            terms = {t.name: t for t in worker.terms}
            assert terms["actor.params"].where == ("host" if offload else "device")
            assert terms["actor.optimizer"].where == ("host" if offload else "device")
            if not expected:
                sentence = plan.refusal()
                assert sentence.count(". ") == 0 and "\n" not in sentence  # one sentence
                assert f"its largest term is {worker.largest('device').name}" in sentence
                assert "rollout" in sentence.split("so ", 1)[1]  # what would make it fit
                if largest == "rollout.weights":
                    assert "rollout.tensor_parallel_size" in sentence


def test_a_tensor_parallel_rollout_holds_a_slice_per_rank():
    base = ["trainer.device=cpu", "trainer.n_workers=4", "actor.fsdp2.sharding=full"]
    shape = ModelShape.from_hf_config(TINY)
    plans = {}
    for tp in (1, 2):
        cfg = load_config([*base, f"rollout.tensor_parallel_size={tp}"])
        plan = plan_memory(cfg, {"actor": shape}, run_pools(cfg), "cpu", MemoryCapacity(8 * GIB, "test"))
        plans[tp] = {t.name: t.bytes for t in plan.workers[0].terms}
    assert plans[2]["rollout.weights"] == -(-shape.n_params * 4 // 2)
    assert plans[2]["rollout.sync_buckets"] < plans[1]["rollout.sync_buckets"]
    # a replica of 2 ranks generates for twice the rows a rank alone would, over half the heads
    assert plans[2]["rollout.kv_cache"] == plans[1]["rollout.kv_cache"]
    assert plans[2]["actor.params"] == plans[1]["actor.params"]  # training is untouched
    # vLLM in the replica's ranks (its external launcher): each rank loads 1/tp of the weights too
    cfg = load_config([*base, "rollout.engine=vllm", "rollout.tensor_parallel_size=2"])
    plan = plan_memory(cfg, {"actor": shape}, run_pools(cfg), "cpu", MemoryCapacity(8 * GIB, "test"))
    assert {t.name: t.bytes for t in plan.workers[0].terms}["rollout.weights"] == plans[2]["rollout.weights"]


def test_more_nodes_shrink_the_sharded_terms():
    one, four = TABLE.plan("Qwen2.5-32B", 1, False), TABLE.plan("Qwen2.5-32B", 4, False)
    by_name = [{t.name: t.bytes for t in p.workers[0].terms} for p in (one, four)]
    assert by_name[0]["actor.optimizer"] == 4 * by_name[1]["actor.optimizer"]
    assert by_name[0]["rollout.weights"] == by_name[1]["rollout.weights"]  # a full copy per rank
    sentence = one.refusal()
    assert "its largest term is rollout.kv_cache" in sentence and "rollout.micro_batch_size" in sentence


def test_the_docs_table_is_current():
    page = TABLE.PAGE.read_text(encoding="utf-8")
    assert TABLE.page_with_table(page, TABLE.render()) == page, "run: python docs/gen_memory_table.py"


def test_a_plan_that_cannot_fit_stops_verity_train_before_ray(tmp_path, monkeypatch, capsys):
    import verity.controller
    from verity.cli import train as train_cli

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a plan that cannot fit")

    monkeypatch.setattr(verity.controller, "init_ray", no_ray)
    out = tmp_path / "run"
    code = train_cli.main(
        [
            "trainer.device=cpu",
            "trainer.device_memory_gb=0.05",
            f"trainer.output_dir={out}",
            "trainer.progress=false",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the memory plan does not fit: each actor worker needs about" in err[0]
    assert "its largest term is process.baseline" in err[0] and "trainer.n_workers_per_node" in err[0]
    assert not (out / ".lock").exists()


def test_diagnose_prints_the_memory_plan(monkeypatch, capsys):
    from verity.cli import diagnose, diagnose_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(diagnose_ray, "start_local_ray", lambda: {"ok": True})
    assert diagnose.main(["--ray", "--json", "trainer.device=cpu"]) == 2  # no cluster to plan the pools on
    report = json.loads(capsys.readouterr().out)
    memory = report["memory_plan"]
    assert memory["fits"] is True and memory["plan"][1].startswith("actor (actor) x 2: peak")
    assert memory["record"]["plan/actor/process.baseline_gb"] == round(
        memory_plan.CPU_WORKER_BASELINE_BYTES / GIB, 3
    )
    # a declared device too small for the plan: exit 2, the refusal's sentence in the text report
    assert diagnose.main(["--ray", "trainer.device=cpu", "trainer.device_memory_gb=0.05"]) == 2
    text = capsys.readouterr().out
    section = text.split("== memory plan ==\n", 1)[1]
    assert "the memory plan does not fit" in section and "    actor (actor) x 2: peak" in section
