"""Megatron MoE actor update at expert parallelism 1 and 2 on 2 gloo ranks: tokens/s, side by side.

    python packages/verity/benchmarks/bench_moe_update.py [--layers 4] [--experts 16] [--hidden 256]
                                                           [--rows 8] [--micro 4] [--repeats 3] [--rounds 2]

Two gloo processes (one torch thread each) build a Qwen3-MoE of ``--layers`` layers, ``--hidden``
wide, ``--experts`` experts of width ``--hidden`` (top-2), a 4,096-token vocabulary, random weights,
float32, as a ``MegatronEngine``: at EP=1 every rank holds every expert and all gradients are
summed over the 2 ranks; at EP=2 each rank holds half the experts and tokens travel to them by
all-to-all (expert gradients stay on their rank). Each rank trains its own ``--rows`` rows of
48 prompt + 16 response tokens, ``--micro`` rows per micro-batch, one optimizer step per update.
The two layouts take turns for ``--rounds`` rounds (each round builds the engine afresh, runs one
warm-up update, then ``--repeats`` timed ones). Prints each layout's median update time (the
slower rank's), its tokens/s (all tokens of both ranks per update), and EP=2 / EP=1.
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

LAYOUTS = (1, 2)
PROMPT, RESPONSE, VOCAB = 48, 16, 4096


def _model(args: argparse.Namespace):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=2,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.1)  # spread the tokens over the experts
    return model


def _batch(rank: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, VOCAB, (rows, PROMPT + RESPONSE), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(PROMPT + RESPONSE).expand(rows, -1).clone(),
        "responses": ids[:, PROMPT:],
        "response_mask": torch.ones(rows, RESPONSE),
        "advantages": torch.randn(rows, RESPONSE, generator=g),
    }


def _loss(mb, logprobs, entropy, agg):
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


def _rank(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    from verity.engines import OptimConfig
    from verity.engines.megatron import MegatronEngine, MegatronOptions

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    batch = _batch(rank, args.rows)
    times: dict[int, list[float]] = {ep: [] for ep in LAYOUTS}
    for _ in range(args.rounds):
        for ep in LAYOUTS:
            engine = MegatronEngine(
                _model(args), OptimConfig(lr=1e-6), MegatronOptions(expert_parallel_size=ep)
            )
            for step in range(args.repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                engine.train_step(batch, _loss, micro_batch_size=args.micro)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank sets the update
                if step:  # the first update of each engine is a warm-up
                    times[ep].append(float(elapsed))
            del engine
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{os.path.join(tmp, 'store')}", os.path.join(tmp, "result.pt")
        mp.spawn(_rank, args=(args, init, out), nprocs=2, join=True)
        times = torch.load(out)
    tokens = 2 * args.rows * (PROMPT + RESPONSE)
    medians = {ep: statistics.median(times[ep]) for ep in LAYOUTS}
    print(
        f"2 ranks, {args.layers} layers x {args.experts} experts (top-2), hidden {args.hidden}, "
        f"{args.rows} rows x {PROMPT + RESPONSE} tokens per rank, {args.micro} per micro-batch, "
        f"{len(times[1])} updates per layout"
    )
    for ep in LAYOUTS:
        print(f"  EP={ep}  update {medians[ep] * 1e3:8.0f} ms   {tokens / medians[ep]:9.0f} tokens/s")
    print(f"  EP=2 / EP=1 tokens/s: {medians[1] / medians[2]:.2f}x")


if __name__ == "__main__":
    main()
