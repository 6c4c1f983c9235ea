"""Drawing one token per row: verity's inverse-CDF sampler against ``torch.multinomial``, side by side.

    python packages/verity/benchmarks/bench_sampling.py [--rows 128] [--vocab 260] [--repeats 2000]

One torch thread; ``rows`` rows of random logits over ``vocab`` tokens (260: the embedded
default's character vocabulary; try 151936 for Qwen2.5's). Both draw from the same
``softmax`` probabilities with their own generator; the two alternate in blocks and the
median block time of each, and their ratio, are printed. Also printed: each method's total
variation distance from the probabilities over the draws, as a check that both sample the
same distribution.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from verity.rollout.sampling import draw_categorical


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=260)
    parser.add_argument("--repeats", type=int, default=2000, help="draws per block")
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    probs = torch.softmax(torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 4, -1)
    methods = {
        "inverse CDF (verity)": lambda g: draw_categorical(probs, g),
        "torch.multinomial": lambda g: torch.multinomial(probs, 1, generator=g).squeeze(-1),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    counts = {name: torch.zeros(args.rows, args.vocab, dtype=torch.float64) for name in methods}
    for block in range(args.blocks + 1):  # block 0 warms up
        for name, draw in methods.items():
            g = torch.Generator().manual_seed(block)
            start = time.perf_counter()
            drawn = [draw(g) for _ in range(args.repeats)]
            seconds = time.perf_counter() - start
            if block:
                times[name].append(seconds / args.repeats * 1000)
                rows = torch.arange(args.rows).repeat(args.repeats)
                counts[name].index_put_((rows, torch.cat(drawn)), torch.ones(rows.numel(), dtype=torch.float64), accumulate=True)
    for name in methods:
        freq = counts[name] / counts[name].sum(-1, keepdim=True)
        tv = 0.5 * (freq - probs.double()).abs().sum(-1).mean()
        print(f"{name:22s} {statistics.median(times[name]):.4f} ms per draw of {args.rows} rows; TV distance {tv:.4f}")
    slow, fast = (statistics.median(times[n]) for n in ("torch.multinomial", "inverse CDF (verity)"))
    print(f"speed-up: {slow / fast:.2f}x")


if __name__ == "__main__":
    main()
