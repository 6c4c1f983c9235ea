"""The DAPO recipe end to end: 2 Ray workers, every component on, killed mid-run and resumed.

`verity train --config <the recipe's cpu.yaml>` on files in the verl schema of DAPO-Math-17k
(training) and AIME 2024 (evaluation, 2 samples per problem), with a tiny model warm-started
here to answer ``Answer: N`` for small sums. The first prompt batch of the data holds only
problems whose answer the model cannot write (four digits), so step 1 must draw more prompts
(dynamic sampling refills). A run killed (SIGKILL) after step 3, resumed from its step-2
checkpoint, must log exactly the uninterrupted run's metrics step for step: the extra prompts
the resumed steps draw and the samples they take are the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dapo_data import dapo_math_row, sums, write_rows

pytestmark = pytest.mark.slow

STEPS = 4
TIMEOUT_S = 600
CONFIG = Path(__file__).resolve().parents[1] / "src" / "verity_recipe_dapo" / "configs" / "cpu.yaml"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """A tiny model warm-started on ``Answer: N`` for a + b (a, b < 5), and the two files."""
    import torch
    from verity.sft import run_sft
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    root = tmp_path_factory.mktemp("dapo-e2e")
    problems = sums(5)
    impossible = [dapo_math_row(f"What is {a}000 + {a}000?", str(2000 * a)) for a in range(1, 5)]
    train = impossible + [dapo_math_row(q, a) for q, a in problems]
    val = [dapo_math_row(q, a) for q, a in problems[::3]]
    tokenizer = CharTokenizer()
    torch.manual_seed(0)
    model = build_tiny_qwen2_for(
        tokenizer, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_pos=512
    )
    taught = [{**row, "response": f"Answer: {row['reward_model']['ground_truth']}"} for row in train[4:]]
    torch.set_num_threads(1)
    run_sft(model, tokenizer, taught, 150, lr=3e-3, batch_size=16, seed=0)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return {
        "model": str(root / "model"),
        "train": write_rows(train, root / "dapo-math-17k.parquet"),
        "val": write_rows(val, root / "aime-2024.parquet"),
    }


def args(paths: dict[str, str], out: Path) -> list[str]:
    return [
        "--config",
        str(CONFIG),
        f"model.path={paths['model']}",
        "model.embedded_preset=default",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['val']}]",
        "data.shuffle=false",
        "data.train_batch_size=4",
        "data.max_prompt_length=320",
        "data.max_response_length=12",
        "rollout.n=4",
        "rollout.val_n=2",
        "actor.ppo_mini_batch_size=2",
        "actor.micro_batch_size=16",
        "actor.optim.lr=1e-3",
        "dapo.overlong_shaping.buffer_len=4",
        f"trainer.total_steps={STEPS}",
        "trainer.checkpoint.every=2",
        "trainer.cpus_per_worker=0.5",
        f"trainer.output_dir={out}",
    ]


def train(arguments: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("VERITY_DEBUG_")}
    environment.update(env)
    command = [sys.executable, "-m", "verity.cli.main", "train", *arguments]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=TIMEOUT_S)


def rows(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def deterministic(row: dict[str, float]) -> dict[str, float]:
    """The metrics that must repeat exactly (not wall-clock timings or throughputs)."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(("timing/", "perf/", "memory/")) and not k.endswith(("_per_s", "_seconds"))
    }


def test_dapo_run_killed_after_step_3_resumes_to_the_same_metrics(inputs, tmp_path):
    reference = tmp_path / "uninterrupted"
    done = train(args(inputs, reference))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (  # the sampling rounds name the stages they run
        "stages dynamic_sampling[generate, reward, overlong_shaping] -> old_log_prob -> advantage -> "
        "dapo_signal -> update_actor" in done.stdout
    )
    want = rows(reference / "metrics.jsonl")
    assert len(want) == STEPS
    assert want[0]["dapo/gen_rounds"] >= 2 and want[0]["dapo/prompts_drawn"] >= 8  # step 1 refilled
    assert all(r["dapo/zero_adv_group_share"] == 0.0 and r["dapo/groups_kept"] == 4.0 for r in want)
    assert want[0]["actor/grad_norm"] > 0
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["val_k"] == 2.0 and 0.0 <= summary["avg_at_k_after"] <= 1.0  # AIME-style evaluation ran

    out = tmp_path / "killed"
    first = train(args(inputs, out), VERITY_DEBUG_CRASH_AT="step_end:3")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert len(rows(out / "metrics.jsonl")) == 3
    second = train(args(inputs, out))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stderr and "step_2" in second.stderr
    got = rows(out / "metrics.jsonl")
    assert [r["train/step"] for r in got] == [1.0, 2.0, 3.0, 4.0]
    for mine, theirs in zip(got, want, strict=True):
        assert deterministic(mine) == deterministic(theirs), mine["train/step"]
    assert rows(out / "validation.jsonl") == rows(reference / "validation.jsonl")
