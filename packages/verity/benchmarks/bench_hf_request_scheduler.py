"""The HF engine's request scheduler (continuous batching) against ``generate`` in waves.

    python packages/verity/benchmarks/bench_hf_request_scheduler.py [--requests 48] [--gap-ms 4]
        [--hidden 256] [--layers 4] [--repeats 3]

Two measurements on a randomly initialised Qwen2 (``hidden`` x ``layers``, 8 query / 2
key/value heads, a 260-token vocabulary), one torch thread, sampling at temperature 1 with
``ignore_eos`` (every request produces exactly its ``max_new_tokens``), the two sides
alternating after a warm-up:

- **staggered**: ``requests`` requests, contexts of 8-40 tokens, ``max_new_tokens`` drawn
  heavy-tailed (a Pareto of shape 1.2 scaled to a minimum of 4, capped at 160), request ``i``
  arriving ``i * gap`` ms after the start. A driver adds every request that has arrived, then
  calls ``step()`` (sleeping until the next arrival when nothing is held). The HF scheduler
  (:mod:`verity.rollout.hf_requests`) decodes one token per step, admitting arrivals between
  steps; the baseline, :class:`~verity.rollout.requests.BatchedCallScheduler`, runs one
  ``generate`` over the queued requests per step (waves: a wave decodes to its longest request
  while later arrivals wait). Printed: new tokens per second over the whole run and the mean
  latency (arrival to return) of each side, and their ratios.
- **plain batch**: the same requests all added at once with one ``max_new_tokens``: the
  scheduler's steps against one ``generate`` call on the same batch (three pairs a round, in
  process CPU time, which a busy machine disturbs less than wall time), and the difference per
  decode step (what the scheduler's bookkeeping costs when there is nothing to admit).

The staggered run also times the scheduler's merges (each rebuild of the cache that admits
requests or sheds retired rows) against its steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from verity.rollout import HFRollout, SamplingParams
from verity.rollout.prompts import left_pad
from verity.rollout.requests import BatchedCallScheduler, GenerationRequest, RequestScheduler
from verity_toyworld.tiny_model import build_tiny_qwen2

VOCAB, PAD, EOS = 260, 0, 1


def workload(count: int, seed: int) -> list[GenerationRequest]:
    """``count`` requests: contexts of 8-40 random tokens, heavy-tailed ``max_new_tokens`` in [4, 160]."""
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for request_id in range(count):
        length = int(torch.randint(8, 41, (1,), generator=generator))
        context = torch.randint(2, VOCAB, (length,), generator=generator).tolist()
        uniform = float(torch.rand((1,), generator=generator))
        new_tokens = min(160, int(4 / (1 - uniform) ** (1 / 1.2)))  # Pareto, shape 1.2, minimum 4
        requests.append(GenerationRequest(request_id, context, new_tokens))
    return requests


def staggered(
    scheduler: RequestScheduler, requests: list[GenerationRequest], gap: float
) -> tuple[float, float]:
    """Drive ``scheduler`` with request ``i`` arriving at ``i * gap`` s: (seconds, mean latency in s)."""
    start = time.perf_counter()
    arrival = {r.request_id: i * gap for i, r in enumerate(requests)}
    latency: list[float] = []
    waiting = list(requests)
    while waiting or scheduler.pending():
        now = time.perf_counter() - start
        while waiting and arrival[waiting[0].request_id] <= now:
            scheduler.add(waiting.pop(0))
        if not scheduler.pending():
            time.sleep(max(0.0, arrival[waiting[0].request_id] - now))
            continue
        for finished in scheduler.step():
            latency.append(time.perf_counter() - start - arrival[finished.request_id])
    return time.perf_counter() - start, statistics.mean(latency)


def plain_batch(
    engine: HFRollout, requests: list[GenerationRequest], params: SamplingParams
) -> tuple[float, float]:
    """The same batch through the scheduler and through one ``generate``: (scheduler s, generate s)
    of process CPU time (``time.process_time``: what the work cost, not how long it waited for a
    core on a shared machine)."""
    scheduler = engine.request_scheduler(params)
    start = time.process_time()
    for request in requests:
        scheduler.add(request)
    while scheduler.pending():
        scheduler.step()
    through_scheduler = time.process_time() - start
    ids, mask = left_pad([list(r.context) for r in requests], PAD)
    start = time.process_time()
    engine.generate({"input_ids": ids, "attention_mask": mask}, params)
    return through_scheduler, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--gap-ms", type=float, default=4.0, help="between two arrivals")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--plain-tokens", type=int, default=32, help="max_new_tokens of the plain batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_qwen2(
        VOCAB, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=2, intermediate=2 * args.hidden,
        max_pos=256, pad_token_id=PAD, eos_token_id=EOS,
    ).eval()  # fmt: skip
    engine = HFRollout(model, pad_token_id=PAD, eos_token_ids=EOS, seed=0)
    params = SamplingParams(temperature=1.0, ignore_eos=True)
    requests = workload(args.requests, seed=1)
    tokens = sum(r.max_new_tokens for r in requests)
    plain = [GenerationRequest(r.request_id, r.context, args.plain_tokens) for r in requests]
    plain_params = SamplingParams(temperature=1.0, ignore_eos=True, max_new_tokens=args.plain_tokens)

    merges: list[float] = []  # seconds of each cache rebuild of the scheduler's side
    steps: list[float] = []  # seconds of each of its steps

    def timed_scheduler() -> RequestScheduler:
        scheduler = engine.request_scheduler(params)
        rebuild, step = scheduler._rebuild, scheduler.step

        def timed_rebuild(*args: object, **kwargs: object) -> None:
            start = time.perf_counter()
            rebuild(*args, **kwargs)
            merges.append(time.perf_counter() - start)

        def timed_step() -> list:
            start = time.perf_counter()
            finished = step()
            steps.append(time.perf_counter() - start)
            return finished

        scheduler._rebuild, scheduler.step = timed_rebuild, timed_step  # type: ignore[method-assign]
        return scheduler

    sides = {
        "scheduler": timed_scheduler,
        "waves": lambda: BatchedCallScheduler(engine, params, PAD),
    }
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    latency: dict[str, list[float]] = {name: [] for name in sides}
    plain_times: dict[str, list[float]] = {"scheduler": [], "generate": []}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, make in sides.items():
            took, mean_latency = staggered(make(), requests, args.gap_ms / 1000)
            if repeat:
                seconds[name].append(took)
                latency[name].append(mean_latency)
        if not repeat:
            merges.clear()
            steps.clear()
        for _ in range(3):
            through_scheduler, through_generate = plain_batch(engine, plain, plain_params)
            if repeat:
                plain_times["scheduler"].append(through_scheduler)
                plain_times["generate"].append(through_generate)

    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    lengths = sorted(r.max_new_tokens for r in requests)
    print(
        f"Qwen2 {args.hidden}x{args.layers}, one thread, load {load}, median of {args.repeats}; "
        f"{args.requests} requests {args.gap_ms:g} ms apart, {tokens} new tokens "
        f"(max_new_tokens median {lengths[len(lengths) // 2]}, max {lengths[-1]})"
    )
    rate = {name: tokens / statistics.median(times) for name, times in seconds.items()}
    wait = {name: statistics.median(times) for name, times in latency.items()}
    for name in sides:
        print(
            f"  {name:9s} {statistics.median(seconds[name]):7.2f} s  {rate[name]:8.1f} tokens/s  "
            f"mean latency {wait[name] * 1000:8.1f} ms"
        )
    print(
        f"  scheduler / waves: throughput {rate['scheduler'] / rate['waves']:.2f}x, "
        f"mean latency {wait['waves'] / wait['scheduler']:.2f}x lower"
    )
    print(
        f"  merges (cache rebuilds: admissions, compactions): {len(merges) / args.repeats:.0f} a run, "
        f"median {statistics.median(merges) * 1000:.2f} ms each, {sum(merges) / sum(steps):.1%} of the "
        f"scheduler's step time; its median step {statistics.median(steps) * 1000:.2f} ms"
    )
    sched, gen = (statistics.median(plain_times[k]) for k in ("scheduler", "generate"))
    per_step = (sched - gen) / args.plain_tokens * 1000
    print(
        f"plain batch of {args.requests} x {args.plain_tokens} tokens (CPU time, median of {3 * args.repeats}): "
        f"scheduler {sched * 1000:.1f} ms, "
        f"generate {gen * 1000:.1f} ms, ratio {sched / gen:.3f}, overhead {per_step:+.2f} ms per decode step"
    )


if __name__ == "__main__":
    main()
