"""The seams walkthrough in docs/architecture.md is real code: run each block, then use what it registered.

Run in a subprocess so that the registrations do not leak into other tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"

CHECKS = """
import torch
from helpers.tiny_models import make_padded_batch, seq_mean_token_mean_loss, tiny_qwen2
from verity.batch import Batch
from verity.config import load_config
from verity.engines import EngineBuildContext, OptimConfig, build_training_engine
from verity.trainer.stage_plan import build_stage_plan
from verity.trainer.stages import StepContext
from verity.workers.registry import enabled_roles

# the engine: chosen by config, built through the registry, trains and counts
cfg = load_config(["actor.engine=counting_fsdp2"])
ctx = EngineBuildContext(role="actor", load_model=tiny_qwen2, model_path="-", device=torch.device("cpu"),
                         optim=OptimConfig(lr=1e-2))
engine = build_training_engine(cfg.actor.engine, ctx)
engine.train_step(make_padded_batch(), seq_mean_token_mean_loss, 2)
assert engine.name == "counting_fsdp2" and CountingFSDP2.steps == 1

# the stage: placed after generate, and it measures
plan = build_stage_plan(cfg)
assert plan.names()[:2] == ["generate", "truncation_share"], plan.names()
stage = plan.stages[1]
step = StepContext(load_config(["data.max_response_length=3"]), None, None, None, step=1)
stage.run(step, Batch.from_dict({"response_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}))
assert step.metrics["response/truncated_share"] == 0.5

# the role: enabled for every run, and its method scores rows
assert "length_judge" in [r.name for r in enabled_roles(cfg)]
judge = LengthJudge(cfg)
out = judge.judge(Batch.from_dict({"response_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}))
assert torch.allclose(out["length_score"], torch.tensor([0.25, 0.5]))
print("walkthrough ok")
"""


def _blocks() -> list[str]:
    text = DOC.read_text()
    section = text.split("## Seams", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_walkthrough_blocks_run_and_their_components_work() -> None:
    blocks = _blocks()
    assert len(blocks) == 3, "the walkthrough has one block per seam: engine, stage, role"
    script = "\n\n".join(blocks) + "\n" + CHECKS
    tests_dir = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tests_dir,
        env={**__import__("os").environ, "PYTHONPATH": tests_dir},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "walkthrough ok" in done.stdout
