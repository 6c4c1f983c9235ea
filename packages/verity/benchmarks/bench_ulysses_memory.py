"""Activation memory of one long row per rank: Ulysses SP=2 (two gloo processes) against SP=1.

    python packages/verity/benchmarks/bench_ulysses_memory.py [--tokens 8192] [--hidden 512] [--layers 4]
        [--heads 8] [--kv-heads 4] [--vocab 8192] [--json FILE]

A random-init Qwen2 (float32, untied embedding), one row of ``tokens`` tokens (a 512-token prompt
and the rest response), the training pass of the FSDP2 engine's sequence-parallel scoring
(:func:`verity.engines.ulysses_scoring.sp_response_logprobs`: forward with autograd, log-probs of
the response, no entropy gradient) followed by a backward of their sum. Activation memory is
what autograd saves for the backward: every tensor handed to a ``saved_tensors_hooks`` pack hook,
counted once per storage, the parameters left out (exact bytes, not allocator noise). Also printed:
the process's peak RSS growth over the pass (``ru_maxrss``; coarse) and the pass's seconds.

SP=1 runs in this process (the same packed path, no exchange); SP=2 in two spawned processes
(gloo, one torch thread each), each holding half the tokens. Prints both, per rank, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The benchmark's Qwen2, the same weights in every process (seed 0), attention set to Ulysses."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verity.engines.ulysses import ULYSSES_ATTENTION

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.tokens,
        tie_word_embeddings=False,
        use_cache=False,
    )
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation(ULYSSES_ATTENTION)
    return model.train()


def one_row(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """One verl-layout row: a 512-token prompt and a ``tokens - 512``-token response."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (1, args.tokens), generator=g)
    prompt = 512
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(args.tokens)[None],
        "responses": ids[:, prompt:],
    }


def measure(model: torch.nn.Module, row: dict[str, torch.Tensor], sp: Any) -> dict[str, float]:
    """Saved-activation bytes, peak RSS growth and seconds of one forward + backward on this rank."""
    from verity.engines.ulysses_scoring import sp_response_logprobs

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, _ = sp_response_logprobs(model, row, sp=sp, compute_entropy=False, entropy_grad=False)
    logprobs.sum().backward()
    seconds = time.perf_counter() - started
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "saved_mib": sum(saved.values()) / 2**20,
        "rss_growth_mib": (rss_peak - rss_before) / 1024,
        "seconds": seconds,
        "logprob_sum": float(logprobs.detach().sum()),
    }


def _rank(rank: int, store: str, args: argparse.Namespace, answers: Any) -> None:
    from verity.engines.ulysses import new_sequence_parallel_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        sp = new_sequence_parallel_group(2)
        answers.put((rank, measure(build_model(args), one_row(args), sp)))
    finally:
        dist.destroy_process_group()


def sp2(args: argparse.Namespace) -> list[dict[str, float]]:
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        procs = [ctx.Process(target=_rank, args=(r, store, args, answers)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(answers.get() for _ in range(2))
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"an SP=2 rank exited with code {p.exitcode}")
    return [got[0], got[1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    from verity.engines.ulysses import SequenceParallelGroup

    ranks = sp2(args)  # first: the spawned processes start from a small parent
    torch.set_num_threads(1)
    one = measure(build_model(args), one_row(args), SequenceParallelGroup(1, 0, 0, 1))
    params = sum(p.numel() for p in build_model(args).parameters())
    print(
        f"Qwen2 {args.layers} layers x {args.hidden} wide, {args.heads}/{args.kv_heads} heads, "
        f"vocab {args.vocab}, {params / 1e6:.1f}M parameters; one row of {args.tokens} tokens, float32"
    )
    print(f"{'variant':<12}{'saved MiB':>12}{'peak RSS +MiB':>16}{'seconds':>10}")
    print(f"{'SP=1':<12}{one['saved_mib']:>12.1f}{one['rss_growth_mib']:>16.1f}{one['seconds']:>10.2f}")
    for rank, r in enumerate(ranks):
        print(
            f"{f'SP=2 rank {rank}':<12}{r['saved_mib']:>12.1f}{r['rss_growth_mib']:>16.1f}{r['seconds']:>10.2f}"
        )
    worst = max(r["saved_mib"] for r in ranks)
    print(f"SP=2 / SP=1 saved activations per rank: {worst / one['saved_mib']:.3f}x (the larger rank)")
    print(
        f"log-prob sums agree: SP=1 {one['logprob_sum']:.4f}, SP=2 {ranks[0]['logprob_sum']:.4f} / "
        f"{ranks[1]['logprob_sum']:.4f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "sp1": one, "sp2": ranks, "ratio": worst / one["saved_mib"]}, f, indent=2
            )


if __name__ == "__main__":
    main()
