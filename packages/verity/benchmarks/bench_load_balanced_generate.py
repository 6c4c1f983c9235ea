"""A generate call over 2 rollout replicas: load-balanced chunks vs the equal split, side by side.

    python packages/verity/benchmarks/bench_load_balanced_generate.py [--prompts 32] [--n 4]
        [--ms-per-token 0.5] [--slow 2.0] [--rounds 3] [--chunk-rows 0]

Two Ray workers (a private local cluster) run the worker group's real dispatch
(:mod:`verity.controller.balanced_call`, ``WorkerGroup``) and the rollout side's ``generate_batch``
over a stand-in engine whose call takes ``(sum of the rows' response lengths) x ms-per-token``
milliseconds (a throughput-bound engine: continuous batching makes a call's time about its tokens;
it sleeps, so the figures measure the dispatch and not this machine's cores). Response lengths are
long-tailed (lognormal, median 64 and 99th percentile 1024 tokens, capped at 1536) and drawn per
prompt group, the same for both layouts. Two settings:

- ``equal``: both replicas at the same speed (what the chunks cost: more calls and round trips);
- ``one slow``: the second replica ``--slow`` times slower (a busier node, a slower device).

Each setting runs ``split`` (one equal part per replica) and ``load`` (chunks of whole groups, the
next to whichever replica finishes first) in turn, the order alternating by round; prints the wall
seconds (median over the rounds), the ratio split / load, and the rows each replica generated.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def lengths_by_group(prompts: int, seed: int = 0) -> torch.Tensor:
    """``[prompts]`` response lengths in tokens, lognormal with median 64 and p99 1024, capped at 1536."""
    import math

    g = torch.Generator().manual_seed(seed)
    mu, sigma = math.log(64), (math.log(1024) - math.log(64)) / 2.326
    draws = torch.exp(mu + sigma * torch.randn(prompts, generator=g))
    return draws.clamp(1, 1536).round().long()


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (arguments in the module docstring) and print its table."""
    args = _parse(argv)
    from verity.batch import Batch
    from verity.controller import (
        Collect,
        Dispatch,
        ResourcePool,
        Worker,
        WorkerGroup,
        init_ray,
        register,
        shutdown_ray,
    )
    from verity.controller.load_balance import LOAD_BALANCE_META, LoadBalanceRequest
    from verity.rollout.base import RolloutEngine
    from verity.workers.rollout_side import generate_batch

    class TimedEngine(RolloutEngine):
        name = "timed"

        def __init__(self) -> None:
            self.ms_per_token = 0.0

        def set_seed(self, seed: int) -> None:
            pass

        def load_weights(self, named_tensors) -> int:
            return 0

        def generate(self, batch, params=None):
            time.sleep(float(batch["length"].sum()) * self.ms_per_token / 1000)
            return batch.select(*batch.keys())

    class TimedWorker(Worker):
        def __init__(self) -> None:
            super().__init__()
            self.engine = TimedEngine()

        @register(Dispatch.BROADCAST, collect=Collect.NONE)
        def set_speed(self, ms_per_token: float, slow: float) -> None:
            self.engine.ms_per_token = ms_per_token * (slow if self.rank == 1 else 1.0)

        @register(Dispatch.DP_SPLIT, check_schema=False)
        def generate(self, batch: Batch) -> Batch:
            out = generate_batch(self.engine, batch, chunk_rows=10_000, dp_rank=self.rank)
            out["replica"] = torch.full((len(out),), self.rank)
            return out

    init_ray(num_cpus=2, object_store_memory=200 * 1024**2)
    pool = ResourcePool([2], cpus_per_bundle=0.5, name="bench", timeout_s=60)
    group = WorkerGroup(pool, TimedWorker)
    try:
        rows = args.prompts * args.n
        per_group = lengths_by_group(args.prompts)
        base = Batch.from_dict(
            {
                "group": torch.arange(args.prompts).repeat_interleave(args.n),
                "length": per_group.repeat_interleave(args.n),
            },
            meta={"seed": 1},
        )
        chunk_rows = args.chunk_rows or None
        print(
            f"{rows} rows ({args.prompts} prompts x {args.n}); response tokens {int(base['length'].sum())}, "
            f"longest {int(per_group.max())}; {args.ms_per_token} ms a token"
        )
        for setting, slow in (("equal", 1.0), ("one slow", args.slow)):
            group.set_speed(args.ms_per_token, slow)
            seconds: dict[str, list[float]] = {"split": [], "load": []}
            shares: dict[str, list[int]] = {}
            for round_index in range(args.rounds + 1):  # round 0 warms up
                order = ("split", "load") if round_index % 2 else ("load", "split")
                for layout in order:
                    batch = base.select(*base.keys())
                    if layout == "load":
                        batch.meta[LOAD_BALANCE_META] = LoadBalanceRequest(chunk_rows=chunk_rows)
                    started = time.perf_counter()
                    out = group.generate(batch)
                    took = time.perf_counter() - started
                    if round_index:
                        seconds[layout].append(took)
                    shares[layout] = [int((out["replica"] == r).sum()) for r in (0, 1)]
            split, load = statistics.median(seconds["split"]), statistics.median(seconds["load"])
            print(
                f"{setting:>9}: split {split:6.2f} s (rows {shares['split']}), load {load:6.2f} s "
                f"(rows {shares['load']}); split / load = {split / load:.2f}"
            )
    finally:
        group.shutdown()
        pool.remove()
        shutdown_ray()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--ms-per-token", type=float, default=0.5)
    parser.add_argument("--slow", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-rows", type=int, default=0, help="0: the default (8 chunks per replica)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
