"""Token-balanced ranks and longest-first micro-batches vs today's consecutive cut, on long-tailed lengths.

    python packages/verity/benchmarks/bench_token_balance.py [--rows 64] [--scale 4] [--budget 2048]
        [--rounds 3] [--packed none|both|balanced] [--hidden 256] [--layers 4]

A GRPO-shaped batch of ``rows`` rows (prompts of 8-16 tokens, each repeated for 4 samples;
response lengths long-tailed: lognormal with median ``256 / scale`` and 99th percentile
``4096 / scale`` tokens, capped at 1.5x that) is cut over two processes (one torch thread
each, a 2-rank gloo group, FSDP2 ``sharding="full"``, ``fsdp2.micro_batch_tokens=budget``) in
two layouts, side by side in one run (both padded by default; ``--packed both``: both on the
packed layout; ``--packed balanced``: the balanced one packed, against today's padded default):

- ``consecutive`` (today before this change): ``Batch.split(2)`` of the rows as they come,
  micro-batches of consecutive rows under the budget;
- ``balanced``: the rows reordered by :func:`verity.batch.balance.balanced_order` so that both
  ranks hold about the same tokens, micro-batches packed longest first under the budget
  (:mod:`verity.engines.micro_batch_groups`).

One pair of processes runs both layouts in turn (the order alternating by round, after a warm-up
round), each one update (``train_step``: forward + backward of every row, one optimizer step) and
one log-prob pass (``compute_logprobs``); a pass's figure is the slower rank's time (the ranks
start together and meet in every pass's all-gather): wall seconds (minimum and median over the
rounds) and CPU seconds of the busier rank's process (median), which other work on a shared
machine disturbs least. Prints both layouts' seconds and real tokens per second, the ratio, and
per rank the real tokens, the positions the padded layout computes and the micro-batches, with
each one's imbalance (heaviest rank / mean).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROMPT_COLS, GROUP = 16, 4
LAYOUTS = ("consecutive", "balanced")
PHASES = ("update", "logprobs")


def long_tailed_batch(rows: int, scale: float, seed: int = 0, vocab: int = 90) -> dict[str, torch.Tensor]:
    """``rows`` rows in groups of 4 sharing a prompt; responses lognormal, median 256/scale, p99 4096/scale."""
    g = torch.Generator().manual_seed(seed)
    median, p99 = 256 / scale, 4096 / scale
    sigma = math.log(p99 / median) / 2.326  # the normal's 99th percentile is 2.326 sigma
    normal = torch.randn(rows, generator=g)
    response_lens = (median * torch.exp(sigma * normal)).round().long().clamp(1, int(1.5 * p99))
    response_cols = int(response_lens.max())
    prompts = -(-rows // GROUP)
    prompt_lens = torch.randint(8, PROMPT_COLS + 1, (prompts,), generator=g).repeat_interleave(GROUP)[:rows]
    prompt_ids = torch.randint(5, vocab, (prompts, PROMPT_COLS), generator=g).repeat_interleave(GROUP, 0)[
        :rows
    ]
    prompt_mask = (torch.arange(PROMPT_COLS) >= PROMPT_COLS - prompt_lens[:, None]).long()
    response_mask = (torch.arange(response_cols) < response_lens[:, None]).long()
    responses = torch.randint(5, vocab, (rows, response_cols), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    advantages = torch.randn(rows, 1, generator=g).expand(rows, response_cols).contiguous()
    return {
        "input_ids": torch.cat([prompt_ids * prompt_mask, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
        "advantages": advantages * response_mask,
        "old_logprobs": torch.zeros(rows, response_cols),
    }


def shards(batch: dict[str, torch.Tensor], layout: str) -> list:
    """The two ranks' rows in ``layout`` (``consecutive`` | ``balanced``), as the dispatch would send them."""
    from verity.batch import Batch
    from verity.batch.balance import balanced_order

    whole = Batch.from_dict(batch)
    if layout == "balanced":
        whole = whole.index(balanced_order(batch["attention_mask"].sum(-1), 2))
    return whole.split(2)


def micro_batches(part, layout: str, budget: int, packed: bool = False) -> list[torch.Tensor]:
    """The rank's micro-batches in ``layout``: consecutive ranges (today) or longest first; the budget
    counts real tokens when ``packed``, else rows x window."""
    from verity.engines.micro_batch_groups import micro_batch_groups
    from verity.engines.micro_batches import micro_batch_ranges

    rows, cost = len(part), "tokens" if packed else "window"
    if layout == "balanced":
        return micro_batch_groups(part, rows, rows, budget, cost)
    ranges = micro_batch_ranges(part["attention_mask"], part["responses"].shape[1], rows, budget, cost)
    return [torch.arange(s, e) for s, e in ranges]


def _model(hidden: int, layers: int, max_pos: int) -> torch.nn.Module:
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    heads = max(1, hidden // 64)
    return build_tiny_qwen2_for(
        CharTokenizer(),
        seed=0,
        max_pos=max_pos,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=max(1, heads // 2),
        intermediate=3 * hidden,
    )


def packed_in(layout: str, mode: str) -> bool:
    """Whether ``layout`` runs packed under ``--packed`` ``mode`` (none | both | balanced)."""
    return mode == "both" or (mode == "balanced" and layout == "balanced")


def _rank(rank: int, store_file: str, args: argparse.Namespace, answers) -> None:
    """Both layouts' update and log-prob pass in turn, ``rounds`` times; rank 0 answers each pass's
    time on the slower rank (the ranks start each pass together)."""
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.engines.fsdp2 import FSDP2Engine
    from verity.engines.optim import OptimConfig
    from verity.workers.actor_rollout import make_actor_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    batch = long_tailed_batch(args.rows, args.scale)
    parts = {layout: shards(batch, layout)[rank] for layout in LAYOUTS}

    class Engine(FSDP2Engine):
        layout = "balanced"

        def _micro_ranges(self, b, rows, micro_batch_size):  # this layout's micro-batches
            if rows != len(b):
                return super()._micro_ranges(b, rows, micro_batch_size)
            groups = micro_batches(b, self.layout, self.micro_batch_tokens, self.packed)
            return groups, int(self._all_reduce([float(len(groups))], op="max")[0])

    engines = {}
    for layout in LAYOUTS:  # the same weights (seed 0) in each layout's engine
        engines[layout] = Engine(
            _model(args.hidden, args.layers, batch["input_ids"].shape[1] + 8),
            OptimConfig(lr=3e-5),
            total_steps=2 * (args.rounds + 1),
            device="cpu",
            micro_batch_tokens=args.budget,
            packed=packed_in(layout, args.packed),
        )
        engines[layout].layout = layout
    loss = make_actor_loss(PolicyLossConfig(), KLConfig(), 0.0)

    def timed(layout: str, phase: str) -> tuple[float, float]:
        """(wall seconds, CPU seconds) of one pass, each the larger of the two ranks'."""
        engine, part = engines[layout], parts[layout]
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        if phase == "update":
            engine.train_step(part, loss, len(part))
        else:
            engine.compute_logprobs(part, len(part))
        took = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took[0]), float(took[1])

    times: dict[tuple[str, str], list[tuple[float, float]]] = {
        (lay, ph): [] for lay in LAYOUTS for ph in PHASES
    }
    for round_ in range(args.rounds + 1):  # round 0 warms up: first-touch of every buffer
        for layout in LAYOUTS if round_ % 2 == 0 else LAYOUTS[::-1]:
            for phase in PHASES:
                took = timed(layout, phase)
                if round_:
                    times[layout, phase].append(took)
    if rank == 0:
        answers.put(times)
    dist.destroy_process_group()


def run_both(args: argparse.Namespace) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Spawn the two ranks; each (layout, phase)'s slower-rank (wall, CPU) seconds per round."""
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_rank, args=(r, os.path.join(folder, "store"), args, answers))
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        times = answers.get()
        for proc in procs:
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"a rank exited with code {proc.exitcode}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="rows over both ranks (groups of 4 samples)")
    parser.add_argument(
        "--scale", type=float, default=4.0, help="lengths divided by this (1: median 256, p99 4k)"
    )
    parser.add_argument(
        "--budget", type=int, default=2048, help="fsdp2.micro_batch_tokens (>= the longest row)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed rounds of both layouts (after a warm-up round)"
    )
    parser.add_argument(
        "--packed",
        choices=("none", "both", "balanced"),
        default="none",
        help="which layouts run packed (fsdp2.packed): none (both padded), both, or the balanced one only "
        "(packed + balanced against today's padded, consecutive)",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from verity.engines.logprobs import padding_free_window

    batch = long_tailed_batch(args.rows, args.scale)
    width, response_len = batch["input_ids"].shape[1], batch["responses"].shape[1]
    if args.budget < width:
        raise SystemExit(f"--budget {args.budget} is smaller than the longest row ({width} columns)")
    responses = batch["response_mask"].sum(-1).float()
    total = int(batch["attention_mask"].sum())
    load_before = os.getloadavg()[0]
    print(
        f"{args.rows} rows, response tokens median {responses.median():.0f}, p99 {responses.quantile(0.99):.0f}, "
        f"max {responses.max():.0f} (lengths / {args.scale:g}); {total} real tokens; Qwen2 {args.hidden}x{args.layers}; "
        f"2 ranks x 1 thread, FSDP2 full sharding, packed: {args.packed}, "
        f"micro_batch_tokens={args.budget}"
    )
    for layout in LAYOUTS:
        tokens, counts, positions = [], [], []
        for part in shards(batch, layout):
            groups = micro_batches(part, layout, args.budget, packed_in(layout, args.packed))
            tokens.append(int(part["attention_mask"][: len(part) - part.pad_rows].sum()))
            counts.append(len(groups))
            windows = [padding_free_window(part["attention_mask"][g], response_len) for g in groups]
            positions.append(
                sum(
                    len(g) * (width - response_len - f + k) for g, (f, k) in zip(groups, windows, strict=True)
                )
            )
        print(
            f"  {layout:12s} tokens per rank {tokens} (imbalance {max(tokens) / (sum(tokens) / 2):.2f}), "
            f"padded-window positions per rank {positions} (imbalance {max(positions) / (sum(positions) / 2):.2f}), "
            f"micro-batches per rank {counts}"
        )
    times = run_both(args)
    load = f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    print(f"slower rank per pass, {args.rounds} rounds ({load}): wall min / median, CPU seconds median")
    summary = {}
    for phase in PHASES:
        row = {}
        for lay in LAYOUTS:
            walls, cpus = [w for w, _ in times[lay, phase]], [c for _, c in times[lay, phase]]
            row[lay] = (min(walls), statistics.median(walls), statistics.median(cpus))
        summary[phase] = row
        (b_min, b_med, b_cpu), (a_min, a_med, a_cpu) = row["consecutive"], row["balanced"]
        print(
            f"  {phase:9s} consecutive {b_min:6.2f} / {b_med:6.2f} s, CPU {b_cpu:6.2f} s ({total / b_med:6.0f} tok/s)   "
            f"balanced {a_min:6.2f} / {a_med:6.2f} s, CPU {a_cpu:6.2f} s ({total / a_med:6.0f} tok/s)   "
            f"speed-up wall min {b_min / a_min:.2f}x, median {b_med / a_med:.2f}x, CPU {b_cpu / a_cpu:.2f}x"
        )
    for k, name in ((0, "wall min"), (1, "wall median"), (2, "CPU median")):
        before = sum(summary[ph]["consecutive"][k] for ph in PHASES)
        after = sum(summary[ph]["balanced"][k] for ph in PHASES)
        print(
            f"  update + log-probs, {name}: {before:.2f} s -> {after:.2f} s, speed-up {before / after:.2f}x"
        )


if __name__ == "__main__":
    main()
