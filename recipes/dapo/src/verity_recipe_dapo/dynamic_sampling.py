r"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): train only on prompt groups that carry a signal.

With group-relative advantages, a group of :math:`G` samples that all score the same
(all correct or all wrong) has :math:`\hat A_i = 0` for every sample and adds nothing to
the gradient but noise in the batch size. DAPO keeps the batch full of groups with

.. math:: 0 < \left|\{o_i \mid \text{is\_equivalent}(a, o_i)\}\right| < G

by over-sampling: generate, score, drop the groups whose samples all agree on
``dapo.dynamic_sampling.metric`` (``acc``: the verifier's correctness, as in the paper;
``score``: the reward including any shaping), and while fewer than
``data.train_batch_size`` groups are kept, draw the next prompt batch from the run's
loader (``ctx.loader.next_batch()``) and generate again. The first
``train_batch_size`` kept groups, in the order they were found, are the step's batch;
the rest are dropped. After ``max_num_gen_batches`` rounds (the first included; 0 = no
cap) without a full batch the step fails with :class:`DynamicSamplingExhausted`.

Determinism and resumption: round ``r`` of step ``t`` samples with a seed that depends
only on ``(trainer.seed, t, r)`` (round 1 uses the built-in ``generate`` stage's seed),
and every extra prompt comes from the loader, whose position the checkpoint saves after
each step; a resumed run therefore draws and samples exactly what the uninterrupted run did.

The stage runs the plan's own scoring stages (``reward``, ``reward_model``,
``overlong_shaping``, ... — everything the plan had between ``generate`` and
``old_log_prob``) on each round, and any stage before ``generate`` (e.g. ReMax's
``generate_baseline``) on each round's prompts.

Per-step metrics: ``dapo/gen_rounds``, ``dapo/prompts_drawn``, ``dapo/groups_with_signal``
(over all rounds), ``dapo/groups_kept`` (= ``train_batch_size``), ``dapo/signal_share``
(groups with a signal / groups generated), ``dapo/sampled_acc_mean`` and
``dapo/sampled_truncated_share`` over every sample generated in the step;
``timing/generate_s`` and ``timing/<stage>_s`` of the scoring stages summed over the
rounds (all inside ``timing/dynamic_sampling_s``); ``perf/generated_tokens``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from verity.batch import Batch
from verity.batch.schema import declared_keys
from verity.errors import RunError
from verity.rollout.prompts import position_ids_from_mask
from verity.trainer.stages import Stage, StageFn, StepContext, sampling_for_training

from verity_recipe_dapo.overlong import tokenizer_eos_ids, truncated_rows

METRIC_KEYS = {"acc": "acc", "score": "scores"}
"""``dapo.dynamic_sampling.metric`` -> the batch key whose values must differ within a kept group."""

ROUND_SEED_BASE = 500_000_000
"""Seeds of extra rounds start here, far from the built-in per-step seeds ``seed * 1_000_003 + step``."""


class DynamicSamplingExhausted(RunError):
    """``max_num_gen_batches`` rounds did not find ``train_batch_size`` prompt groups with a signal.

    A :class:`~verity.errors.RunError`: ``verity train`` prints its sentence and exits 1, no traceback.
    """


def round_seed(seed: int, step: int, round_index: int) -> int:
    """The sampling seed of generation round ``round_index`` (1-based) of ``step``.

    Round 1 uses the built-in ``generate`` stage's seed, so with and without dynamic
    sampling a step's first samples are the same.
    """
    if round_index == 1:
        return seed * 1_000_003 + step
    return seed * 1_000_003 + ROUND_SEED_BASE + step * 1000 + round_index


def groups_with_signal(group: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the row's group has at least two different ``values`` (``group``, ``values``: ``[B]``)."""
    _, inverse = torch.unique(group, return_inverse=True)
    count = int(inverse.max()) + 1 if len(inverse) else 0
    values = values.float()
    high = torch.full((count,), -torch.inf).scatter_reduce(0, inverse, values, "amax")
    low = torch.full((count,), torch.inf).scatter_reduce(0, inverse, values, "amin")
    return (high > low)[inverse]


def prompt_width(batch: Batch) -> int | None:
    """``P`` of the prompt-aligned tensors the batch holds here (``prompts``, else ``input_ids`` minus
    ``responses``); None when it holds none of them (``batch.tensor_keys()``: rows kept on the workers
    that generated them are padded there when rows of different widths meet)."""
    local = batch.tensor_keys()
    if "prompts" in local:
        return int(batch["prompts"].shape[1])
    if "input_ids" in local and "responses" in local:
        return int(batch["input_ids"].shape[1] - batch["responses"].shape[1])
    return None


def pad_prompt_side(batch: Batch, width: int, pad_token_id: int) -> Batch:
    """Left-pad every declared prompt-aligned tensor the batch holds (dims ``[B, P]`` or ``[B, P+R]``)
    to prompt width ``width``.

    Token ids get ``pad_token_id``, masks 0; ``position_ids`` are recomputed from the padded
    ``attention_mask``. Rounds drew prompt batches of different widths; this lets them concatenate.
    """
    current = prompt_width(batch)
    if current is None:
        return batch
    extra = width - current
    if extra < 0:
        raise ValueError(f"pad_prompt_side: width {width} is below the batch's prompt width {current}")
    if extra == 0:
        return batch
    specs = declared_keys()
    out = batch.select(*batch.keys())
    for key in batch.tensor_keys():
        spec = specs.get(key)
        if spec is None or len(spec.dims) < 2 or spec.dims[1] not in ("P", "P+R"):
            continue
        value = batch[key]
        fill = 0 if spec.dtype in ("mask", "bool") else pad_token_id
        pad = torch.full(
            (value.shape[0], extra, *value.shape[2:]), fill, dtype=value.dtype, device=value.device
        )
        out[key] = torch.cat([pad, value], dim=1)
    if "position_ids" in out.tensor_keys() and "attention_mask" in out.tensor_keys():
        out["position_ids"] = position_ids_from_mask(out["attention_mask"]).to(batch["position_ids"].dtype)
    return out


def concat_rounds(parts: Sequence[Batch], pad_token_id: int) -> Batch:
    """Concatenate the kept rows of several rounds, left-padding prompts to the widest."""
    widths = [w for w in (prompt_width(part) for part in parts) if w is not None]
    if not widths:
        return Batch.concat(list(parts))
    width = max(widths)
    return Batch.concat([pad_prompt_side(part, width, pad_token_id) for part in parts])


def _timed(ctx: StepContext, name: str, fn, *args):
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        key = f"timing/{name}_s"
        ctx.metrics[key] = ctx.metrics.get(key, 0.0) + time.perf_counter() - start


def make_dynamic_sampling(before: Sequence[Stage], after: Sequence[Stage]) -> StageFn:
    """The ``dynamic_sampling`` stage: ``before`` run on each round's prompts, ``after`` on its scored rows."""

    def dynamic_sampling(ctx: StepContext, prompts: Batch) -> Batch:
        cfg = ctx.cfg
        ds = cfg.dapo.dynamic_sampling
        want, n = cfg.data.train_batch_size, cfg.rollout.n
        cap = ds.max_num_gen_batches
        pad_id = int(getattr(getattr(ctx.rewards, "tokenizer", None), "pad_token_id", None) or 0)
        eos = tokenizer_eos_ids(ctx)  # None: no truncation metric
        kept: list[Batch] = []
        kept_groups = drawn = rounds = 0
        generated = sampled = 0.0
        correct = truncated = 0.0
        signal_groups = 0
        for key in ("timing/generate_s", *(f"timing/{s.name}_s" for s in (*before, *after))):
            ctx.metrics[key] = 0.0
        while kept_groups < want:
            if cap and rounds >= cap:
                raise DynamicSamplingExhausted(
                    f"dynamic sampling, step {ctx.step}: after {rounds} generation rounds ({drawn} prompts drawn) "
                    f"only {kept_groups} of the {want} prompt groups of a batch had samples that differ in "
                    f"{ds.metric!r}; the prompts are too easy or too hard for the model. Raise "
                    f"dapo.dynamic_sampling.max_num_gen_batches (now {cap}; 0 = no cap) or change the data"
                )
            rounds += 1
            if rounds > 1:
                if ctx.loader is None:
                    raise RuntimeError(
                        "dynamic sampling needs the run's prompt loader (ctx.loader) to draw more prompts"
                    )
                prompts = ctx.loader.next_batch()
            for stage in before:
                prompts = _timed(ctx, stage.name, stage.run, ctx, prompts)
            rows = prompts.repeat_interleave(n)
            first = ctx.step * want + drawn  # group ids unique within the step (round 1: the built-in's)
            rows["group"] = torch.arange(first, first + len(prompts), dtype=torch.long).repeat_interleave(n)
            rows.meta["sampling"] = sampling_for_training(cfg)
            rows.meta["seed"] = round_seed(cfg.trainer.seed, ctx.step, rounds)
            rows = _timed(ctx, "generate", ctx.actor.generate, rows)
            for stage in after:
                rows = _timed(ctx, stage.name, stage.run, ctx, rows)
            drawn += len(prompts)
            signal = groups_with_signal(rows["group"], rows[METRIC_KEYS[ds.metric]])
            found = int(signal.sum()) // n
            signal_groups += found
            generated += float(rows["response_mask"].sum())
            sampled += len(rows)
            correct += float(rows["acc"].float().sum())
            if eos is not None:
                truncated += float(truncated_rows(rows, cfg.data.max_response_length, eos).float().sum())
            if found:
                kept.append(rows.index(signal))
                kept_groups += found
        batch = concat_rounds(kept, pad_id).index(slice(0, want * n))
        ctx.metrics.update(
            {
                "dapo/gen_rounds": float(rounds),
                "dapo/prompts_drawn": float(drawn),
                "dapo/groups_with_signal": float(signal_groups),
                "dapo/groups_kept": float(len(batch) // n),
                "dapo/signal_share": signal_groups / drawn,
                "dapo/sampled_acc_mean": correct / sampled,
                "perf/generated_tokens": generated,
            }
        )
        if eos is not None:
            ctx.metrics["dapo/sampled_truncated_share"] = truncated / sampled
        return batch

    return dynamic_sampling
