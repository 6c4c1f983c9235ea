"""One quickstart-shaped train step on two gloo processes: FSDP2 sharded vs replicated vs no collective.

    python packages/verity/benchmarks/bench_sharding.py [--rows 128] [--repeats 20]

Each of two processes (one torch thread each, as the quickstart's two workers) runs
``FSDP2Engine.train_step`` on its own ``rows`` rows of the embedded default's
architecture (randomly initialised; prompts and responses shaped as in
``bench_logprob_layouts.py``), in three layouts run one after another:

- ``full``: ``fsdp2.sharding=full`` over a 2-rank gloo group (per-layer all-gathers and
  reduce-scatters);
- ``replicate``: ``fsdp2.sharding=replicate`` over the same group (one gradient all-reduce
  per step);
- ``alone``: the same engine without a process group in each process — the compute
  floor, with no collective at all.

Prints each layout's median step time (the slower rank's) and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from two_processes import slower_rank_seconds

LAYOUTS = ("full", "replicate", "alone")


def _rank(rank: int, store_file: str, layout: str, rows: int, repeats: int, answers) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_logprob_layouts import quickstart_shaped_batch
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.batch import Batch
    from verity.engines.fsdp2 import FSDP2Engine
    from verity.engines.optim import OptimConfig
    from verity.workers.actor_rollout import make_actor_loss
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    torch.set_num_threads(1)
    if layout != "alone":
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    engine = FSDP2Engine(
        build_tiny_qwen2_for(CharTokenizer()),
        OptimConfig(lr=3e-5),
        total_steps=repeats + 3,
        device="cpu",
        sharding="replicate" if layout == "replicate" else "full",
    )
    micro, mask = quickstart_shaped_batch(rows, seed=rank)
    micro["response_mask"] = mask
    micro["advantages"] = torch.randn(rows, 1).expand(rows, mask.shape[1]).contiguous() * mask
    batch = Batch.from_dict(micro)
    loss = make_actor_loss(PolicyLossConfig(), KLConfig(), 0.0)

    def step() -> float:
        start = time.perf_counter()
        engine.train_step(batch, loss, rows)
        return time.perf_counter() - start

    for _ in range(3):
        step()
    answers.put((rank, statistics.median(step() for _ in range(repeats))))
    if layout != "alone":
        dist.destroy_process_group()


def run_layout(layout: str, rows: int, repeats: int) -> float:
    """The slower rank's median seconds per train step."""
    return slower_rank_seconds(_rank, layout, rows, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="rows per process (the quickstart: 128)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    seconds = {layout: run_layout(layout, args.rows, args.repeats) for layout in LAYOUTS}
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    print(
        f"2 processes x {args.rows} rows, train step (median of {args.repeats}, load average {load}): "
        + ", ".join(f"{layout} {s * 1000:.1f} ms" for layout, s in seconds.items())
    )
    print(
        f"full / replicate = {seconds['full'] / seconds['replicate']:.2f}, "
        f"replicate / alone = {seconds['replicate'] / seconds['alone']:.2f}"
    )


if __name__ == "__main__":
    main()
