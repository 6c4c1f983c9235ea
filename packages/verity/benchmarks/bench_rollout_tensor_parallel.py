"""The tensor-parallel HF rollout against data-parallel whole-model replicas: throughput, weights, sync.

    python packages/verity/benchmarks/bench_rollout_tensor_parallel.py [--ranks 2] [--tp 2] [--layers 4]
        [--prompts 8] [--n 2] [--prompt-len 32] [--new-tokens 32] [--repeats 3] [--sample] [--json PATH]

``--ranks`` gloo processes (one torch thread each) build a Qwen2 model of Qwen2.5-0.5B's widths and
151,936-token vocabulary (tied embeddings, ``--layers`` layers, random weights of seed 0, float32)
and run the same job, ``--prompts`` prompts of ``--prompt-len`` random tokens x ``--n`` samples,
``--new-tokens`` generated per row (``ignore_eos``: every row generates them all; greedy, or seeded
sampling with ``--sample``), three ways:

- ``hf_generate``: transformers' ``model.generate`` (greedy, ``min_new_tokens`` = ``max_new_tokens``)
  on the whole model, each rank its ``1/ranks`` of the prompts (repeated ``n`` times);
- ``tp1``: :class:`verity.rollout.hf_rollout.HFRollout` on the whole model, each rank its
  ``1/ranks`` of the prompts (data parallel, verity's layout with one rank per rollout);
- ``tpT``: :class:`verity.rollout.hf_tensor_parallel.TensorParallelHFRollout` over ``--tp`` ranks
  (``ranks / tp`` replicas), each replica its ``tp/ranks`` of the prompts, every rank of a replica
  the same ones.

Every process holds all of them at once (the whole model, shared by ``hf_generate`` and ``tp1``;
the TP rollout's slices; an :class:`verity.engines.FSDP2Engine` over all ranks, the weights'
source). The variants take turns, one warm-up call each then ``--repeats`` timed calls; a call's
time is the slower rank's (barrier before, all ranks' times compared after), tokens/s is the whole
job's generated tokens over it (median over repeats). The resident-set high-water mark is reset
(``/proc/self/clear_refs`` 5) before each call, and a call's peak increase is the high-water mark
after it less the resident set before it (largest over the calls, warm-up included).

Weight sync: :func:`verity.resharding.sync_weights` from the FSDP2 engine into each rollout (64 MiB
buckets; the TP rollout receives only its slices, :meth:`TrainingEngine.iter_rollout_slices`),
timed likewise. ``received_bytes`` is what reached a rank over the collectives; the whole-model
sync does not count it, and the full gather's figure (the model's bytes) is reported instead.

Prints a table, the ratios ``tpT / tp1``, whether the greedy tokens of the two rollouts are equal
(TP sums partial products in another order, so a near tie may flip a token), and the load average;
``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EOS = 151643  # Qwen2.5's <|endoftext|>: the pad and EOS id (ignore_eos: never stops a row)
BUCKET_BYTES = 64 * 2**20


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key))
    return int(line.split()[1])


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _measured(fn):
    """``(fn(), seconds, peak RSS increase in bytes)``, started after a barrier."""
    dist.barrier()
    _reset_peak()
    before = _status_kib("VmRSS:")
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    return result, seconds, (_status_kib("VmHWM:") - before) * 1024


def _rank(rank: int, args: argparse.Namespace, init: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verity.engines import FSDP2Engine, OptimConfig
    from verity.resharding import sync_weights
    from verity.rollout.hf_rollout import HFRollout
    from verity.rollout.hf_tensor_parallel import TensorParallelHFRollout
    from verity.rollout.sampling import SamplingParams

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
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    torch.manual_seed(0)
    whole = Qwen2ForCausalLM(config).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    torch.manual_seed(0)
    engine = FSDP2Engine(Qwen2ForCausalLM(config), OptimConfig(lr=1e-6))
    tp_name = f"tp{args.tp}"
    replicas = args.ranks // args.tp
    mesh = init_device_mesh("cpu", (replicas, args.tp), mesh_dim_names=("replica", "tp"))["tp"]
    rollouts = {
        "tp1": HFRollout(whole, seed=1, pad_token_id=EOS, eos_token_ids=EOS),
        tp_name: TensorParallelHFRollout.from_config(
            config, tp_mesh=mesh, dtype=torch.float32, seed=1, pad_token_id=EOS, eos_token_ids=EOS
        ),
    }

    g = torch.Generator().manual_seed(1234)  # the same prompts on every rank
    prompts = torch.randint(0, 151643, (args.prompts, args.prompt_len), generator=g)
    mask = torch.ones_like(prompts)

    def part(count: int, index: int) -> dict[str, torch.Tensor]:
        size = args.prompts // count
        rows = slice(index * size, (index + 1) * size)
        return {"input_ids": prompts[rows], "attention_mask": mask[rows]}

    mine = {"tp1": part(args.ranks, rank), tp_name: part(replicas, rank // args.tp)}
    params = SamplingParams(
        do_sample=args.sample, temperature=1.0, max_new_tokens=args.new_tokens, n=args.n, ignore_eos=True
    )

    def run_rollout(variant: str) -> torch.Tensor:
        rollouts[variant].set_seed(1)  # the TP ranks must start from the same generator state
        return rollouts[variant].generate(mine[variant], params)["responses"]

    def run_hf_generate() -> torch.Tensor:
        ids = mine["tp1"]["input_ids"].repeat_interleave(args.n, dim=0)
        with torch.no_grad():
            out = whole.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=EOS,
                eos_token_id=EOS,
            )
        return out[:, ids.shape[1] :]

    result: dict = {
        "rank": rank,
        "model_bytes": model_bytes,
        "weight_bytes": {},
        "sync": {v: {"seconds": [], "peak": [], "num_bytes": None, "received_bytes": None} for v in rollouts},
        "gen": {v: {"seconds": [], "peak": []} for v in ("hf_generate", *rollouts)},
        "tokens": {},
    }
    for step in range(args.repeats + 1):  # the first round is a warm-up (its peaks are kept)
        for variant, rollout in rollouts.items():
            stats, seconds, peak = _measured(
                lambda rollout=rollout: sync_weights(engine, rollout, bucket_bytes=BUCKET_BYTES)
            )
            entry = result["sync"][variant]
            entry["peak"].append(peak)
            if step:
                entry["seconds"].append(seconds)
            entry["num_bytes"], entry["received_bytes"] = stats.num_bytes, stats.received_bytes
    for variant, rollout in rollouts.items():
        result["weight_bytes"][variant] = rollout.weight_bytes()
    result["weight_bytes"]["hf_generate"] = model_bytes
    runs = {"hf_generate": run_hf_generate, **{v: lambda v=v: run_rollout(v) for v in rollouts}}
    for step in range(args.repeats + 1):
        for variant, fn in runs.items():
            tokens, seconds, peak = _measured(fn)
            entry = result["gen"][variant]
            entry["peak"].append(peak)
            if step:
                entry["seconds"].append(seconds)
            result["tokens"][variant] = tokens.clone()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _slower(per_rank: list[list[float]]) -> float:
    """The median over repeats of the slower rank's seconds."""
    return statistics.median(max(times) for times in zip(*per_rank, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sample", action="store_true", help="seeded sampling instead of greedy decoding")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    if args.tp < 2 or args.ranks % args.tp or args.prompts % args.ranks:
        parser.error("--tp must be >= 2 and divide --ranks, and --ranks must divide --prompts")
    load_before = _loadavg()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.spawn(_rank, args=(args, init, tmp), nprocs=args.ranks, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(args.ranks)]
    wall = time.perf_counter() - start
    load_after = _loadavg()

    tp_name = f"tp{args.tp}"
    rollouts = ("tp1", tp_name)
    job_tokens = args.prompts * args.n * args.new_tokens
    figures: dict = {"args": vars(args), "job_tokens": job_tokens, "variants": {}}
    for variant in ("hf_generate", *rollouts):
        seconds = _slower([r["gen"][variant]["seconds"] for r in ranks])
        figures["variants"][variant] = {
            "gen_seconds": seconds,
            "tokens_per_s": job_tokens / seconds,
            "weight_bytes_per_rank": [r["weight_bytes"][variant] for r in ranks],
            "gen_peak_rss_increase_per_rank": [max(r["gen"][variant]["peak"]) for r in ranks],
        }
    for variant in rollouts:
        sync = [r["sync"][variant] for r in ranks]
        figures["variants"][variant].update(
            sync_seconds=_slower([s["seconds"] for s in sync]),
            sync_num_bytes_per_rank=[s["num_bytes"] for s in sync],
            sync_received_bytes_per_rank=[
                s["received_bytes"] if s["received_bytes"] is not None else r["model_bytes"]
                for s, r in zip(sync, ranks, strict=True)
            ],
            sync_received_counted=[s["received_bytes"] is not None for s in sync],
            sync_peak_rss_increase_per_rank=[max(s["peak"]) for s in sync],
        )

    # the job's tokens in prompt order: tp1 rank r holds part r, the TP replica j's ranks part j
    tp1_tokens = torch.cat([r["tokens"]["tp1"] for r in ranks])
    tp_tokens = torch.cat([ranks[j * args.tp]["tokens"][tp_name] for j in range(args.ranks // args.tp)])
    hf_tokens = torch.cat([r["tokens"]["hf_generate"] for r in ranks])
    same_in_replica = all(
        torch.equal(ranks[r]["tokens"][tp_name], ranks[r - r % args.tp]["tokens"][tp_name])
        for r in range(args.ranks)
    )
    figures["tokens"] = {
        "greedy": not args.sample,
        "tp_equal_tp1": bool(torch.equal(tp_tokens, tp1_tokens)),
        "tp_rows_equal_tp1": int((tp_tokens == tp1_tokens).all(dim=1).sum()),
        "tp_tokens_equal_tp1": int((tp_tokens == tp1_tokens).sum()),
        "hf_generate_equal_tp1": bool(torch.equal(hf_tokens, tp1_tokens)),
        "tp_ranks_agree": same_in_replica,
        "rows": tp1_tokens.shape[0],
    }
    figures["model_bytes"] = ranks[0]["model_bytes"]
    figures["loadavg"] = {"before": load_before, "after": load_after}
    figures["wall_seconds"] = wall

    mib = 2**20
    v = figures["variants"]
    print(
        f"{args.ranks} ranks (1 thread each), {args.layers} layers (Qwen2.5-0.5B widths, "
        f"{figures['model_bytes'] / mib:.0f} MiB float32), {args.prompts} prompts x {args.n} x "
        f"({args.prompt_len} prompt + {args.new_tokens} new tokens), "
        f"{'seeded sampling' if args.sample else 'greedy'}, median of {args.repeats}"
    )
    print(
        f"{'variant':12s} {'tokens/s':>9s} {'gen s':>7s} {'weights MiB/rank':>18s} {'gen peak +MiB/rank':>20s}"
        f" {'sync s':>7s} {'sync recv MiB/rank':>19s} {'sync handed MiB/rank':>21s} {'sync peak +MiB/rank':>20s}"
    )

    def per_rank(values: list[int | None]) -> str:
        return "/".join("-" if x is None else f"{x / mib:.0f}" for x in values)

    for variant in ("hf_generate", *rollouts):
        f = v[variant]
        sync = (
            f"{f['sync_seconds']:7.2f} {per_rank(f['sync_received_bytes_per_rank']):>19s}"
            f" {per_rank(f['sync_num_bytes_per_rank']):>21s} {per_rank(f['sync_peak_rss_increase_per_rank']):>20s}"
            if "sync_seconds" in f
            else f"{'-':>7s} {'-':>19s} {'-':>21s} {'-':>20s}"
        )
        print(
            f"{variant:12s} {f['tokens_per_s']:9.1f} {f['gen_seconds']:7.2f}"
            f" {per_rank(f['weight_bytes_per_rank']):>18s} {per_rank(f['gen_peak_rss_increase_per_rank']):>20s} {sync}"
        )
    if not all(v["tp1"]["sync_received_counted"]):
        print(
            "  (tp1 sync recv: not counted by the full gather; the model's bytes, what the all-gather delivers)"
        )
    tp, one = v[tp_name], v["tp1"]
    print(
        f"{tp_name} / tp1: tokens/s {tp['tokens_per_s'] / one['tokens_per_s']:.2f}x, "
        f"weight bytes/rank {max(tp['weight_bytes_per_rank']) / max(one['weight_bytes_per_rank']):.3f}x, "
        f"sync received/rank {max(tp['sync_received_bytes_per_rank']) / max(one['sync_received_bytes_per_rank']):.3f}x, "
        f"sync seconds {tp['sync_seconds'] / one['sync_seconds']:.2f}x"
    )
    print(f"tp1 / hf_generate: tokens/s {one['tokens_per_s'] / v['hf_generate']['tokens_per_s']:.2f}x")
    t = figures["tokens"]
    if args.sample:
        print("tokens equal: n/a (sampled: the replicas draw from other generator streams)")
    else:
        print(
            f"tokens equal: {t['tp_equal_tp1']} ({t['tp_rows_equal_tp1']}/{t['rows']} rows, "
            f"{t['tp_tokens_equal_tp1']}/{t['rows'] * args.new_tokens} tokens; "
            f"hf_generate equals tp1: {t['hf_generate_equal_tp1']}; TP ranks agree: {t['tp_ranks_agree']})"
        )
    print(f"load average before {load_before}, after {load_after}; wall {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
