"""The tiny Qwen2 models, batches and losses shared by the engine, weight-sync and critic tests.

A plain module, not conftest fixtures: the multi-process tests build these inside spawned
workers, which import the test module (and so this one) afresh.
"""

from __future__ import annotations

import torch

VOCAB, P, R = 100, 5, 6  # vocabulary, prompt length, response length


def tiny_qwen2_config(**overrides):
    """A 2-layer, 64-wide Qwen2 config over ``VOCAB`` tokens; ``overrides`` set further fields."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )


def tiny_qwen2(seed: int = 0, tie_word_embeddings: bool = True):
    """The tiny Qwen2 causal LM, initialised from ``torch.manual_seed(seed)``."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_qwen2_config(tie_word_embeddings=tie_word_embeddings))


def tiny_moe_config(**overrides):
    """A 2-layer, 64-wide Qwen3-MoE config (8 experts of width 32, top-2) over ``VOCAB`` tokens."""
    from transformers import Qwen3MoeConfig

    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return Qwen3MoeConfig(**settings)


def tiny_moe(seed: int = 0, **overrides):
    """The tiny Qwen3-MoE causal LM (float32), initialised from ``torch.manual_seed(seed)``; the router
    and the q/k norms get random weights so that routing and normalisation are exercised."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return model


def tiny_value_model(seed: int = 0):
    """The tiny Qwen2 backbone with a scalar head (a critic), as ``workers.critic`` builds it."""
    from transformers import Qwen2ForTokenClassification

    torch.manual_seed(seed)
    return Qwen2ForTokenClassification(tiny_qwen2_config(num_labels=1, classifier_dropout=0.0))


def make_padded_batch(rows: int = 7, seed: int = 1) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses of varying length, random advantages."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, P + 1, (rows,), generator=g)
    response_lens = torch.randint(1, R + 1, (rows,), generator=g)
    prompts = torch.randint(1, VOCAB, (rows, P), generator=g)
    responses = torch.randint(1, VOCAB, (rows, R), generator=g)
    prompt_mask = (torch.arange(P) >= P - prompt_lens[:, None]).long()
    response_mask = (torch.arange(R) < response_lens[:, None]).long()
    prompts = prompts * prompt_mask
    responses = responses * response_mask
    input_ids = torch.cat([prompts, responses], 1)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask.float(),
        "advantages": torch.randn(rows, R, generator=g),
    }


def make_grouped_batch(rows: int = 8, group: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    """GRPO-shaped rows: each left-padded prompt repeated ``group`` times, short right-padded responses.

    Prompts of 3-5 tokens and responses of 1-2, so that computing each prompt once
    (:mod:`verity.engines.shared_prompt`) saves positions in any micro-batch holding a whole group.
    """
    g = torch.Generator().manual_seed(seed)
    prompts_needed = -(-rows // group)
    prompt_lens = torch.randint(3, P + 1, (prompts_needed,), generator=g).repeat_interleave(group)[:rows]
    prompts = torch.randint(1, VOCAB, (prompts_needed, P), generator=g).repeat_interleave(group, 0)[:rows]
    response_lens = torch.randint(1, 3, (rows,), generator=g)
    responses = torch.randint(1, VOCAB, (rows, R), generator=g)
    prompt_mask = (torch.arange(P) >= P - prompt_lens[:, None]).long()
    response_mask = (torch.arange(R) < response_lens[:, None]).long()
    prompts, responses = prompts * prompt_mask, responses * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask.float(),
        "advantages": torch.randn(rows, R, generator=g),
    }


def initial_logprobs(batch: dict[str, torch.Tensor], model=None) -> torch.Tensor:
    """``[B, R]`` log-probs of ``batch["responses"]`` under ``model`` (default: ``tiny_qwen2()``), no grad."""
    model = model if model is not None else tiny_qwen2()
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits[:, P - 1 : P + R - 1]
    return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def make_unpadded_batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Full-length prompts and responses (every mask all ones), no advantages."""
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(1, VOCAB, (rows, R), generator=g)
    input_ids = torch.cat([torch.randint(1, VOCAB, (rows, P), generator=g), responses], 1)
    attention_mask = torch.ones_like(input_ids)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": torch.ones(rows, R),
    }


def seq_mean_token_mean_loss(mb, logprobs, entropy, agg):
    """sum_rows(token-mean of the row's -logprob * advantage) / global_seqs."""
    mask = mb["response_mask"]
    per_row = (-(logprobs * mb["advantages"]) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_row.sum() / agg.global_seqs, {}


def push_up_loss(mb, logprobs, entropy, agg):
    """-sum_tokens(logprob) / global_tokens: raise the probability of every response token."""
    return -(logprobs * mb["response_mask"]).sum() / agg.global_tokens, {}


def save_char_qwen2(
    folder,
    seed: int = 0,
    *,
    hidden: int = 128,
    layers: int = 2,
    max_pos: int = 256,
    initializer_range: float = 0.5,
):
    """A tiny Qwen2 over the character tokenizer, saved with ``save_pretrained`` (model + tokenizer).

    ``initializer_range`` is large on purpose: a random model's next-token logits are then far
    apart, so greedy decoding does not hinge on float rounding (two engines' kernels differ in
    the last bits). 4 query heads: head size ``hidden / 4`` (vLLM's CPU attention takes 32, not 16).
    Returns ``(model, tokenizer)``; the model is in eval mode, float32.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verity_toyworld.char_tokenizer import CharTokenizer

    tokenizer = CharTokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer
