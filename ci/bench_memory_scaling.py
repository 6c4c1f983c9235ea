"""Per-worker peak memory of a GRPO run at 1, 2 and 4 workers: measured beside the memory plan's estimate.

    python -m ci.bench_memory_scaling [--workers 1 2 4] [--layers 6] [--steps 2] [--set KEY=VALUE ...]
                                      [--out outputs/bench/memory_scaling.json]

A Qwen2-architecture model of about 0.2B parameters — Qwen2.5-0.5B's widths and 151,936-token
vocabulary (tied embeddings), ``--layers`` decoder layers, random weights; the character
tokenizer uses the first ids — is saved in bfloat16 safetensors to a temporary folder, with
arithmetic task files. Each
worker count then runs ``verity train`` in a fresh process: GRPO with the KL loss (actor,
reference and the colocated HF rollout in every worker), FSDP2 ``sharding=full`` over gloo,
float32 weights (the vocabulary in row shards, ``fsdp2.shard_vocab``'s CPU default), ``--steps``
steps; ``--set`` adds config overrides to every run (e.g.
``rollout.dtype=bfloat16 rollout.sync_bucket_mb=64``). From the run's own records it reads

- **measured**: the largest per-step ``perf/max_memory_gb`` (a worker's resident-set
  high-water mark over each call, the largest over roles, methods and ranks), and the
  per-method peaks (``memory/actor/<method>_gb``);
- **estimated**: ``summary.json``'s ``memory_plan`` peak for the actor's pool (the plan
  checked before the workers start, :mod:`verity.launch.memory_plan`).

It prints, per worker count, both figures, the measured peak as a ratio of the 1-worker
peak (goals: <= 0.6 at 2 workers, <= 0.45 at 4) and the estimate's error (goal: within
20%). Memory does not depend on the machine's load; time is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GOALS = {2: 0.6, 4: 0.45}  # per-worker peak at N workers over the 1-worker peak
ESTIMATE_TOLERANCE = 0.20


QWEN25_05B = {"hidden": 896, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151936}


def make_model_and_task(root: Path, layers: int) -> tuple[Path, dict[str, Path]]:
    """A bf16 Qwen2 folder (Qwen2.5-0.5B's widths, ``layers`` deep) and arithmetic parquet files."""
    import torch
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tasks.arithmetic import ArithmeticConfig, write_splits
    from verity_toyworld.tiny_model import build_tiny_qwen2

    tokenizer = CharTokenizer()
    shape = QWEN25_05B
    hidden = shape["hidden"]
    model = build_tiny_qwen2(
        shape["vocab"],
        hidden=hidden,
        layers=layers,
        heads=shape["heads"],
        kv_heads=shape["kv_heads"],
        intermediate=shape["intermediate"],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    ).to(torch.bfloat16)
    folder = root / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.0f}M parameters, hidden {hidden}, {layers} layers, bf16 files in {folder}")
    files = write_splits(
        root / "data", num_train=64, num_test=16, seed=0, config=ArithmeticConfig(digits=2, style="expr")
    )
    return folder, files


def run_one(
    workers: int, model: Path, files: dict[str, Path], steps: int, out: Path, extra: list[str]
) -> dict[str, Any]:
    """One ``verity train`` at ``workers`` workers; its measured and estimated peaks in GiB."""
    overrides = [
        f"model.path={model}",
        f"data.train_files=[{files['train']}]",
        f"data.val_files=[{files['test']}]",
        "data.train_batch_size=8",
        "data.max_prompt_length=32",
        "data.max_response_length=16",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=4",
        "algorithm.kl.use_kl_loss=true",
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        f"trainer.n_workers={workers}",
        f"trainer.cpus_per_worker={2 / max(workers, 2)}",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *extra,
    ]
    env = dict(os.environ, PYTHONHASHSEED="0")
    done = subprocess.run(
        [sys.executable, "-m", "verity.cli.main", "train", *overrides],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(
            f"{workers} worker(s): verity train exited {done.returncode}:\n{done.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    plan = summary.get("memory_plan") or {}
    estimate = max((v for k, v in plan.items() if k.endswith("/peak_gb")), default=float("nan"))
    step_peaks = [r["perf/max_memory_gb"] for r in rows if "perf/max_memory_gb" in r]
    by_method: dict[str, float] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("memory/") and k.endswith("_gb"):
                by_method[k] = max(by_method.get(k, 0.0), v)
    return {
        "workers": workers,
        "measured_gb": max(step_peaks),
        "estimated_gb": estimate,
        "by_method_gb": by_method,
        "ran": {
            k: v
            for k, v in summary.get("ran", {}).items()
            if "weights_loaded" in k or "vocab_sharded" in k or k == "actor_sharding"
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run"
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="outputs/bench/memory_scaling.json")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="verity-memory-") as tmp:
        root = Path(tmp)
        model, files = make_model_and_task(root, args.layers)
        for workers in args.workers:
            result = run_one(workers, model, files, args.steps, root / f"run{workers}", list(args.set))
            results.append(result)
            print(
                f"{workers} worker(s): measured {result['measured_gb']:.2f} GiB per worker, "
                f"estimated {result['estimated_gb']:.2f}",
                flush=True,
            )
    base = next((r["measured_gb"] for r in results if r["workers"] == 1), None)
    print("\nworkers | measured GiB | estimated GiB | estimate error | vs 1 worker | goal")
    ok = True
    for r in results:
        error = r["estimated_gb"] / r["measured_gb"] - 1
        ratio = r["measured_gb"] / base if base else float("nan")
        goal = GOALS.get(r["workers"])
        meets = (goal is None or ratio <= goal) and abs(error) <= ESTIMATE_TOLERANCE
        ok &= meets
        r.update(error=error, ratio=ratio)
        print(
            f"{r['workers']:>7} | {r['measured_gb']:>12.2f} | {r['estimated_gb']:>13.2f} | {error:>+14.0%} | "
            f"{ratio:>11.2f} | {'<= ' + str(goal) if goal else '-'} {'met' if meets else 'NOT met'}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"results": results, "goals": GOALS, "layers": args.layers, "steps": args.steps, "set": args.set}
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"\nwritten: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
