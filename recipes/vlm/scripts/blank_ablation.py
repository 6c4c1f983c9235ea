"""Is the picture used? Held-out greedy accuracy of trained models with their pictures and with blank ones.

    python recipes/vlm/scripts/blank_ablation.py RUN_DIR [RUN_DIR ...] --test TEST.parquet [--base MODEL_DIR]

For each run folder (``verity train`` / ``verity-harness run`` output with a final checkpoint)
the actor is exported to ``RUN_DIR/hf`` and evaluated on the held-out file twice: with its
pictures, and with every picture replaced by a blank one (the task's ``blank_picture``; same
questions, same answers). ``--base`` adds the warm-start model folder as a row. The table also
gives the image-blind ceiling: the accuracy of always answering the test split's most common
count for the colour asked — the best any model that ignores the picture can do there.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter, defaultdict
from pathlib import Path


def image_blind_ceiling(rows: list[dict]) -> float:
    """Accuracy of answering each colour's most common count (on ``rows`` themselves), in [0, 1]."""
    by_colour: dict[str, Counter] = defaultdict(Counter)
    for row in rows:
        by_colour[row["extra_info"]["colour"]][str(row["reward_model"]["ground_truth"])] += 1
    return sum(c.most_common(1)[0][1] for c in by_colour.values()) / len(rows)


def greedy_accuracy(model_dir: str, test_file: str) -> float:
    """Held-out greedy accuracy (``verity eval``'s ``val/acc``) of ``model_dir`` on ``test_file``."""
    from verity.evaluation.held_out import evaluate_files

    report = evaluate_files(model_dir, [test_file], max_new_tokens=4, max_prompt_length=64, batch_size=128)
    return report.metrics["val/acc"]


def main() -> None:
    from verity.checkpoint.export import export_hf
    from verity_toyworld.tasks.arithmetic import read_parquet_rows, write_parquet
    from verity_toyworld.tasks.shape_count import blank_picture

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="run output folders (each with a final checkpoint)")
    parser.add_argument("--test", required=True, help="the held-out parquet (verl schema with images)")
    parser.add_argument("--base", help="the warm-start model folder, evaluated as a row too")
    parser.add_argument("--json", help="write the table here as JSON")
    args = parser.parse_args()

    rows = read_parquet_rows(args.test)
    blank_rows = [{**row, "images": [{"bytes": blank_picture(), "path": None}]} for row in rows]
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        blank_file = str(Path(tmp) / "test-blank.parquet")
        write_parquet(blank_rows, Path(blank_file))
        models = ([("warm-start", args.base)] if args.base else []) + [
            (run, str(export_hf(run, Path(run) / "hf"))) for run in args.runs
        ]
        for name, folder in models:
            table.append(
                {
                    "model": name,
                    "pictures": greedy_accuracy(folder, args.test),
                    "blank": greedy_accuracy(folder, blank_file),
                }
            )
    ceiling = image_blind_ceiling(rows)
    print(f"held-out rows: {len(rows)}; image-blind ceiling (most common count per colour): {ceiling:.3f}")
    print(f"{'model':<48} {'pictures':>9} {'blank':>7}")
    for row in table:
        print(f"{row['model']:<48} {row['pictures']:>9.3f} {row['blank']:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"ceiling": ceiling, "rows": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
