"""The DAPO ablation on CPU: the full recipe and each component off in turn, over seeds, as one table.

    python recipes/dapo/scripts/ablation.py                      # 5 rows x seeds 0 1 2, then the table
    python recipes/dapo/scripts/ablation.py --rows full no-dynamic-sampling --seeds 0
    python recipes/dapo/scripts/ablation.py --table-only OUT      # re-read finished runs

Each run is ``verity-harness run dapo --config cpu trainer.seed=S <the row's overrides>`` in its
own process (one at a time), its result file written under ``OUT/results``. The table gives, per
row, the mean over seeds (and the per-seed values) of: held-out avg@k and pass@k after training,
greedy accuracy after, the share of zero-advantage groups in the trained batches (mean over
steps), the policy entropy (mean over the last 20 steps), the truncated share of all sampled
responses (mean over the last 20 steps) and of the held-out samples after training, and the
training wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROWS: dict[str, list[str]] = {
    "full": [],
    "no-dynamic-sampling": ["dapo.dynamic_sampling.enabled=false"],
    "no-clip-higher": ["actor.policy_loss.clip_ratio_high=0.2"],
    "no-overlong-shaping": ["dapo.overlong_shaping.enabled=false"],
    "no-overlong-filter": ["dapo.overlong_filter.enabled=false"],
}
LAST = 20


def run(row: str, seed: int, out: Path) -> Path:
    """One harness run; returns its result file."""
    result = out / "runs" / f"{row}-seed{seed}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    if result.is_file():
        return result
    cmd = [
        sys.executable, "-m", "verity_harness.cli", "run", "dapo", "--config", "cpu",
        "--output-root", str(out / "harness"), "--results-dir", str(out / "results"),
        "--result-out", str(result), f"trainer.seed={seed}", *ROWS[row],
    ]  # fmt: skip
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=False)
    return result


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def figures(result_file: Path) -> dict[str, float | None]:
    """The table's figures of one finished run."""
    result = json.loads(result_file.read_text())
    scores = result["scores"]
    run_dir = Path(result["run_dir"])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = steps[-LAST:]
    return {
        "avg_at_k_before": scores.get("avg_at_k_before"),
        "avg_at_k_after": scores.get("avg_at_k_after"),
        "pass_at_k_after": scores.get("pass_at_k_after"),
        "accuracy_after": scores.get("accuracy_after"),
        "zero_adv_share": _mean(
            [s["dapo/zero_adv_group_share"] for s in steps if "dapo/zero_adv_group_share" in s]
        ),
        "entropy_last": _mean([s["actor/entropy"] for s in last if "actor/entropy" in s]),
        "truncated_last": _mean(
            [s["dapo/sampled_truncated_share"] for s in last if "dapo/sampled_truncated_share" in s]
        ),
        "val_clip_after": scores.get("val/sampled_clip_ratio"),
        "gen_rounds": _mean([s.get("dapo/gen_rounds", 1.0) for s in steps]),
        "wall_s": scores.get("wall_seconds"),
    }


COLUMNS = [
    ("avg@k before", "avg_at_k_before", "{:.3f}"),
    ("avg@k after", "avg_at_k_after", "{:.3f}"),
    ("pass@k after", "pass_at_k_after", "{:.3f}"),
    ("greedy acc after", "accuracy_after", "{:.3f}"),
    ("zero-adv groups", "zero_adv_share", "{:.3f}"),
    (f"entropy (last {LAST})", "entropy_last", "{:.3f}"),
    (f"truncated (last {LAST})", "truncated_last", "{:.3f}"),
    ("held-out truncated after", "val_clip_after", "{:.3f}"),
    ("rounds/step", "gen_rounds", "{:.2f}"),
    ("train s", "wall_s", "{:.0f}"),
]


def table(out: Path, rows: list[str], seeds: list[int]) -> str:
    """The markdown table: per row the mean over seeds, then the per-seed values in brackets."""
    lines = ["| row | " + " | ".join(c[0] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for row in rows:
        per_seed = []
        for seed in seeds:
            path = out / "runs" / f"{row}-seed{seed}.json"
            if path.is_file():
                per_seed.append(figures(path))
        if not per_seed:
            continue
        cells = []
        for _, key, fmt in COLUMNS:
            values = [f[key] for f in per_seed if f[key] is not None]
            if not values:
                cells.append("–")
                continue
            each = ", ".join(fmt.format(v) for v in values)
            cells.append(f"{fmt.format(statistics.fmean(values))} ({each})" if len(values) > 1 else each)
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("outputs/dapo-ablation"))
    parser.add_argument("--table-only", action="store_true", help="only print the table of finished runs")
    args = parser.parse_args(argv)
    if not args.table_only:
        for seed in args.seeds:
            for row in args.rows:
                run(row, seed, args.out)
    print(table(args.out, args.rows, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
