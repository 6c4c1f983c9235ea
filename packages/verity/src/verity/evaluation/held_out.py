"""Held-out evaluation of a model folder on verl-schema files (``verity eval``): accuracy, avg@k, pass@k, maj@k.

    report = evaluate_files("outputs/run/hf", ["test.parquet"], k=8, temperature=1.0)
    report.metrics["val/pass_at_k"]

Each prompt gets ``k`` responses (greedy when ``temperature`` is 0, then ``k`` must be
1), scored by the reward function of its ``data_source`` (the same
:class:`~verity.rewards.RewardManager` a training run uses), through the evaluation path
of a training run (:mod:`verity.evaluation.validation`), with its metric names: ``k = 1``
gives ``val/acc`` (and ``val/reward``, ``val/<data_source>/acc``, ...), ``k > 1``
``val/avg_at_k``, ``val/pass_at_k``, ``val/maj_at_k`` (when the verifiers report an
extracted answer) and ``val/k``. One process, no Ray: the model runs on ``device``.

:func:`run_held_out_files` names the files a training run validated on (from its saved
config), for ``verity eval RUN`` without ``--data``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["EvalReport", "HeldOutData", "evaluate_files", "run_held_out_files"]


@dataclass
class EvalReport:
    """What :func:`evaluate_files` measured: metrics, counts and the settings used."""

    metrics: dict[str, float]
    prompts: int
    responses: int
    mean_score: float
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class HeldOutData:
    """The held-out files a run validated on: ``files`` (absolute paths), ``source`` (where they
    came from, in words) and ``max_new_tokens`` (the run's response budget, tokens; None: unknown)."""

    files: list[str]
    source: str
    max_new_tokens: int | None = None


def run_held_out_files(config: Mapping[str, Any], working_dir: str | Path | None = None) -> HeldOutData:
    """The files ``verity train`` validated on, from a run's saved ``config`` (its trainer_state.json).

    ``data.val_files`` when set, their relative paths read against ``working_dir`` (the folder
    the run ran in; None: the current folder); otherwise, for ``model.path=embedded``, the
    test split of the run's embedded preset (``model.embedded_preset``, ``embedded_sft_steps``,
    ``embedded_cache_dir``; rebuilt if the cache was cleared). FileNotFoundError names a
    val file that is gone; ValueError a config naming no held-out data.
    """
    data = config.get("data") or {}
    model = config.get("model") or {}
    budget = data.get("max_response_length")
    budget = int(budget) if isinstance(budget, int) and budget > 0 else None
    base = Path(working_dir) if working_dir else Path.cwd()
    val_files = [str(f) for f in data.get("val_files") or []]
    if val_files:
        files = [str(base / Path(f).expanduser()) for f in val_files]
        missing = [given for given, path in zip(val_files, files, strict=True) if not Path(path).is_file()]
        if missing:
            raise FileNotFoundError(
                f"the run's data.val_files: no such file(s) now: {', '.join(missing)} (read against "
                f"{base}); give the held-out files with --data FILE"
            )
        return HeldOutData(files, "the run's data.val_files", budget)
    if model.get("path") == "embedded":
        from verity.data.embedded import ensure_embedded_preset

        preset = str(model.get("embedded_preset") or "default")
        cache = model.get("embedded_cache_dir") or "~/.cache/verity/embedded"
        paths = ensure_embedded_preset(preset, cache, model.get("embedded_sft_steps"))
        return HeldOutData([str(paths.test_file)], f"the embedded {preset!r} preset's held-out split", budget)
    raise ValueError(
        "--data: the run's config names no held-out files (data.val_files is empty); give at least "
        "one verl-schema parquet/JSONL file to evaluate on"
    )


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
    from verity.engines.hf_loading import load_causal_lm
    from verity.evaluation.validation import one_response_metrics, sampled_metrics, score_pass
    from verity.rewards.manager import RewardManager
    from verity.rollout import HFRollout, SamplingParams

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
