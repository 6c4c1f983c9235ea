"""Held-out evaluation: greedy (or sampled) responses scored by each row's verifier.

Rows are verl-schema dicts (``prompt``, ``data_source``,
``reward_model.ground_truth``). The default scorer looks the row's
``data_source`` up among the registered synthetic tasks (``verity.data.task_registry``); pass
``score_fn(data_source, response_text, ground_truth) -> float`` to score
anything else (e.g. the reward registry). Rows with images (verl's ``images`` column) need
the model's ``image_processor``; they are encoded as a run encodes them
(:class:`~verity.data.verl_dataset.PromptDataset`) and generated with their images.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verity.data.task_registry import task_for_data_source
from verity.rollout.hf_rollout import HFRollout
from verity.rollout.prompts import encode_prompts, prompts_of_rows
from verity.rollout.sampling import SamplingParams

ScoreFn = Callable[[str, str, str], float]


def score_with_task(data_source: str, response_text: str, ground_truth: str) -> float:
    """Score with the verifier of the synthetic task whose ``DATA_SOURCE`` is ``data_source``."""
    return float(task_for_data_source(data_source).score(response_text, ground_truth))


@dataclass
class EvaluationResult:
    """Per-row responses and scores, and their mean (``accuracy``, in [0, 1])."""

    accuracy: float
    scores: list[float] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    response_lengths: list[int] = field(default_factory=list)


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    batch_size: int = 128,
    *,
    sampling: SamplingParams | None = None,
    score_fn: ScoreFn | None = None,
    seed: int = 0,
    image_processor: Any = None,
) -> EvaluationResult:
    """Generate one response per row (greedy with 16 new tokens unless ``sampling`` says otherwise) and score it.

    Response texts are decoded without special tokens, cut at the first EOS.
    ``response_lengths`` count tokens including EOS.
    """
    if not rows:
        raise ValueError("rows: expected at least one row to evaluate, got none")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    sampling = sampling or SamplingParams(do_sample=False, max_new_tokens=16)
    if sampling.n != 1:
        raise ValueError(f"sampling.n: evaluation takes one response per row, got n={sampling.n}")
    score_fn = score_fn or score_with_task
    rollout = HFRollout(model, tokenizer, sampling=sampling, seed=seed)
    result = EvaluationResult(accuracy=0.0)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        out = rollout.generate(_prompt_batch(tokenizer, chunk, image_processor))
        responses, mask = out["responses"].cpu(), out["response_mask"].cpu()
        for row, ids, row_mask in zip(chunk, responses, mask, strict=True):
            length = int(row_mask.sum())
            text = tokenizer.decode(ids[:length].tolist(), skip_special_tokens=True)
            truth = str(row["reward_model"]["ground_truth"])
            result.scores.append(float(score_fn(row["data_source"], text, truth)))
            result.responses.append(text)
            result.response_lengths.append(length)
    result.accuracy = sum(result.scores) / len(result.scores)
    return result


def _prompt_batch(
    tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict[str, Any]], image_processor: Any
) -> Any:
    """The left-padded prompt batch of ``rows``: with their images when they carry any."""
    from verity.data.multimodal import has_images_column

    if has_images_column(rows):
        from verity.data.prompt_loader import collate_prompts
        from verity.data.verl_dataset import PromptDataset, pad_token_id_of

        dataset = PromptDataset(
            list(rows), tokenizer, max_prompt_length=1 << 30, image_processor=image_processor
        )
        return collate_prompts(dataset.records, pad_token_id_of(tokenizer))
    encoded = encode_prompts(tokenizer, prompts_of_rows(rows))
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def evaluate_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    batch_size: int = 128,
    *,
    max_new_tokens: int = 16,
    score_fn: ScoreFn | None = None,
    image_processor: Any = None,
) -> float:
    """Greedy accuracy in [0, 1]: the mean verifier score of the argmax response to each row."""
    sampling = SamplingParams(do_sample=False, max_new_tokens=max_new_tokens)
    return evaluate(
        model,
        tokenizer,
        rows,
        batch_size,
        sampling=sampling,
        score_fn=score_fn,
        image_processor=image_processor,
    ).accuracy
