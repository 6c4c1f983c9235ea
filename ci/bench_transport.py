"""What each piece of the driver<->worker transport saves at the GSM8K recipe's shape.

    python -m ci.bench_transport [--rows 1280] [--n 8] [--prompt 512] [--response 1024]
                                 [--rounds 3] [--nodes 1,2] [--json ci/reports/x.json]

A benchmark, not a test: it prints a table and, with ``--json``, writes the figures with the
machine they were measured on. It runs the three group calls of a GRPO step through the real
Ray path of a 2-rank :class:`~verity.controller.WorkerGroup` (a private local Ray cluster, and
``--nodes 2``: a simulated cluster of two Ray nodes on this machine, one rank on each, so every
row fetched by the other rank crosses node object stores): ``generate`` (the rows repeat each of
``rows / n`` prompts ``n`` times; each rank answers its rows with ``prompts [b, P]``, ``responses
[b, R]``, ``input_ids``/``attention_mask``/``position_ids [b, P+R]``, ``response_mask [b, R]`` and
``rollout_logprobs [b, R]`` at realistic padding, built from a fixed seed so every configuration
gets the same tensors), the driver's reward and advantage from ``responses`` and
``response_mask``, ``compute_logprobs`` (answers ``old_logprobs [b, R]``) and ``update`` (reads the
model keys, the advantages and the old log-probs, answers a metrics dict). No model runs: the
figures are the transport's own cost, an upper bound of its share of a real step.

Configurations: the transport as it is ("all") and the same with one feature off at a time
(``--features``); the one feature is ``resident`` (prompt-aligned rows and ``rollout_logprobs``
kept in the object store of the node that made them, :mod:`verity.batch.transport`). Rounds
alternate the configurations (``--rounds`` each, after one warm-up step of each); the table gives
the median step wall time, the bytes the driver sent and received (the meter of
``perf/driver_bytes_*``) and the bytes the driver holds at the end of the step (its peak: the
step's batch only grows), each as a ratio to "all" measured in the same rounds.

The narrow-integer packing, repeated-row compaction, digest echoes, request echo and held
columns this transport had until 2026-11-28 were measured with this script against that code
and removed (``ci/reports/2026-11-28-transport.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import ray
import ray.cloudpickle
import torch
from verity.batch import Batch
from verity.controller import Collect, Dispatch, ResourcePool, Worker, WorkerGroup, register

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FEATURES = ("resident",)


class BenchRollout(Worker):
    """A rank that answers generate / compute_logprobs / update with tensors of the step's shape."""

    def __init__(self, prompt: int, response: int) -> None:
        self.prompt, self.response = prompt, response
        self.on: frozenset[str] = frozenset(FEATURES)

    @register(Dispatch.BROADCAST)
    def set_features(self, on: list[str]) -> None:
        self.on = frozenset(on)

    @register(Dispatch.DP_SPLIT)
    def generate(self, rows: Batch) -> Batch:
        from verity.batch import keep_resident

        b, p, r = len(rows), self.prompt, self.response
        gen = torch.Generator().manual_seed(int(rows["group"][0]))
        prompt_len = torch.randint(p // 4, p + 1, (b,), generator=gen)
        response_len = torch.randint(r // 8, r + 1, (b,), generator=gen)
        cols_p, cols_r = torch.arange(p)[None, :], torch.arange(r)[None, :]
        prompt_mask = (cols_p >= (p - prompt_len)[:, None]).long()
        response_mask = (cols_r < response_len[:, None]).long()
        prompts = torch.randint(3, 150_000, (b, p), generator=gen) * prompt_mask
        responses = torch.randint(3, 150_000, (b, r), generator=gen) * response_mask
        attention = torch.cat([prompt_mask, response_mask], dim=1)
        rows["prompts"] = prompts
        rows["responses"] = responses
        rows["input_ids"] = torch.cat([prompts, responses], dim=1)
        rows["attention_mask"] = attention
        rows["position_ids"] = (attention.cumsum(-1) - 1).clamp(min=0)
        rows["response_mask"] = response_mask
        rows["rollout_logprobs"] = -torch.rand(b, r, generator=gen) * response_mask
        if "resident" in self.on:
            rows = keep_resident(rows, 0, also=("rollout_logprobs",))
        return rows

    @register(Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: Batch) -> Batch:
        logprobs = (
            -(batch["input_ids"][:, -self.response :] % 7).float()
            / 7
            * batch["attention_mask"][:, -self.response :]
        )
        return Batch.from_dict({"old_logprobs": logprobs})

    @register(Dispatch.DP_SPLIT, collect=Collect.RANK_ZERO)
    def update(self, batch: Batch) -> dict[str, float]:
        mask = batch["response_mask"].float()
        loss = (batch["advantages"] * batch["old_logprobs"] * mask).sum() / mask.sum()
        return {"loss": float(loss), "tokens": float(batch["attention_mask"].sum())}


def prompt_rows(prompts: int, n: int, step: int) -> Batch:
    """``prompts x n`` rows of GSM8K-like per-row columns (each prompt's ``n`` rows in a row)."""
    text = [
        f"Question {step}-{i}: Natalia sold clips to {i} of her friends in April, and then she sold half "
        "as many clips in May. How many clips did Natalia sell altogether in April and May? "
        * 3
        + "Let's think step by step and output the final answer after '####'."
        for i in range(prompts)
    ]
    batch = Batch.from_dict(
        {},
        {
            "prompt_text": text,
            "raw_prompt": [[{"role": "user", "content": t}] for t in text],
            "uid": [f"gsm8k-{step}-{i}" for i in range(prompts)],
            "data_source": ["openai/gsm8k"] * prompts,
            "ground_truth": [str(i * 3) for i in range(prompts)],
            "extra_info": [{"split": "train", "index": i} for i in range(prompts)],
        },
    )
    rows = batch.repeat_interleave(n)
    rows["group"] = torch.arange(step * prompts, (step + 1) * prompts).repeat_interleave(n)
    return rows


def step(group: WorkerGroup, prompts: int, n: int, index: int) -> dict[str, float]:
    """One step's three group calls and the driver's reward/advantage; its wall time and bytes."""
    from verity.batch.transport import DRIVER_TRANSFERS, payload_bytes

    DRIVER_TRANSFERS.take()
    start = time.perf_counter()
    batch = group.generate(prompt_rows(prompts, n, index))
    responses, mask = batch["responses"], batch["response_mask"]
    scores = ((responses[:, 0] % 2) == 0).float()
    grouped = scores.view(-1, n)
    advantage = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).view(-1)
    batch["scores"] = scores
    batch["advantages"] = advantage[:, None] * mask
    model = ("input_ids", "attention_mask", "position_ids", "responses")
    batch["old_logprobs"] = group.compute_logprobs(batch.select(*model))["old_logprobs"]
    group.update(batch.select(*model, "response_mask", "old_logprobs", "advantages"))
    wall = time.perf_counter() - start
    sent, received = DRIVER_TRANSFERS.take()
    held = payload_bytes(batch)
    return {"wall_s": wall, "sent": sent, "received": received, "held": held}


def run_cluster(nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration's rounds on a ``nodes``-node cluster; per configuration its medians."""
    import contextlib

    base = frozenset(args.base)
    configs = {"all": base} | {f"no {f}": base - {f} for f in args.features if f in base}
    sim = None
    if nodes == 1:
        from verity.controller import init_ray

        init_ray(num_cpus=args.cpus, temp_dir=f"/tmp/vr-bt-{os.getpid()}")
        pool = ResourcePool([2], cpus_per_bundle=args.cpus / 2)
    else:
        from tests.helpers.sim_cluster import simulated_cluster

        sim = contextlib.ExitStack()
        sim.enter_context(
            simulated_cluster(head={"num_cpus": args.cpus / 2}, nodes=[{"num_cpus": args.cpus / 2}])
        )
        pool = ResourcePool([1, 1], cpus_per_bundle=args.cpus / 2, strategy="STRICT_PACK")
    try:
        group = WorkerGroup(pool, BenchRollout, args.prompt, args.response)
        prompts = args.rows // args.n
        results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for round_index in range(args.rounds + 1):
            for name, on in configs.items():
                group.set_features(sorted(on))
                figures = step(group, prompts, args.n, round_index)
                if round_index:  # round 0 warms up
                    results[name].append(figures)
                print(
                    f"  {nodes} node(s) round {round_index} {name:>12}: {figures['wall_s']:.2f} s", flush=True
                )
        group.shutdown()
    finally:
        if sim is not None:
            sim.close()
        else:
            ray.shutdown()
    return {
        name: {k: statistics.median(f[k] for f in rows) for k in rows[0]} for name, rows in results.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1280)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpus", type=float, default=2.0)
    parser.add_argument("--nodes", default="1,2")
    parser.add_argument("--features", default=",".join(FEATURES))
    parser.add_argument("--base", default=",".join(FEATURES), help="the features on in 'all'")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.features = [f for f in args.features.split(",") if f]
    args.base = [f for f in args.base.split(",") if f]
    unknown = [f for f in (*args.features, *args.base) if f not in FEATURES]
    if unknown or args.rows % args.n:
        print(
            f"bench_transport: --features takes {', '.join(FEATURES)} and --rows a multiple of --n",
            file=sys.stderr,
        )
        return 2
    report: dict[str, Any] = {
        "shape": {"rows": args.rows, "n": args.n, "prompt": args.prompt, "response": args.response},
        "rounds": args.rounds,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, ray {ray.__version__}",
        "clusters": {},
    }
    for nodes in (int(k) for k in args.nodes.split(",")):
        medians = run_cluster(nodes, args)
        report["clusters"][f"{nodes}-node"] = medians
        base = medians["all"]
        print(
            f"\n{nodes} node(s), {args.rows} rows, P={args.prompt}, R={args.response}, median of {args.rounds}"
        )
        print(
            f"{'config':>12} {'step s':>8} {'x all':>6} {'sent MB':>8} {'recv MB':>8} {'held MB':>8} {'x all':>6}"
        )
        for name, m in medians.items():
            print(
                f"{name:>12} {m['wall_s']:8.2f} {m['wall_s'] / base['wall_s']:6.2f} {m['sent'] / 1e6:8.2f} "
                f"{m['received'] / 1e6:8.2f} {m['held'] / 1e6:8.2f} {m['held'] / base['held']:6.2f}"
            )
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
