"""HF rollout decoding with grouped key/value heads read in place against transformers' repeat.

    python packages/verity/benchmarks/bench_gqa_attention.py [--hidden 512] [--layers 8] [--rows 128]
        [--new-tokens 64] [--dtype bfloat16] [--repeats 3]

A random-init Qwen2 (8 query / 4 key-value heads unless told; the TRL bench's 512x8 shape by
default), one torch thread, ``rows`` left-padded arithmetic prompts (every 8 rows one prompt,
as GRPO groups), ``new-tokens`` sampled tokens with EOS ignored. The two sides alternate after
a warm-up: ``grouped`` is the engine as it runs (:mod:`verity.rollout.gqa_attention`; its
name says whether its decode steps take the two float32 matmuls, as in bf16 on a CPU without
AMX), ``fused`` the same with every call on the fused kernel (run only where ``grouped``
decodes by matmuls), ``repeat`` the same engine with transformers' ``sdpa`` (which copies every
key/value head once per query head it serves when there is a mask). Prints the medians and
their ratios, whether ``fused`` and ``repeat`` sampled the same tokens with the same
log-probs, and how far the matmul decode's log-probs are from theirs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import nullcontext

import torch
from verity.rollout import HFRollout, SamplingParams, encode_prompts, gqa_attention
from verity.rollout import hf_rollout as hf_rollout_module
from verity.rollout.gqa_attention import grouped_attention_name, grouped_sdpa, matmul_decode
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.tiny_model import build_tiny_qwen2_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(
        tokenizer,
        seed=0,
        max_pos=256,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=3 * args.hidden,
    )
    model = model.to(getattr(torch, args.dtype)).eval()
    prompts = max(args.rows // 8, 1)
    texts = [f"{(7 * i) % 900 + 10}+{(13 * i) % 90 + 10}=" for i in range(prompts)]
    batch = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in texts])
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.rows // prompts, ignore_eos=True)

    def run(side: str) -> tuple[float, dict[str, torch.Tensor]]:
        switch = (lambda model: nullcontext(False)) if side == "repeat" else grouped_sdpa
        hf_rollout_module.grouped_sdpa = switch  # what HFRollout.generate enters around its decode
        gqa_attention._has_amx_tiles = (lambda: True) if side == "fused" else has_amx_tiles
        rollout = HFRollout(model, tokenizer, sampling=params, seed=0)
        start = time.perf_counter()
        out = rollout.generate(dict(batch))
        return time.perf_counter() - start, {k: out[k] for k in ("responses", "rollout_logprobs")}

    has_amx_tiles = gqa_attention._has_amx_tiles
    dtype = getattr(torch, args.dtype)
    sides = ["grouped", "fused", "repeat"] if matmul_decode(dtype) else ["grouped", "repeat"]
    times: dict[str, list[float]] = {side: [] for side in sides}
    outputs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for i in range(args.repeats + 1):
            for side in sides:
                seconds, outputs[side] = run(side)
                if i >= 1:
                    times[side].append(seconds)
    finally:
        hf_rollout_module.grouped_sdpa = grouped_sdpa
        gqa_attention._has_amx_tiles = has_amx_tiles
    exact_side = "fused" if "fused" in sides else "grouped"
    same = all(torch.equal(outputs[exact_side][k], outputs["repeat"][k]) for k in outputs["repeat"])
    median = {side: statistics.median(times[side]) for side in sides}
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    line = (
        f"{args.rows} rows x {args.new_tokens} new tokens, hidden {args.hidden} x {args.layers} layers, "
        f"{args.heads}/{args.kv_heads} heads, {args.dtype} (median of {args.repeats}, load {load}): "
        + ", ".join(f"{side} {median[side]:.3f} s" for side in sides)
        + f"; grouped is {grouped_attention_name(dtype)}"
        + f"; ratio repeat/grouped {median['repeat'] / median['grouped']:.2f}"
    )
    if "fused" in sides:
        matmul, fused = outputs["grouped"], outputs["fused"]
        same_so_far = (matmul["responses"] == fused["responses"]).int().cumprod(dim=1).bool()
        agree = same_so_far[:, -1].float().mean().item()
        gap = (matmul["rollout_logprobs"] - fused["rollout_logprobs"])[same_so_far].abs().max().item()
        line += (
            f", fused/grouped {median['fused'] / median['grouped']:.2f}; matmul decode vs fused kernel: "
            f"{agree:.0%} of rows the same tokens, log-probs within {gap:.1e} "
            "up to each row's first differing token"
        )
    print(line + f"; {exact_side} and repeat: same tokens and log-probs: {same}")


if __name__ == "__main__":
    main()
