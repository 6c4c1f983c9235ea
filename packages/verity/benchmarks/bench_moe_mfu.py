"""MFU of a mixture-of-experts model's training step: active-parameter FLOPs against all-parameter FLOPs.

    python packages/verity/benchmarks/bench_moe_mfu.py [--hidden 256] [--layers 4] [--experts 16]
        [--top-k 2] [--rows 32] [--length 128] [--steps 5]

A random-init Qwen3-MoE (``expert_intermediate = hidden``), one torch thread, ``rows`` rows of
``length`` tokens trained by the FSDP2 engine in one process (forward + backward + AdamW per step).
MFU is model FLOP/s over the measured float32 matmul rate of the same thread
(:func:`verity.hardware.cpu_peak.measure_matmul_flops`). The model FLOPs per token are
``6 N`` (:func:`verity.hardware.flops.training_flops_per_token`) with ``N`` the active parameters
(:func:`verity.hardware.flops.active_parameters`: the routed experts a token does not visit left out)
and, for comparison, ``N`` = every parameter, which overstates an MoE step's work by the printed
ratio. A dense Qwen2 whose MLP width makes its parameter count the MoE's *active* count runs beside
it, in the same run: its step time against the MoE's shows how close the active count is to the
work the MoE step does (HF's expert loop gathers each expert's tokens, so it pays some overhead).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from verity.engines import FSDP2Engine, OptimConfig
from verity.hardware.cpu_peak import measure_matmul_flops
from verity.hardware.flops import active_parameters, training_flops_per_token
from verity_toyworld.tiny_model import build_tiny_qwen2
from verity_toyworld.tiny_moe import build_tiny_moe

VOCAB = 260


def batch(rows: int, length: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompt = length // 2
    ids = torch.randint(1, VOCAB, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": mask.cumsum(-1) - 1,
        "responses": ids[:, prompt:],
        "response_mask": torch.ones(rows, length - prompt),
        "advantages": torch.randn(rows, length - prompt, generator=g),
    }


def loss_fn(mb, logprobs, entropy, agg):
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


def step_seconds(model: torch.nn.Module, rows: dict[str, torch.Tensor], steps: int) -> float:
    engine = FSDP2Engine(model, OptimConfig(lr=1e-4), packed=False)
    engine.train_step(rows, loss_fn, len(rows["input_ids"]))  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_step(rows, loss_fn, len(rows["input_ids"]))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    moe = build_tiny_moe(
        VOCAB,
        "qwen3_moe",
        hidden=args.hidden,
        layers=args.layers,
        heads=4,
        kv_heads=2,
        experts=args.experts,
        top_k=args.top_k,
        expert_intermediate=args.hidden,
        max_pos=args.length,
    )
    total = sum(p.numel() for p in moe.parameters())
    active = active_parameters(total, moe.config)
    # a dense Qwen2 of the same active size: its MLP as wide as top_k experts together (3 H I per expert)
    dense = build_tiny_qwen2(
        VOCAB,
        hidden=args.hidden,
        layers=args.layers,
        heads=4,
        kv_heads=2,
        intermediate=args.top_k * args.hidden,
        max_pos=args.length,
    )
    dense_params = sum(p.numel() for p in dense.parameters())
    rows = batch(args.rows, args.length)
    tokens = args.rows * args.length
    peak = measure_matmul_flops(1)
    moe_s, dense_s = step_seconds(moe, rows, args.steps), step_seconds(dense, rows, args.steps)
    print(f"moe: {total:,} parameters, {active:,} active per token ({active / total:.3f} of them)")
    print(
        f"dense yardstick: {dense_params:,} parameters; float32 matmul peak of 1 thread: {peak / 1e9:.1f} GFLOP/s"
    )
    for name, seconds, n in (
        ("moe, active", moe_s, active),
        ("moe, all (overcount)", moe_s, total),
        ("dense", dense_s, dense_params),
    ):
        flops = training_flops_per_token(n) * tokens / seconds
        print(f"{name:>22}: step {seconds:.3f} s, {tokens / seconds:,.0f} tokens/s, MFU {flops / peak:.3f}")
    print(
        f"all-parameter over active-parameter MFU: {total / active:.2f}x; moe step / dense step: {moe_s / dense_s:.2f}x"
    )


if __name__ == "__main__":
    main()
