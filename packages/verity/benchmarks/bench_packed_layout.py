"""Padded vs packed layout on long-tailed response lengths: log-prob pass and training pass, tokens/s.

    python packages/verity/benchmarks/bench_packed_layout.py [--rows 32] [--micro-batch 8]
        [--median 64] [--p99 1024] [--repeats 3] [--hidden 256] [--layers 4]

A randomly initialised Qwen2 (``--hidden`` wide, ``--layers`` deep, 8 query heads over 2 KV
heads, a 4096-token vocabulary), float32, one torch thread. ``--rows`` rows with prompts of
16-64 real tokens (left-padded) and responses whose lengths are lognormal with median
``--median`` and 99th percentile ``--p99`` tokens (right-padded to the longest), in random
order, cut into micro-batches of ``--micro-batch`` rows as an engine would. Each layout runs
the same micro-batches:

- ``padded``: :func:`verity.engines.logprobs.response_logprobs` (each micro-batch on its
  padding-free window: rows x its widest row);
- ``packed``: :func:`verity.engines.packed.packed_response_logprobs` (each micro-batch's real
  tokens back to back, attention within rows, the vocabulary head on response positions only).

Passes: ``logprob`` (no grad, as the old/reference log-probs) and ``train`` (forward and
backward of ``sum(logprobs * mask)``, the engine's training head). The layouts alternate
after a warm-up; the medians, real tokens per second and packed / padded speed-ups are printed,
with the largest difference between the layouts' log-probs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
from verity.engines.logprobs import response_logprobs
from verity.engines.packed import packed_response_logprobs

VOCAB = 4096


def long_tailed_batch(rows: int, median: int, p99: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts of 16-64 tokens, right-padded responses with lognormal lengths (``median``, ``p99``)."""
    g = torch.Generator().manual_seed(seed)
    sigma = math.log(p99 / median) / 2.326  # the 99th percentile of a standard normal
    normal = torch.randn(rows, generator=g, dtype=torch.float64)
    response_lens = (median * torch.exp(sigma * normal)).round().clamp(1, 4 * p99).long()
    prompt_lens = torch.randint(16, 65, (rows,), generator=g)
    prompt_width, response_width = int(prompt_lens.max()), int(response_lens.max())
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - prompt_lens[:, None]).long()
    response_mask = (torch.arange(response_width) < response_lens[:, None]).long()
    prompts = torch.randint(1, VOCAB, (rows, prompt_width), generator=g) * prompt_mask
    responses = torch.randint(1, VOCAB, (rows, response_width), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask.float(),
    }


def build_model(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config)


def micro_batches(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    rows = batch["input_ids"].shape[0]
    return [{k: v[s : s + size] for k, v in batch.items()} for s in range(0, rows, size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--median", type=int, default=64, help="median response length, tokens")
    parser.add_argument("--p99", type=int, default=1024, help="99th percentile of response length, tokens")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.hidden, args.layers)
    batch = long_tailed_batch(args.rows, args.median, args.p99)
    parts = micro_batches(batch, args.micro_batch)
    real_tokens = int(batch["attention_mask"].sum())
    window_positions = 0
    for part in parts:
        real = part["attention_mask"].bool()
        columns = real.any(0).nonzero()
        window_positions += part["input_ids"].shape[0] * int(columns[-1] - columns[0] + 1)
    lens = batch["response_mask"].sum(1)
    print(
        f"{args.rows} rows, micro-batches of {args.micro_batch}; response lengths lognormal, median "
        f"{args.median} / p99 {args.p99} (drawn: median {int(lens.median())}, max {int(lens.max())}); "
        f"{real_tokens} real tokens, {window_positions} padded window positions "
        f"({window_positions / real_tokens:.2f}x); Qwen2 {args.hidden} wide x {args.layers} layers, "
        f"float32, 1 thread"
    )

    layouts = {"padded": response_logprobs, "packed": packed_response_logprobs}

    def run(layout: str, train: bool) -> tuple[float, list[torch.Tensor]]:
        fn = layouts[layout]
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = []
        for part in parts:
            if train:
                logprobs, _ = fn(model, part, compute_entropy=True, entropy_grad=False)
                (logprobs * part["response_mask"]).sum().backward()
            else:
                with torch.no_grad():
                    logprobs, _ = fn(model, part, compute_entropy=True)
            out.append(logprobs.detach())
        return time.perf_counter() - start, out

    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    for train in (False, True):
        name = "train (forward+backward)" if train else "logprob (no grad)"
        times: dict[str, list[float]] = {layout: [] for layout in layouts}
        results: dict[str, list[torch.Tensor]] = {}
        for layout in layouts:  # warm-up
            run(layout, train)
        for _ in range(args.repeats):
            for layout in layouts:
                seconds, results[layout] = run(layout, train)
                times[layout].append(seconds)
        median = {layout: statistics.median(t) for layout, t in times.items()}
        diff = max(
            float((a - b).abs().max()) for a, b in zip(results["padded"], results["packed"], strict=True)
        )
        print(
            f"{name}: "
            + ", ".join(
                f"{layout} {median[layout]:.2f} s ({real_tokens / median[layout]:.0f} tokens/s)"
                for layout in layouts
            )
            + f"; packed / padded speed-up {median['padded'] / median['packed']:.2f}x; "
            f"max |logprob difference| {diff:.1e} (median of {args.repeats}, load average {load})"
        )


if __name__ == "__main__":
    main()
