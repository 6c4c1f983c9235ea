"""Held-out evaluation of a model folder on verl-schema files (``verity eval``): accuracy, avg@k, pass@k, maj@k.

    report = evaluate_files("outputs/run/hf", ["test.parquet"], k=8, temperature=1.0)
    report.metrics["val/pass_at_k"]

Each prompt gets ``k`` responses (greedy when ``temperature`` is 0, then ``k`` must be
1), scored by the reward function of its ``data_source`` (the same
:class:`~verity.rewards.RewardManager` a training run uses), through the evaluation path
of a training run (:mod:`verity.trainer.evaluation`), with its metric names: ``k = 1``
gives ``val/acc`` (and ``val/reward``, ``val/<data_source>/acc``, ...), ``k > 1``
``val/avg_at_k``, ``val/pass_at_k``, ``val/maj_at_k`` (when the verifiers report an
extracted answer) and ``val/k``. One process, no Ray: the model runs on ``device``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["EvalReport", "evaluate_files"]


@dataclass
class EvalReport:
    """What :func:`evaluate_files` measured: metrics, counts and the settings used."""

    metrics: dict[str, float]
    prompts: int
    responses: int
    mean_score: float
    settings: dict[str, Any] = field(default_factory=dict)


def evaluate_files(
    model_path: str,
    files: Sequence[str],
    *,
    tokenizer_path: str | None = None,
    k: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    max_prompt_length: int = 1024,
    batch_size: int = 64,
    max_samples: int | None = None,
    seed: int = 0,
    reward: Any = None,
    device: str = "cpu",
) -> EvalReport:
    """Generate ``k`` responses per prompt of ``files`` with the model at ``model_path`` and score them.

    Args:
        model_path / tokenizer_path: local HF folders (tokenizer defaults to the model's).
        files: verl-schema parquet/JSONL files (``prompt``, ``data_source``, ``reward_model.ground_truth``).
        k: responses per prompt; ``temperature`` 0 (greedy) needs ``k == 1``.
        temperature / top_p: sampling settings; ``max_new_tokens``: response budget in tokens.
        max_prompt_length: longer prompts are an error naming the row (as in training).
        batch_size: prompts per generate call; ``max_samples``: evaluate only the first prompts.
        seed: the sampler's seed (the same seed gives the same responses).
        reward: the reward settings (a run config's ``reward`` section or None for defaults).
        device: ``cpu``, ``cuda``, ...
    """
    from transformers import AutoTokenizer

    from verity.data.multimodal import load_image_processor
    from verity.data.prompt_loader import PromptDataLoader
    from verity.data.verl_dataset import PromptDataset
    from verity.engines.fsdp2 import load_causal_lm
    from verity.rewards.manager import RewardManager
    from verity.rollout import HFRollout, SamplingParams
    from verity.trainer.evaluation import one_response_metrics, sampled_metrics, score_pass

    if k < 1:
        raise ValueError(f"k: expected >= 1 responses per prompt, got {k}")
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0, got {temperature}")
    if temperature == 0 and k > 1:
        raise ValueError(
            f"k = {k} responses per prompt need sampling: give a temperature > 0 (greedy repeats one)"
        )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path, local_files_only=True)
    dataset = PromptDataset(
        list(files),
        tokenizer,
        max_prompt_length=max_prompt_length,
        max_samples=max_samples,
        image_processor=load_image_processor(model_path),
    )
    loader = PromptDataLoader(dataset, batch_size, shuffle=False, drop_last=False)
    model = load_causal_lm(model_path).to(device).eval()
    rollout = HFRollout(model, tokenizer, seed=seed)
    params = SamplingParams(
        do_sample=temperature > 0,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        n=1,
    )
    with RewardManager(reward, tokenizer=tokenizer) as rewards, torch.no_grad():
        samples = score_pass(
            lambda rows: rollout.generate(rows, params), rewards, loader, k=k, budget=max_new_tokens
        )
    metrics = one_response_metrics(samples) if k == 1 else sampled_metrics(samples, seed=seed)
    settings = {
        "model_path": model_path,
        "files": list(files),
        "k": k,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "device": device,
    }
    responses = len(samples.correct)
    prompts = len(set(samples.prompt_ids))
    return EvalReport(metrics, prompts, responses, samples.score_sum / responses, settings)
