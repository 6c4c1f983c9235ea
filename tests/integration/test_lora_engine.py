"""LoRA on FSDP2, in one process and over 2 gloo processes, against hand-written references.

- **Gradients**: for every adapted layer with weight ``W``, adapters ``A [r, in]``, ``B [out, r]``
  and scale ``s = alpha / r``, the engine's adapter gradients equal
  ``dL/dA = s B^T G`` and ``dL/dB = s G A^T``, where ``G = dL/dW_eff`` is computed here by
  autograd on a plain 2-layer model whose weights are ``W_eff = W + s B A`` (written out in
  this file, not through the runtime's merge). ``B`` is set to random values first (LoRA
  starts it at zero, which would make ``dL/dA`` vanish).
- **The reference for free**: after two optimizer steps have moved the adapters, the
  log-probs with the adapters disabled equal those of a separately loaded base model — exactly.
- **Weight sync**: the merged weights sent to a rollout make its greedy outputs equal to those
  of ``peft``'s own ``merge_and_unload()`` of the same adapters.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import VOCAB, P, make_padded_batch, push_up_loss, tiny_qwen2
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.fsdp2_lora import FSDP2LoRAEngine
from verity.engines.logprobs import response_logprobs
from verity.engines.lora import LoRAConfig

WORLD = 2
RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK
LORA = LoRAConfig(rank=RANK, alpha=ALPHA)
CFG = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0)
NEW_TOKENS = 6


def token_mean_loss(mb, logprobs, entropy, agg):
    """sum_tokens(-logprob * advantage) / global_tokens."""
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


def random_b(name: str, shape: torch.Size) -> torch.Tensor:
    """A fixed random value for the adapter ``B`` called ``name`` (the same in every process)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return 0.2 * torch.randn(shape, generator=g)


@torch.no_grad()
def set_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write ``full`` into a parameter, plain or an FSDP2 ``DTensor`` shard."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
    else:
        param.copy_(full)


def full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


def lora_engine(optim: OptimConfig | None = CFG) -> FSDP2LoRAEngine:
    """The tiny Qwen2 with rank-4 adapters on every linear layer of the decoder, ``B`` random."""
    engine = FSDP2LoRAEngine(tiny_qwen2(), optim, lora=LORA, seed=0)
    for name, param in engine.model.named_parameters():
        if ".lora_B." in name:
            set_full(param, random_b(name, param.shape))
    return engine


def shard(batch: dict[str, torch.Tensor], rank: int, world: int):
    from verity.batch import Batch

    return Batch.from_dict(batch).split(world)[rank]


def prompts(rows: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(2, P + 1, (rows,), generator=g)
    mask = (torch.arange(P) >= P - lens[:, None]).long()
    return {"input_ids": torch.randint(1, VOCAB - 1, (rows, P), generator=g) * mask, "attention_mask": mask}


def run(rank: int, world: int) -> dict:
    """What each process records: adapter gradients (two micro-batch sizes), reference and base
    log-probs after two steps, the adapters, and the greedy responses of a rollout after sync."""
    from verity.resharding import sync_weights
    from verity.rollout import HFRollout, SamplingParams

    out: dict = {}
    batch = make_padded_batch()
    local = shard(batch, rank, world) if world > 1 else batch
    engine = lora_engine()
    out["A"] = {n: full(p) for n, p in engine.model.named_parameters() if ".lora_A." in n}
    out["B"] = {n: full(p) for n, p in engine.model.named_parameters() if ".lora_B." in n}
    for mbs in (1, 4):
        engine.forward_backward(local, token_mean_loss, mbs)
        out[f"grad/{mbs}"] = engine.full_gradients()
        engine.optimizer.zero_grad(set_to_none=True)
    for _ in range(2):
        engine.train_step(local, push_up_loss, 4)
    out["optimizer_params"] = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    out["optimizer_states"] = len(engine.optimizer.state)
    base = FSDP2Engine(tiny_qwen2(), None)
    out["ref"], _ = engine.adapter_free_reference().compute_logprobs(local, 3, compute_entropy=False)
    out["base"], _ = base.compute_logprobs(local, 3, compute_entropy=False)
    out["adapted"], _ = engine.compute_logprobs(local, 3, compute_entropy=False)
    out["trained"] = {n: full(p) for n, p in engine.model.named_parameters() if p.requires_grad}

    rollout = HFRollout(tiny_qwen2(seed=7).eval(), pad_token_id=0, eos_token_ids=[VOCAB - 1])
    stats = sync_weights(engine, rollout)
    out["sync"] = (stats.num_tensors, stats.num_bytes)
    params = SamplingParams(do_sample=False, temperature=0.0, max_new_tokens=NEW_TOKENS, n=1)
    out["responses"] = rollout.generate(prompts(), params)["responses"]
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.save(run(rank, WORLD), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_process() -> dict:
    return run(0, 1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return spawn_and_load(_worker, WORLD, str(tmp_path_factory.mktemp("lora")))


@pytest.fixture(scope="module")
def hand_written(one_process) -> dict[str, torch.Tensor]:
    """``dL/dA = s B^T G``, ``dL/dB = s G A^T`` with ``G`` from a plain model holding ``W + s B A``."""
    model = tiny_qwen2()
    A, B = one_process["A"], one_process["B"]
    weights = dict(model.named_parameters())
    with torch.no_grad():
        for a_name, a in A.items():
            layer = a_name.split(".lora_A.")[0]
            b = B[a_name.replace(".lora_A.", ".lora_B.")]
            weights[f"{layer}.weight"].copy_(weights[f"{layer}.weight"] + SCALE * (b @ a))
    batch = make_padded_batch()
    logprobs, _ = response_logprobs(model, batch, compute_entropy=False)
    loss = -(logprobs * batch["advantages"] * batch["response_mask"]).sum() / batch["response_mask"].sum()
    loss.backward()
    expected = {}
    for a_name, a in A.items():
        layer = a_name.split(".lora_A.")[0]
        b_name = a_name.replace(".lora_A.", ".lora_B.")
        g = weights[f"{layer}.weight"].grad
        expected[a_name] = SCALE * B[b_name].T @ g
        expected[b_name] = SCALE * g @ a.T
    return expected


def assert_close_all(got: dict, want: dict, what: str, atol: float = 1e-6) -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))[:4]}"
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def test_adapters_cover_every_linear_layer_of_the_decoder(one_process) -> None:
    layers = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n in one_process["A"]}
    assert layers == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(one_process["A"]) == 2 * 7 and all(a.shape[0] == RANK for a in one_process["A"].values())


@pytest.mark.parametrize("mbs", [1, 4])
def test_adapter_gradients_equal_the_hand_written_formula_for_1_and_2_workers(
    one_process, two_ranks, hand_written, mbs
) -> None:
    assert all(g.abs().max() > 1e-5 for g in hand_written.values())
    assert_close_all(one_process[f"grad/{mbs}"], hand_written, "1 worker")
    for rank in range(WORLD):
        assert_close_all(two_ranks[rank][f"grad/{mbs}"], hand_written, f"2 workers, rank {rank}")


def test_only_the_adapters_have_gradients_and_optimizer_state(one_process, two_ranks) -> None:
    for out in (one_process, *two_ranks):
        assert all(".lora_" in name for name in out["grad/1"])
        # AdamW holds the adapters and state for them only
        assert out["optimizer_params"] == out["optimizer_states"] == len(out["A"]) + len(out["B"])


def test_reference_with_adapters_disabled_equals_the_base_model_exactly(one_process, two_ranks) -> None:
    for out in (one_process, *two_ranks):
        assert torch.equal(out["ref"], out["base"])
        assert not torch.allclose(out["adapted"], out["base"])  # the adapters did move the policy


def test_two_workers_train_the_adapters_as_one_process_does(one_process, two_ranks) -> None:
    for rank in range(WORLD):
        # AdamW steps of lr 1e-2 turn float summation-order noise into ~1e-5 of weight (see test_fsdp2_engine)
        assert_close_all(
            two_ranks[rank]["trained"], one_process["trained"], f"rank {rank} after 2 steps", 1e-4
        )
    torch.testing.assert_close(
        torch.cat([two_ranks[0]["ref"], two_ranks[1]["ref"][:3]]), one_process["ref"], rtol=1e-4, atol=1e-5
    )


def test_rollout_after_sync_generates_what_peft_merged_model_generates(one_process, two_ranks) -> None:
    from peft import get_peft_model
    from verity.engines.lora import peft_lora_config

    merged = {}
    for label, out in (("1 worker", one_process), ("2 workers", two_ranks[0])):
        peft_model = get_peft_model(tiny_qwen2(), peft_lora_config(LORA))
        with torch.no_grad():
            named = dict(peft_model.base_model.model.named_parameters())
            for name, value in out["trained"].items():
                named[name].copy_(value)
        model = peft_model.merge_and_unload().eval()
        batch = prompts()
        with torch.no_grad():
            generated = model.generate(
                **batch, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=VOCAB - 1
            )[:, P:]
        merged[label] = generated
        n_tensors, _ = out["sync"]
        assert n_tensors == len(dict(tiny_qwen2().named_parameters()))  # plain HF names, tied weight once
        for i in range(generated.shape[0]):
            got = out["responses"][i].tolist()
            want = generated[i].tolist()
            n = want.index(VOCAB - 1) + 1 if VOCAB - 1 in want else NEW_TOKENS
            assert got[:n] == want[:n], (label, i)
    assert torch.equal(
        two_ranks[1]["responses"], two_ranks[0]["responses"]
    )  # every rank's rollout got the same weights
