"""HF rollout generation with each prompt prefilled once per group against once per row.

    python packages/verity/benchmarks/bench_shared_prefill.py [--prompts 32] [--n 8] [--repeats 10]

The embedded default's architecture (randomly initialised), one torch thread, ``prompts``
arithmetic prompts x ``n`` samples, 8 new tokens (the quickstart's shape). The two variants
alternate after a warm-up; the medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from verity.rollout import HFRollout, SamplingParams, encode_prompts
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.tiny_model import build_tiny_qwen2_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer).eval()
    texts = [f"{(7 * i) % 90 + 10}+{(13 * i) % 90 + 10}=" for i in range(args.prompts)]
    batch = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in texts])
    params = SamplingParams(max_new_tokens=8, n=args.n, ignore_eos=True)
    rollout = HFRollout(model, tokenizer, sampling=params, seed=0)

    def run(share: bool) -> float:
        # the engine shares the prefill wherever it can; the baseline turns that off
        def prefill(*inputs: object, shared: bool = True) -> object:
            return HFRollout._prefill(rollout, *inputs, shared=shared and share)

        rollout._prefill = prefill
        start = time.perf_counter()
        rollout.generate(dict(batch))
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.repeats + 2):
        for share in (True, False):
            seconds = run(share)
            if i >= 2:
                times[share].append(seconds)
    once, each = statistics.median(times[True]), statistics.median(times[False])
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    print(
        f"{args.prompts} prompts x {args.n} samples, 8 new tokens (median of {args.repeats}, load {load}): "
        f"prefill once per prompt {once * 1000:.1f} ms, once per row {each * 1000:.1f} ms, "
        f"ratio {each / once:.2f}"
    )


if __name__ == "__main__":
    main()
