"""FSDP2Engine on CUDA: bf16 mixed precision (needs a GPU; skipped elsewhere)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tiny_models import make_unpadded_batch, push_up_loss, tiny_qwen2
from verity.engines import FSDP2Engine, OptimConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_logprobs_close_to_fp32_and_training_is_finite():
    batch = make_unpadded_batch(4, seed=1)
    fp32 = FSDP2Engine(tiny_qwen2(tie_word_embeddings=False), None, device="cuda", mixed_precision=False)
    bf16 = FSDP2Engine(tiny_qwen2(tie_word_embeddings=False), OptimConfig(lr=1e-3), device="cuda")
    assert bf16.mixed_precision
    lp32, _ = fp32.compute_logprobs(batch, 2)
    lp16, ent16 = bf16.compute_logprobs(batch, 2)
    assert lp16.dtype == torch.float32 and lp16.device.type == "cpu"
    assert torch.allclose(lp16, lp32, atol=5e-2)
    metrics = bf16.train_step(batch, push_up_loss, 2)
    assert torch.isfinite(torch.tensor([metrics["loss"], metrics["grad_norm"]])).all()
    assert next(bf16.model.parameters()).dtype == torch.float32  # master weights stay fp32


def test_fused_loss_head_on_cuda_matches_the_autograd_head():
    from verity.engines.logprobs import logprobs_and_entropy_from_logits

    torch.manual_seed(0)
    base = (torch.randn(3, 50, 1000, device="cuda") * 3).to(torch.bfloat16)
    labels = torch.randint(0, 1000, (3, 50), device="cuda")
    weights = torch.randn(3, 50, device="cuda")
    results = []
    for entropy_grad in (True, False):  # True: the autograd head; False: verity.engines.fused_logprobs
        logits = base.clone().requires_grad_()
        lp, ent = logprobs_and_entropy_from_logits(logits, labels, entropy_grad=entropy_grad, chunk_tokens=37)
        (lp * weights).sum().backward()
        results.append((lp.detach(), ent.detach(), logits.grad.float()))
    (lp_a, ent_a, grad_a), (lp_f, ent_f, grad_f) = results
    assert torch.allclose(lp_a, lp_f, atol=1e-4) and torch.allclose(ent_a, ent_f, atol=1e-3)
    assert torch.allclose(grad_a, grad_f, atol=1e-2)  # both written in bf16


def test_generate_answers_on_the_host_when_the_rollout_ran_on_cuda():
    from types import SimpleNamespace

    from verity.batch import Batch
    from verity.workers.rollout_side import rows_for_driver

    rows = Batch.from_dict({"responses": torch.ones(2, 3, dtype=torch.long, device="cuda")})
    out = rows_for_driver(SimpleNamespace(), rows, 0)  # no prompt-aligned key: nothing kept back
    assert out["responses"].device.type == "cpu"


def test_rows_generated_on_cuda_are_scored_on_the_host() -> None:
    from verity.batch import Batch
    from verity.config import load_config
    from verity.workers.rollout_side import RowScorer

    mask = torch.ones(2, 3, dtype=torch.long, device="cuda")
    rows = Batch.from_dict(
        {"responses": torch.ones(2, 3, dtype=torch.long, device="cuda"), "response_mask": mask},
        non_tensors={
            "response_text": ["#### 4", "#### 5"],
            "data_source": ["openai/gsm8k"] * 2,
            "ground_truth": ["4", "4"],
        },
    )
    scored = RowScorer(load_config(["reward.placement=workers"]), tokenizer=None).score(rows)
    assert scored["scores"].tolist() == [1.0, 0.0]
    assert {scored[k].device.type for k in scored.tensor_keys()} == {"cpu"}


def test_compiled_loss_head_on_cuda_matches_the_eager_head():
    from verity.engines.fused_logprobs import chosen_token_logprobs

    torch.manual_seed(0)
    base = (torch.randn(300, 5000, device="cuda") * 3).to(torch.bfloat16)
    labels = torch.randint(0, 5000, (300,), device="cuda")
    weights = torch.randn(300, device="cuda")
    results = {}
    for compiled in (False, True):  # eager chunked (fused_logprobs) and Triton (compiled_head)
        logits = base.clone().requires_grad_()
        lp, ent = chosen_token_logprobs(logits, labels, chunk_tokens=64, compiled=compiled)
        (lp * weights).sum().backward()
        results[compiled] = (lp.detach(), ent, logits.grad)
    (lp_e, ent_e, grad_e), (lp_c, ent_c, grad_c) = results[False], results[True]
    assert grad_c.dtype == torch.bfloat16
    assert torch.allclose(lp_c, lp_e, atol=1e-4) and torch.allclose(ent_c, ent_e, atol=1e-3)
    assert torch.allclose(grad_c.float(), grad_e.float(), atol=1e-2)
    with torch.no_grad():  # a row's value does not depend on the rows beside it
        part, _ = chosen_token_logprobs(base[7:70], labels[7:70], compiled=True)
    assert torch.equal(part, lp_c[7:70])


def test_compiled_layers_and_head_train_on_cuda():
    batch = make_unpadded_batch(4, seed=1)
    eager = FSDP2Engine(tiny_qwen2(tie_word_embeddings=False), OptimConfig(lr=1e-3), device="cuda")
    compiled = FSDP2Engine(
        tiny_qwen2(tie_word_embeddings=False), OptimConfig(lr=1e-3), device="cuda", compile_layers=True
    )
    assert compiled.compiled_head and compiled.compiled_layers == 2
    lp_e, _ = eager.compute_logprobs(batch, 2)
    lp_c, _ = compiled.compute_logprobs(batch, 2)
    assert torch.allclose(lp_c, lp_e, atol=5e-2)
    metrics = compiled.train_step(batch, push_up_loss, 2)
    assert torch.isfinite(torch.tensor([metrics["loss"], metrics["grad_norm"]])).all()


def test_triton_and_inductor_loss_heads_agree_on_a_real_vocabulary():
    from verity.engines import compiled_head
    from verity.engines.fused_logprobs import chosen_token_logprobs

    torch.manual_seed(0)
    base = (torch.randn(512, 151_936, device="cuda") * 3).to(torch.bfloat16)  # a tail block past 37 x 4096
    base[3, :1000] = -30.0
    labels = torch.randint(0, 151_936, (512,), device="cuda")
    weights = torch.randn(512, device="cuda")
    results = {}
    try:
        for kernels in ("inductor", "triton"):
            compiled_head.use_kernels(kernels)
            logits = base.clone().requires_grad_()
            lp, ent = chosen_token_logprobs(logits, labels, compiled=True)
            (lp * weights).sum().backward()
            results[kernels] = (lp.detach(), ent, logits.grad.float())
    finally:
        compiled_head.use_kernels("auto")
    (lp_i, ent_i, grad_i), (lp_t, ent_t, grad_t) = results["inductor"], results["triton"]
    assert torch.allclose(lp_t, lp_i, atol=1e-4) and torch.allclose(ent_t, ent_i, atol=1e-3)
    assert torch.allclose(grad_t, grad_i, atol=1e-3)
    assert grad_t.abs().sum() > 0


def _third_step_gradients(batch: dict, variants: list[dict]) -> tuple[list[FSDP2Engine], list[float]]:
    """One compiled engine per variant (eager attention, lr 1e-9), two steps each, then a third
    forward + backward: the engines, their gradients left in place, and the third losses."""
    engines = [
        FSDP2Engine(
            tiny_qwen2(tie_word_embeddings=False),
            OptimConfig(lr=1e-9),
            device="cuda",
            compile_layers=True,
            attn_implementation="eager",
            **variant,
        )
        for variant in variants
    ]
    for engine in engines:
        for _ in range(2):
            engine.train_step(batch, push_up_loss, 2)
    return engines, [engine.forward_backward(batch, push_up_loss, 2)["loss"] for engine in engines]


def test_cuda_graphs_give_the_compiled_layers_gradients():
    """Four micro-batches a step: warm-up, recording, then replays accumulating into the gradients.

    lr 1e-9 keeps the weights (AdamW moves each by ~lr), so the third step's gradients of
    both engines are comparable; they would be 3x too large if a step did not zero them.
    Eager attention: with SDPA the first layer's attention backward rounds differently
    under the graphs (up to 1e-3 of the largest gradient, measured on an H200), as a
    different kernel choice would; the other gradients agreed within 1e-9.
    """
    batch = make_unpadded_batch(8, seed=1)
    engines, losses = _third_step_gradients(batch, [{"cuda_graphs": False}, {"cuda_graphs": True}])
    assert engines[1].cuda_graphs and not engines[0].cuda_graphs
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    for (name, plain), (_, graphed) in zip(
        engines[0].model.named_parameters(), engines[1].model.named_parameters(), strict=True
    ):
        assert torch.allclose(plain.grad, graphed.grad, rtol=1e-3, atol=1e-6), name
    lp_plain, _ = engines[0].compute_logprobs(batch, 2)  # no-grad passes: the graph-free function
    lp_graphed, _ = engines[1].compute_logprobs(batch, 2)
    assert torch.allclose(lp_plain, lp_graphed, atol=1e-4)


def test_cuda_graphs_learn():
    batch = make_unpadded_batch(8, seed=1)
    engine = FSDP2Engine(
        tiny_qwen2(tie_word_embeddings=False),
        OptimConfig(lr=1e-2),
        device="cuda",
        compile_layers=True,
        cuda_graphs=True,
    )
    losses = [engine.train_step(batch, push_up_loss, 2)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] and all(map(math.isfinite, losses)), losses
