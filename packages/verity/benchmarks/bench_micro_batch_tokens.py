"""A compute-bound train step on two CPU processes, micro-batches cut by a token budget or not.

    python packages/verity/benchmarks/bench_micro_batch_tokens.py [--rows 128] [--budgets 0,1024,2048,4096]
                                                                  [--repeats 2] [--hidden 512] [--layers 8]

Each of two processes (one torch thread each, as ``ci/bench_trl.py``'s 512x8 shape runs
verity's two workers) trains its own ``rows`` rows of a randomly initialised Qwen2
(``hidden`` x ``layers``, the 512x8 shape's sizes by default; prompts of 5-7 tokens,
responses of 40-64) with ``FSDP2Engine.train_step`` (``sharding="replicate"`` over a
2-rank gloo group), once per ``fsdp2.micro_batch_tokens`` budget (0: the whole
``rows`` in one micro-batch, as ``actor.micro_batch_size >= rows`` does). Beside them,
``plain``: a hand-written PyTorch loop in the same two processes (one forward and
backward of all rows, AdamW step, no collective) — the peer a user would write.

Prints each layout's median step time (the slower rank's), the FLOP rate at
``6 x parameters x real tokens`` and each budget's speed-up over budget 0.
Why it matters on CPU: one micro-batch of 128 x 71 positions holds activations of
tens of MB per tensor, which glibc serves from fresh ``mmap``-ed pages on every
pass (page faults) and which do not fit any cache; ~2k positions per micro-batch
avoid both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from two_processes import slower_rank_seconds


def shaped_batch(rows: int, seed: int, vocab: int = 200) -> dict[str, torch.Tensor]:
    """Left-padded prompts of 5-7 tokens (7 columns), right-padded responses of 40-64 (64 columns)."""
    g = torch.Generator().manual_seed(seed)
    prompt_cols, response_cols = 7, 64
    prompt_lens = torch.randint(5, prompt_cols + 1, (rows,), generator=g)
    response_lens = torch.randint(40, response_cols + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(prompt_cols) >= prompt_cols - prompt_lens[:, None]).long()
    response_mask = (torch.arange(response_cols) < response_lens[:, None]).long()
    prompts = torch.randint(5, vocab, (rows, prompt_cols), generator=g) * prompt_mask
    responses = torch.randint(5, vocab, (rows, response_cols), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, response_cols).contiguous()
        * response_mask,
    }


def _model(hidden: int, layers: int) -> torch.nn.Module:
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    heads = max(1, hidden // 64)
    return build_tiny_qwen2_for(
        CharTokenizer(),
        seed=0,
        max_pos=256,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=max(1, heads // 2),
        intermediate=3 * hidden,
    )


def _plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, b: dict[str, torch.Tensor]) -> None:
    """What a hand-written loop does: one forward of every row, the token-mean policy-gradient loss, AdamW."""
    prompt_len = b["input_ids"].shape[1] - b["responses"].shape[1]
    logits = model(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
    ).logits
    logprobs = torch.log_softmax(logits[:, prompt_len - 1 : -1].float(), -1)
    logprobs = logprobs.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    mask = b["response_mask"].float()
    (-(logprobs * b["advantages"] * mask).sum() / mask.sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _rank(rank: int, store_file: str, layout: str, args: argparse.Namespace, answers) -> None:
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.batch import Batch
    from verity.engines.fsdp2 import FSDP2Engine
    from verity.engines.optim import OptimConfig
    from verity.workers.actor_rollout import make_actor_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    b = shaped_batch(args.rows, seed=rank)
    if layout == "plain":
        model = _model(args.hidden, args.layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5, fused=True)

        def step() -> float:
            start = time.perf_counter()
            _plain_step(model, optimizer, b)
            return time.perf_counter() - start
    else:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
        engine = FSDP2Engine(
            _model(args.hidden, args.layers),
            OptimConfig(lr=3e-5),
            total_steps=args.repeats + 2,
            device="cpu",
            sharding="replicate",
            micro_batch_tokens=int(layout),
        )
        batch = Batch.from_dict(b)
        loss = make_actor_loss(PolicyLossConfig(), KLConfig(), 0.0)

        def step() -> float:
            start = time.perf_counter()
            engine.train_step(batch, loss, args.rows)
            return time.perf_counter() - start

    step()  # warm-up: first-touch of every buffer
    answers.put((rank, statistics.median(step() for _ in range(args.repeats))))
    if layout != "plain":
        dist.destroy_process_group()


def run_layout(layout: str, args: argparse.Namespace) -> float:
    """The slower rank's median seconds per train step."""
    return slower_rank_seconds(_rank, layout, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="rows per process")
    parser.add_argument(
        "--budgets", default="0,1024,2048,4096", help="micro_batch_tokens values, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per layout (after one warm-up)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    budgets = [int(x) for x in args.budgets.split(",") if x]
    if 0 not in budgets:
        budgets.insert(0, 0)
    model = _model(args.hidden, args.layers)
    params = sum(p.numel() for p in model.parameters())
    tokens = sum(int(shaped_batch(args.rows, seed=r)["attention_mask"].sum()) for r in range(2))
    del model
    load_before = os.getloadavg()[0]
    seconds = {str(b): run_layout(str(b), args) for b in budgets}
    seconds["plain"] = run_layout("plain", args)
    print(
        f"2 processes x {args.rows} rows, Qwen2 {args.hidden}x{args.layers} ({params / 1e6:.1f}M parameters), "
        f"{tokens} real tokens per step, median of {args.repeats} (load {load_before:.1f} -> {os.getloadavg()[0]:.1f}):"
    )
    for layout, s in seconds.items():
        name = "plain PyTorch, one pass" if layout == "plain" else f"micro_batch_tokens={layout}"
        rate = 6 * params * tokens / s / 1e9
        print(f"  {name:28s} {s:7.2f} s/step  {rate:6.1f} GFLOP/s  budget-0 / this = {seconds['0'] / s:.2f}")


if __name__ == "__main__":
    main()
