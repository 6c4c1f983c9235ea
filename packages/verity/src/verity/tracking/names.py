"""Every metric name verity logs, in one place.

Names are ``<section>/<quantity>``; MLflow and the console group by section.
Per-step training metrics (one value per RL step):

| name | meaning | unit |
|---|---|---|
| ``reward/mean``, ``/std``, ``/max``, ``/min`` | sequence reward (``scores``) over the step's samples | reward |
| ``acc/mean`` | fraction of samples the verifier judged correct | 0..1 |
| ``response_length/mean``, ``/max``, ``/min`` | response tokens per sample (``response_mask`` sum) | tokens |
| ``response_length/clip_ratio`` | fraction of responses that hit the max-new-tokens limit | 0..1 |
| ``actor/pg_loss`` | policy-gradient loss of the update (mean over mini-batches) | — |
| ``actor/kl`` | KL(actor ‖ reference), mean per response token | nats |
| ``actor/kl_loss`` | the KL term added to the loss (before its coefficient) | nats |
| ``actor/entropy`` | policy entropy, mean per response token (of the rows the update ran, see below) | nats |
| ``actor/skipped_row_fraction`` | share of the update's rows left out of forward + backward because their advantage is 0 on every token (``actor.skip_zero_advantage``) | 0..1 |
| ``actor/clip_frac`` | fraction of response tokens whose ratio was clipped | 0..1 |
| ``actor/grad_norm`` | global gradient L2 norm before clipping | — |
| ``actor/lr`` | learning rate in effect | — |
| ``critic/value_loss``, ``critic/vf_clip_frac`` | value loss and its clip fraction (PPO) | — |
| ``actor/behaviour_logprob_gap`` | mean over response tokens of ``|log pi - log pi_old|`` in the update, averaged over its mini-batches and epochs: after the first mini-batch it includes the policy's own drift; with ``actor.old_logprobs=rollout`` the sampler-vs-trainer gap plus that drift | nats |
| ``actor/rollout_logprob_gap`` | token mean over response tokens of ``|log pi_old - log mu|``: the trainer's log-probs recomputed before the update against the sampler's ``rollout_logprobs``, no update in between (in ``trainer.mode=async`` one update apart); only when the old log-probs are recomputed (``actor.old_logprobs`` resolves to ``recompute``) and the rollout recorded its own (``verity.algorithms.logprob_gap``) | nats |
| ``actor/rollout_logprob_gap_max`` | the same difference on the worst response token of the step | nats |
| ``moe/aux_loss``, ``moe/z_loss`` | a mixture-of-experts actor's load-balancing loss and router z-loss, means over its sparse layers, before ``actor.moe.*_coef`` (docs/algorithms.md, "Mixture of experts") | — |
| ``moe/router_entropy`` | entropy of the router's distribution over experts, mean over tokens and sparse layers | nats |
| ``moe/expert_load_max_over_mean``, ``/..._max`` | tokens routed to the busiest expert over the mean per expert, mean over sparse layers / the worst layer (1: balanced) | ratio |
| ``moe/replay_route_agreement`` | with ``actor.moe.routing_replay``: share of (token, layer) whose own top-k experts equal the rollout's, in the update, averaged over its mini-batches (after the first it includes the router's own movement since the rollout) | 0..1 |
| ``timing/<stage>_s`` | wall seconds spent in one stage of the step | s |
| ``perf/tokens_per_s`` | tokens (prompt + response) processed per second of step time | tokens/s |
| ``perf/generated_tokens_per_s`` | response tokens sampled per second of the generate stage | tokens/s |
| ``perf/generated_tokens`` | response tokens sampled in the step, when a stage generated more than the batch keeps (dynamic sampling); else the batch's | tokens |
| ``perf/total_tokens`` | prompt + response tokens in the step's batch | tokens |
| ``perf/actor_trained_tokens`` | prompt + response tokens the actor update ran forward + backward on, summed over its optimizer steps | tokens |
| ``perf/driver_bytes_sent`` | tensor bytes the driver sent to workers in the step's group calls | bytes |
| ``perf/driver_bytes_received`` | tensor bytes the driver got back from workers in the step | bytes |
| ``perf/mfu`` | model-FLOPs utilisation of the actor update (see verity.hardware.mfu) | 0..1 |
| ``perf/max_memory_gb`` | the largest ``memory/*_gb`` figure of the step: the peak of the busiest worker | GiB |
| ``memory/<role>/<method>_gb`` | peak memory of one group method in the step, the largest over the role's ranks: device memory allocated on an accelerator, the process's resident set on a CPU (``verity.hardware.memory``) | GiB |
| ``memory/<role>/<method>_host_gb`` | on an accelerator, the same method's peak resident set on the host | GiB |
| ``val/acc``, ``val/reward`` | held-out (validation) accuracy / mean reward | 0..1 / reward |
| ``val/response_length`` | mean response tokens on the validation set | tokens |
| ``val/avg_at_k``, ``val/pass_at_k`` | with ``rollout.val_n = k > 1`` (``verity eval -k K``): mean correctness of k sampled responses per held-out prompt (avg@k) and the unbiased pass@k, at n = k the share of prompts with a correct one among them (``verity.evaluation.validation``) | 0..1 |
| ``val/maj_at_k`` | the same k samples, majority vote over the verifiers' extracted answers (when they report one) | 0..1 |
| ``val/k`` | the k of ``val/avg_at_k``, ``val/pass_at_k``, ``val/maj_at_k`` (MLflow names cannot hold ``@``) | samples |
| ``val/sampled_response_length``, ``val/sampled_clip_ratio`` | mean tokens of the k samples, share of them that used the whole response budget | tokens / 0..1 |
"""

from __future__ import annotations

import re

REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
REWARD_MAX = "reward/max"
REWARD_MIN = "reward/min"
ACC_MEAN = "acc/mean"
RESPONSE_LENGTH_MEAN = "response_length/mean"
RESPONSE_LENGTH_MAX = "response_length/max"
RESPONSE_LENGTH_MIN = "response_length/min"
RESPONSE_LENGTH_CLIP_RATIO = "response_length/clip_ratio"
ACTOR_PG_LOSS = "actor/pg_loss"
ACTOR_KL = "actor/kl"
ACTOR_KL_LOSS = "actor/kl_loss"
ACTOR_ENTROPY = "actor/entropy"
ACTOR_SKIPPED_ROW_FRACTION = "actor/skipped_row_fraction"
ACTOR_CLIP_FRAC = "actor/clip_frac"
ACTOR_GRAD_NORM = "actor/grad_norm"
ACTOR_LR = "actor/lr"
CRITIC_VALUE_LOSS = "critic/value_loss"
CRITIC_VF_CLIP_FRAC = "critic/vf_clip_frac"
ACTOR_BEHAVIOUR_LOGPROB_GAP = "actor/behaviour_logprob_gap"
ACTOR_ROLLOUT_LOGPROB_GAP = "actor/rollout_logprob_gap"
ACTOR_ROLLOUT_LOGPROB_GAP_MAX = "actor/rollout_logprob_gap_max"
MOE_AUX_LOSS = "moe/aux_loss"
MOE_Z_LOSS = "moe/z_loss"
MOE_ROUTER_ENTROPY = "moe/router_entropy"
MOE_EXPERT_LOAD_MAX_OVER_MEAN = "moe/expert_load_max_over_mean"
MOE_EXPERT_LOAD_MAX_OVER_MEAN_MAX = "moe/expert_load_max_over_mean_max"
MOE_REPLAY_ROUTE_AGREEMENT = "moe/replay_route_agreement"
PERF_TOKENS_PER_S = "perf/tokens_per_s"
PERF_GENERATED_TOKENS_PER_S = "perf/generated_tokens_per_s"
PERF_TOTAL_TOKENS = "perf/total_tokens"
PERF_ACTOR_TRAINED_TOKENS = "perf/actor_trained_tokens"
PERF_MFU = "perf/mfu"
PERF_MAX_MEMORY_GB = "perf/max_memory_gb"
VAL_ACC = "val/acc"
VAL_REWARD = "val/reward"
VAL_RESPONSE_LENGTH = "val/response_length"
VAL_AVG_AT_K = "val/avg_at_k"
VAL_PASS_AT_K = "val/pass_at_k"
VAL_MAJ_AT_K = "val/maj_at_k"
VAL_K = "val/k"

# Stages of one RL step, in order; plug-ins may time further stages with timing().
STAGES: tuple[str, ...] = (
    "generate",
    "reward",
    "old_logprob",
    "ref",
    "values",
    "adv",
    "critic_update",
    "actor_update",
    "weight_sync",
    "step",
)

# Keys that may appear in MLflow metric and param names (MLflow's own rule).
_VALID_NAME = re.compile(r"^[/\w.\- :]+$")
_STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

# Short labels for the console progress line.
SHORT_LABELS: dict[str, str] = {
    REWARD_MEAN: "reward",
    ACC_MEAN: "acc",
    RESPONSE_LENGTH_MEAN: "len",
    ACTOR_KL: "kl",
    ACTOR_ENTROPY: "ent",
    ACTOR_GRAD_NORM: "gnorm",
    PERF_TOKENS_PER_S: "tok/s",
    VAL_ACC: "val_acc",
}

# The live metrics shown on the progress line by default.
PROGRESS_KEYS: tuple[str, ...] = (REWARD_MEAN, ACC_MEAN, RESPONSE_LENGTH_MEAN, ACTOR_KL, PERF_TOKENS_PER_S)

# Which direction is "better" when a run records its best value of a metric.
BEST_GOALS: dict[str, str] = {
    REWARD_MEAN: "max",
    ACC_MEAN: "max",
    VAL_ACC: "max",
    VAL_REWARD: "max",
    VAL_AVG_AT_K: "max",
    VAL_PASS_AT_K: "max",
    VAL_MAJ_AT_K: "max",
}


def timing(stage: str) -> str:
    """Metric name for the seconds spent in ``stage``: ``timing/<stage>_s``."""
    if not isinstance(stage, str) or not _STAGE_NAME.match(stage):
        raise ValueError(f"stage must be a lower-case identifier such as 'generate', got {stage!r}")
    return f"timing/{stage}_s"


def metric(section: str, quantity: str) -> str:
    """A metric name ``<section>/<quantity>`` checked against MLflow's allowed characters."""
    name = f"{section}/{quantity}"
    check_name(name)
    return name


def check_name(name: str) -> None:
    """Raise ValueError unless ``name`` is a non-empty MLflow-valid metric/param name."""
    if not isinstance(name, str) or not _VALID_NAME.match(name):
        raise ValueError(
            f"metric name {name!r} is invalid: use letters, digits, and _ - . / : or spaces (non-empty)"
        )
