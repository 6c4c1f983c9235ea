"""Reward throughput: verifications per second of RewardManager on this machine.

    python packages/verity/benchmarks/bench_rewards.py [--workers 2] [--n 2000]

Scores ``n`` synthetic responses per reward function (GSM8K strict, MATH boxed,
math-verify, DAPO, AIME) through a warm pool and prints verifications/s. Half the
responses are correct, a quarter wrong, a quarter without an answer.
"""

from __future__ import annotations

import argparse
import random
import time

from verity.rewards import RewardManager


def make_rows(data_source: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` scored-sample rows for ``data_source`` with a mix of right, wrong and missing answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        truth = a + b
        kind = rng.random()
        answer = truth if kind < 0.5 else truth + rng.randint(1, 9)
        body = f"We add {a} and {b}. Step: {a} + {b} = {answer}. "
        if data_source == "openai/gsm8k":
            text = body + (f"#### {answer:,}" if kind < 0.75 else "")
        elif data_source in ("lighteval/MATH", "math_verify"):
            text = body + (f"So the answer is $\\boxed{{{answer}}}$." if kind < 0.75 else "")
            if data_source == "math_verify" and kind < 0.25:
                text = body + f"So the answer is $\\boxed{{\\frac{{{2 * answer}}}{{2}}}}$."
        elif data_source == "math_dapo":
            text = body + (f"\nAnswer: {answer}" if kind < 0.75 else "")
        else:
            text = body + (f"\nAnswer: {answer % 1000:03d}" if kind < 0.75 else "")
            truth = truth % 1000
        rows.append({"data_source": data_source, "solution_str": text, "ground_truth": str(truth)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args()
    sources = ["openai/gsm8k", "lighteval/MATH", "math_verify", "math_dapo", "aime"]
    with RewardManager({"num_workers": args.workers, "timeout_s": 10.0}) as manager:
        manager.score(make_rows("math_verify", 2 * args.workers))  # start and warm the workers
        print(f"workers={args.workers} samples={args.n}")
        for source in sources:
            rows = make_rows(source, args.n)
            started = time.perf_counter()
            scores, extra, metrics = manager.score(rows)
            seconds = time.perf_counter() - started
            print(
                f"{source:16s} {args.n / seconds:9.1f} verifications/s  "
                f"mean={metrics['reward/mean']:.3f} timeouts={metrics['reward/timeouts']:.0f} "
                f"errors={metrics['reward/errors']:.0f}"
            )


if __name__ == "__main__":
    main()
