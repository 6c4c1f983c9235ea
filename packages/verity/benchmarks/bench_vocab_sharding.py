"""``fsdp2.shard_vocab`` against the plain FSDP2 root unit: train-step time and peak memory, side by side.

    python packages/verity/benchmarks/bench_vocab_sharding.py [--ranks 2] [--layers 6] [--rows 8]
                                                               [--micro 4] [--repeats 4]

``--ranks`` gloo processes (one torch thread each) build a Qwen2 model of Qwen2.5-0.5B's widths
and 151,936-token vocabulary (tied embeddings, ``--layers`` layers, random weights, float32) twice,
sharded ``full``: with the embedding in FSDP2's root unit (``plain``) and kept in row shards
(``shard_vocab``). Each rank trains on its own ``--rows`` rows of 32 prompt + 16 response tokens,
``--micro`` rows per micro-batch; the two engines take turns, ``--repeats`` steps each after one
warm-up step. Prints each variant's median step time (the slower rank's), the ratio, and each
variant's resident-set high-water mark over its steps (the larger of the ranks; both engines live
in every process, so the two peaks differ by what each variant's step adds, not by its state).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("plain", "shard_vocab")


def _peak_rss_gib() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 2**20


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rank(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verity.engines import FSDP2Engine, OptimConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=args.ranks)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    engines = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        engines[variant] = FSDP2Engine(
            Qwen2ForCausalLM(config), OptimConfig(lr=1e-6), shard_vocab=variant == "shard_vocab"
        )
    g = torch.Generator().manual_seed(rank)
    rows, prompt, response = args.rows, 32, 16
    ids = torch.randint(0, 151936, (rows, prompt + response), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(prompt + response).expand(rows, -1).clone(),
        "responses": ids[:, prompt:],
        "response_mask": torch.ones(rows, response, dtype=torch.long),
        "advantages": torch.randn(rows, response, generator=g),
    }

    def loss(mb, logprobs, entropy, agg):
        return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    peaks = dict.fromkeys(VARIANTS, 0.0)
    for step in range(args.repeats + 1):
        for variant in VARIANTS:
            _reset_peak()
            dist.barrier()
            start = time.perf_counter()
            engines[variant].train_step(batch, loss, micro_batch_size=args.micro)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank sets the step
            peak = torch.tensor([_peak_rss_gib()])
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            if step:  # the first step of each is a warm-up
                times[variant].append(float(elapsed))
                peaks[variant] = max(peaks[variant], float(peak))
    if rank == 0:
        torch.save({"times": times, "peaks": peaks}, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{os.path.join(tmp, 'store')}", os.path.join(tmp, "result.pt")
        mp.spawn(_rank, args=(args, init, out), nprocs=args.ranks, join=True)
        result = torch.load(out)
    medians = {v: statistics.median(result["times"][v]) for v in VARIANTS}
    print(
        f"{args.ranks} ranks, {args.layers} layers, {args.rows} rows x 48 tokens per rank, {args.micro} per micro-batch"
    )
    for variant in VARIANTS:
        print(
            f"  {variant:12s} step {medians[variant] * 1e3:8.0f} ms   peak {result['peaks'][variant]:.2f} GiB"
        )
    print(f"  shard_vocab / plain: time {medians['shard_vocab'] / medians['plain']:.2f}x")


if __name__ == "__main__":
    main()
