"""Hung reward samples: wall time of one scoring call, pool widening on vs off, side by side.

    python packages/verity/benchmarks/bench_reward_timeouts.py [--hung 8] [--timeout 2] [--ok 120]

Scores ``ok`` instant samples plus ``hung`` samples whose reward function sleeps forever,
with one reward worker and ``timeout_s``, twice in this process: with the pool allowed
to widen while samples stall (the default), and with ``max_workers=1`` (hung samples
time out one after another). Prints both wall times and their ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from verity.rewards import RewardManager

REWARD = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(3600)
    return float(solution_str == ground_truth)
"""


def wall_seconds(path: Path, rows: list[dict], timeout_s: float, max_workers: int | None) -> float:
    """Seconds of one ``score`` call on a warm one-worker manager."""
    config = {
        "num_workers": 1,
        "timeout_s": timeout_s,
        "custom_path": str(path),
        "max_failure_rate": 1.0,
        "max_workers": max_workers,
    }
    with RewardManager(config) as manager:
        manager.score(rows[:1])  # start the worker outside the clock
        start = time.perf_counter()
        manager.score(rows)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hung", type=int, default=8)
    parser.add_argument("--ok", type=int, default=120)
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "reward.py"
        path.write_text(REWARD)
        rows = [{"data_source": "x", "solution_str": "1", "ground_truth": "1"} for _ in range(args.ok)]
        rows += [{"data_source": "x", "solution_str": "hang", "ground_truth": "1"} for _ in range(args.hung)]
        widening = wall_seconds(path, rows, args.timeout, None)
        serial = wall_seconds(path, rows, args.timeout, 1)
    print(f"{args.ok} ok + {args.hung} hung samples, timeout_s={args.timeout:g}, one reward worker")
    print(f"  pool widens while samples hang: {widening:6.2f} s")
    print(f"  hung samples one after another: {serial:6.2f} s")
    print(f"  ratio: {serial / widening:.1f}x")


if __name__ == "__main__":
    main()
