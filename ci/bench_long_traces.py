"""Long-tailed traces: verity's padded and packed + balanced passes beside TRL's GRPOTrainer, one run.

    python -m ci.bench_long_traces [--rows 64] [--scale 4] [--budget 2048] [--rounds 3]
                                   [--hidden 256] [--layers 4] [--trl-micro-batch 8]

Needs TRL (``nox -s bench-trl --install-only`` makes ``.nox/bench-trl``, whose python runs
this). The work is ``packages/verity/benchmarks/bench_token_balance.py``'s: one GRPO-shaped
batch with long-tailed response lengths (lognormal, median 256 / ``scale``, p99 4096 /
``scale`` tokens), a randomly initialised Qwen2 (``hidden`` x ``layers``, float32), one no-grad
log-prob pass and one update (forward + backward of every row, one AdamW step). Three sides on
the same rows, one after the other in this invocation:

- ``padded``: verity before long-trace support: rows cut over two ranks in order, micro-batches of
  consecutive rows under the token budget, each as wide as its longest row;
- ``packed``: verity's defaults: token-balanced ranks, micro-batches longest first, each a
  packed sequence (both sides from ``bench_token_balance.run_both`` with ``--packed balanced``:
  two processes, one torch thread each, FSDP2 over a 2-rank gloo group; the slower rank's time);
- ``trl``: TRL's ``GRPOTrainer`` in one process on two torch threads: its own log-prob pass
  (``_get_per_token_logps_and_entropies``, ``--trl-micro-batch`` rows per forward) and loss
  (``_compute_loss``, ``loss_type="dapo"``: the token mean over the batch; forward + backward per
  ``--trl-micro-batch`` rows), then one AdamW step. TRL 1.16's GRPOTrainer has no padding-free
  option (its SFT and DPO trainers do), so it runs padded.

TRL runs once before verity's sides and once after (the machine's load drifts; their mean is
its figure). Printed: each side's median seconds and real tokens per second per pass, and the ratios against
``trl`` and ``padded``; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "verity" / "benchmarks"))
import bench_token_balance as work  # noqa: E402


def run_trl(args: argparse.Namespace) -> tuple[float, float]:
    """TRL's GRPOTrainer passes on the same rows: median (log-prob pass seconds, update seconds)."""
    import tempfile
    import warnings

    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from verity_toyworld.char_tokenizer import CharTokenizer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    full = work.long_tailed_batch(args.rows, args.scale)
    model = work._model(args.hidden, args.layers, full["input_ids"].shape[1] + 8)
    micro = args.trl_micro_batch

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=args.rows // micro,
            num_generations=micro,
            max_completion_length=full["responses"].shape[1],
            learning_rate=3e-5,
            beta=0.0,
            loss_type="dapo",
            report_to="none",
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
            args=config,
            train_dataset=Dataset.from_list([{"prompt": "x"}] * args.rows),
            processing_class=CharTokenizer(),
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)
    prompt_mask = full["attention_mask"][:, : work.PROMPT_COLS]
    completion_mask = full["response_mask"]
    input_ids = full["input_ids"]
    attention_mask = full["attention_mask"]
    width = full["responses"].shape[1]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.rows // micro  # as Trainer.train sets it

    def passes() -> tuple[float, float]:
        start = time.perf_counter()
        with torch.no_grad():
            trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, width, batch_size=micro
            )
        middle = time.perf_counter()
        for lo in range(0, args.rows, micro):
            rows = slice(lo, lo + micro)
            inputs = {
                "prompt_ids": input_ids[rows, : work.PROMPT_COLS],
                "prompt_mask": prompt_mask[rows],
                "completion_ids": full["responses"][rows],
                "completion_mask": completion_mask[rows],
                "advantages": full["advantages"][rows, 0],
                "num_items_in_batch": completion_mask.sum(),
            }
            trainer._compute_loss(model, inputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return middle - start, time.perf_counter() - middle

    passes()  # warm-up
    timed = [passes() for _ in range(args.rounds)]
    return statistics.median(t[0] for t in timed), statistics.median(t[1] for t in timed)


def _trl_in_process(args: argparse.Namespace, answers) -> None:
    answers.put(run_trl(args))


def run_trl_process(args: argparse.Namespace) -> tuple[float, float]:
    """:func:`run_trl` in a spawned process (its own threads and allocator, as the other sides)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    proc = ctx.Process(target=_trl_in_process, args=(args, answers))
    proc.start()
    while proc.is_alive() or not answers.empty():
        try:
            result = answers.get(timeout=5)
        except queue.Empty:
            continue
        proc.join()
        return result
    raise RuntimeError(f"the TRL side exited with code {proc.exitcode} and no figures")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="rows of the batch (groups of 4 samples)")
    parser.add_argument(
        "--scale", type=float, default=4.0, help="lengths divided by this (1: median 256, p99 4k)"
    )
    parser.add_argument("--budget", type=int, default=2048, help="verity's fsdp2.micro_batch_tokens")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side (after a warm-up)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--trl-micro-batch", type=int, default=8, help="TRL's rows per forward/backward")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.rows % args.trl_micro_batch:
        parser.error(f"--rows {args.rows} must be a multiple of --trl-micro-batch {args.trl_micro_batch}")
    batch = work.long_tailed_batch(args.rows, args.scale)
    if args.budget < batch["input_ids"].shape[1]:
        parser.error(
            f"--budget {args.budget} is smaller than the longest row ({batch['input_ids'].shape[1]} columns)"
        )
    tokens = int(batch["attention_mask"].sum())
    load_before = os.getloadavg()[0]
    trl_before = run_trl_process(args)  # TRL before and after verity's sides: load drifts on shared machines
    verity = work.run_both(argparse.Namespace(**vars(args), packed="balanced"))
    trl_after = run_trl_process(args)
    sides: dict[str, tuple[float, float]] = {
        name: tuple(
            statistics.median(w for w, _ in verity[layout, phase]) for phase in ("logprobs", "update")
        )
        for name, layout in (("padded", "consecutive"), ("packed", "balanced"))
    }
    sides["trl"] = ((trl_before[0] + trl_after[0]) / 2, (trl_before[1] + trl_after[1]) / 2)
    responses = batch["response_mask"].sum(-1).float()
    print(
        f"{args.rows} rows, {tokens} real tokens, response tokens median {responses.median():.0f}, "
        f"p99 {responses.quantile(0.99):.0f}, max {responses.max():.0f} (lengths / {args.scale:g}); "
        f"Qwen2 {args.hidden}x{args.layers} float32; median of {args.rounds} "
        f"(load {load_before:.1f} -> {os.getloadavg()[0]:.1f}):"
    )
    print(
        f"  (TRL before verity's sides {sum(trl_before):.2f} s, after {sum(trl_after):.2f} s: their mean below)"
    )
    figures: dict[str, Any] = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "tokens": tokens,
        "trl_runs_s": [list(trl_before), list(trl_after)],
        "sides": {},
    }
    for side, (logprob_s, update_s) in sides.items():
        line = {"logprob_s": logprob_s, "update_s": update_s, "total_s": logprob_s + update_s}
        line["tokens_per_s"] = 2 * tokens / line["total_s"]
        line["speedup_vs_trl"] = (sum(sides["trl"])) / line["total_s"]
        line["speedup_vs_padded"] = (sum(sides["padded"])) / line["total_s"]
        figures["sides"][side] = line
        print(
            f"  {side:7s} log-probs {logprob_s:6.2f} s  update {update_s:6.2f} s  "
            f"({line['tokens_per_s']:6.0f} tok/s)  x{line['speedup_vs_trl']:.2f} vs trl, "
            f"x{line['speedup_vs_padded']:.2f} vs padded"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
