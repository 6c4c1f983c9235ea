"""vLLM as a tensor-parallel rollout inside 2 ranks of a gloo group (``rollout.tensor_parallel_size=2``).

One spawn: both ranks build the engine through the registry with the replica's ``tp_mesh``
(vLLM's external launcher, TP=2 over the group the "trainer" made), then generate greedily and
compare with HF's greedy tokens of the whole model, before and after a weight sync of a second
model's full weights (``sync_weights``: the engine takes full tensors, vLLM cuts each rank's slice),
and through the request scheduler, requests added at different steps on both ranks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.vllm_required import require_vllm

require_vllm()

from helpers.tiny_models import save_char_qwen2  # noqa: E402
from verity.rollout import HFRollout, SamplingParams, encode_prompts  # noqa: E402

MAX_MODEL_LEN = 224
PROMPTS = ["12+34=", "7-2=", "hello world", "a", "(3*4)-5=", "zz"]
GREEDY = SamplingParams(do_sample=False, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10)
KEYS = ("responses", "response_mask", "rollout_logprobs")


def picked(out) -> dict[str, torch.Tensor]:
    return {k: out[k].clone() for k in KEYS}


def prompt_batch(tokenizer) -> dict[str, torch.Tensor]:
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in PROMPTS])
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def _raises(fn) -> str:
    try:
        fn()
    except Exception as error:  # the test reads its type and message
        return f"{type(error).__name__}: {error}"
    return "no error"


def _scheduled(rollout, batch, drop: int | None = None) -> list[list[int]]:
    """Greedy tokens of each prompt through the engine's request scheduler: even prompts added at the
    first step, odd ones at the third; ``drop``: leave that prompt out."""
    from verity.rollout.requests import GenerationRequest

    contexts = [
        ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)
    ]
    plan = {0: [i for i in range(len(contexts)) if i % 2 == 0], 2: [i for i in range(len(contexts)) if i % 2]}
    scheduler = rollout.request_scheduler(GREEDY)
    finished, steps = {}, 0
    try:
        while scheduler.pending() or steps <= 2:
            for i in plan.get(steps, []):
                if i != drop:
                    scheduler.add(GenerationRequest(i, contexts[i], GREEDY.max_new_tokens))
            finished.update({done.request_id: done.token_ids for done in scheduler.step()})
            steps += 1
    finally:
        scheduler.close()
    return [finished[i] for i in range(len(contexts))]


def vllm_segments() -> set[str]:
    """The names of the shared memory vLLM's groups broadcast through (``psm_*``), of this process."""
    from vllm.distributed import parallel_state

    names = set()
    for group in vars(parallel_state).values():
        buffer = getattr(getattr(group, "mq_broadcaster", None), "buffer", None)
        if buffer is not None and hasattr(buffer, "shared_memory"):
            names.add(buffer.shared_memory.name.lstrip("/"))
    return names


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer, Qwen2ForCausalLM
    from verity.resharding import sync_weights
    from verity.rollout import RolloutBuildContext, build_rollout_engine
    from verity.rollout.options import VLLMOptions
    from verity.rollout.process_guard import shm_segments

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replica", "tp"))["tp"]  # as the actor worker
    folder_a, folder_b = os.path.join(out_dir, "model_a"), os.path.join(out_dir, "model_b")
    tokenizer = AutoTokenizer.from_pretrained(folder_a)
    segments_before = shm_segments()
    rollout = build_rollout_engine(
        "vllm",
        RolloutBuildContext(
            model_path=folder_a,
            tokenizer=tokenizer,
            device=torch.device("cpu"),
            dtype=torch.float32,
            seed=0,
            max_model_len=MAX_MODEL_LEN,
            options=VLLMOptions(kv_cache_bytes=32 * 1024**2, cache_dir=os.path.join(out_dir, f"cache{rank}")),
            tp_mesh=mesh,
        ),
    )
    batch = prompt_batch(tokenizer)
    out: dict = {
        "tp": (rollout.tensor_parallel_size, rollout.tensor_parallel_rank, rollout.receives_slices),
    }
    out["a"] = picked(rollout.generate(batch, GREEDY))
    rollout.set_seed(5)
    out["sampled"] = rollout.generate(batch, SAMPLED)["responses"].clone()
    stats = sync_weights(Qwen2ForCausalLM.from_pretrained(folder_b).eval(), rollout)
    out["synced"] = (stats.num_tensors, stats.received_bytes)
    out["b"] = picked(rollout.generate(batch, GREEDY))
    out["requests"] = _scheduled(rollout, batch)
    out["requests_lockstep"] = _raises(
        lambda: _scheduled(rollout, batch, drop=rank)
    )  # each rank drops another
    other = {k: v[:3] if rank else v[3:] for k, v in batch.items()}  # the ranks disagree: both must raise
    out["lockstep"] = _raises(lambda: rollout.generate(other, GREEDY))
    cpushm = {name for name in shm_segments() - segments_before if "cpushm" in name}
    ours = vllm_segments() | cpushm  # unlinked at start-up already: none of them is listed
    rollout.close()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)  # the trainer's group outlives the engine
    out["after_close"] = total.item()
    out["left_segments"] = sorted((shm_segments() - segments_before) & ours)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_tp")
    model_a, tokenizer = save_char_qwen2(folder / "model_a", seed=0)
    model_b, _ = save_char_qwen2(folder / "model_b", seed=7)
    batch = prompt_batch(tokenizer)
    hf = {
        name: picked(HFRollout(model, tokenizer).generate(batch, GREEDY))
        for name, model in (("a", model_a), ("b", model_b))
    }
    return {"ranks": spawn_and_load(_worker, 2, str(folder)), "hf": hf}


@pytest.mark.slow
def test_tp2_greedy_equals_hf_before_and_after_a_full_weight_sync(results):
    ranks, hf = results["ranks"], results["hf"]
    assert [r["tp"] for r in ranks] == [(2, 0, False), (2, 1, False)]
    for r in ranks:
        for name in ("a", "b"):
            assert torch.equal(r[name]["responses"], hf[name]["responses"]), name
            assert torch.equal(r[name]["response_mask"], hf[name]["response_mask"]), name
            assert torch.allclose(r[name]["rollout_logprobs"], hf[name]["rollout_logprobs"], atol=1e-4), name
        assert r["synced"][1] is None  # full tensors: nothing was sliced on the trainer's side
    assert not torch.equal(hf["a"]["responses"], hf["b"]["responses"])  # the sync changed something


@pytest.mark.slow
def test_tp2_ranks_sample_the_same_tokens(results):
    ranks = results["ranks"]
    assert torch.equal(ranks[0]["sampled"], ranks[1]["sampled"])


@pytest.mark.slow
def test_tp2_disagreeing_ranks_raise_and_close_keeps_the_group(results):
    for r in results["ranks"]:
        assert r["lockstep"].startswith("RuntimeError") and "lockstep" in r["lockstep"]
        assert r["after_close"] == 3.0
        assert r["left_segments"] == []


@pytest.mark.slow
def test_tp2_request_scheduler_gives_generates_tokens_and_checks_lockstep(results):
    for r in results["ranks"]:
        mask, responses = r["b"]["response_mask"], r["b"]["responses"]
        expected = [row[: int(m.sum())].tolist() for row, m in zip(responses, mask, strict=True)]
        assert r["requests"] == expected
        assert r["requests_lockstep"].startswith("RuntimeError") and "lockstep" in r["requests_lockstep"]
