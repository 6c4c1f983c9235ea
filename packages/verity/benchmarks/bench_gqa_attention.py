"""HF rollout decoding with grouped key/value heads read in place against transformers' repeat.

    python packages/verity/benchmarks/bench_gqa_attention.py [--hidden 512] [--layers 8] [--rows 128]
        [--new-tokens 64] [--dtype bfloat16] [--repeats 3]

A random-init Qwen2 (8 query / 4 key-value heads unless told; the TRL bench's 512x8 shape by
default), one torch thread, ``rows`` left-padded arithmetic prompts (every 8 rows one prompt,
as GRPO groups), ``new-tokens`` sampled tokens with EOS ignored. The two sides alternate after
a warm-up: ``grouped`` is the engine as it runs (:mod:`verity.rollout.gqa_attention`),
``repeat`` the same engine with transformers' ``sdpa`` (which copies every key/value head
once per query head it serves when there is a mask). Prints the medians, their ratio, and
whether the two sides sampled the same tokens with the same log-probs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import nullcontext

import torch
from verity.data.char_tokenizer import CharTokenizer
from verity.data.tiny_model import build_tiny_qwen2_for
from verity.rollout import HFRollout, SamplingParams, encode_prompts
from verity.rollout import hf_rollout as hf_rollout_module
from verity.rollout.gqa_attention import grouped_sdpa


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

    def run(grouped: bool) -> tuple[float, dict[str, torch.Tensor]]:
        switch = grouped_sdpa if grouped else (lambda model: nullcontext(False))
        hf_rollout_module.grouped_sdpa = switch  # what HFRollout.generate enters around its decode
        rollout = HFRollout(model, tokenizer, sampling=params, seed=0)
        start = time.perf_counter()
        out = rollout.generate(dict(batch))
        return time.perf_counter() - start, {k: out[k] for k in ("responses", "rollout_logprobs")}

    times: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, dict[str, torch.Tensor]] = {}
    try:
        for i in range(args.repeats + 1):
            for grouped in (True, False):
                seconds, outputs[grouped] = run(grouped)
                if i >= 1:
                    times[grouped].append(seconds)
    finally:
        hf_rollout_module.grouped_sdpa = grouped_sdpa
    same = all(torch.equal(outputs[True][k], outputs[False][k]) for k in outputs[True])
    grouped_s, repeat_s = statistics.median(times[True]), statistics.median(times[False])
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    print(
        f"{args.rows} rows x {args.new_tokens} new tokens, hidden {args.hidden} x {args.layers} layers, "
        f"{args.heads}/{args.kv_heads} heads, {args.dtype} (median of {args.repeats}, load {load}): "
        f"grouped {grouped_s:.3f} s, repeat {repeat_s:.3f} s, ratio {repeat_s / grouped_s:.2f}; "
        f"same tokens and log-probs: {same}"
    )


if __name__ == "__main__":
    main()
