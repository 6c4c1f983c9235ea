"""verl's key names and common synonyms, mapped to verity's keys, for "did you mean" on an unknown key.

:func:`verity.config.keys.check_keys` lists every unknown key with its closest known
name. Spelling distance alone misses the keys people actually type: verl's names
(``actor_rollout_ref.actor.optim.lr``, ``trainer.save_freq``) and other frameworks'
(``learning_rate``, ``num_generations``). :func:`alias_for` looks an unknown key up here
first, in this order:

0. :data:`KEYS`: the key as typed (a verl section typed whole: ``actor_rollout_ref``);
1. :data:`PREFIXES`: verl's section prefix rewritten to verity's
   (``actor_rollout_ref.actor.`` -> ``actor.``); the rest of the steps see the rewritten key;
2. :data:`KEYS`: a whole key (after step 1) -> one or more verity keys;
3. :data:`LEAF_SYNONYMS`: the last part renamed within its section (``learning_rate`` -> ``lr``);
4. :data:`NAME_KEYS`: the last part alone -> a verity key wherever it was typed
   (``rollout.n_samples`` -> ``rollout.n``).

Only keys that exist in the schema are suggested (``tests/unit/test_config_keys.py`` checks
every target of these tables, so they cannot point at a key that was renamed).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["KEYS", "LEAF_SYNONYMS", "NAME_KEYS", "NOTES", "PREFIXES", "alias_for"]

# verl's section prefixes -> verity's (longest first is not needed: none is a prefix of another)
PREFIXES: dict[str, str] = {
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.rollout.": "rollout.",
    # the reference policy runs in the actor's workers, with the actor's batch settings
    "actor_rollout_ref.ref.": "actor.",
    "actor_rollout_ref.model.": "model.",
    "custom_reward_function.": "reward.custom_",
}

# whole keys (verl's, as typed or after the prefix rewrite) -> verity keys; a tuple: each of them
KEYS: dict[str, str | tuple[str, ...]] = {
    # verl's sections typed whole (a config file's ``actor_rollout_ref:``)
    "actor_rollout_ref": ("actor", "rollout", "model"),
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.rollout": "rollout",
    "actor_rollout_ref.ref": "actor",
    "actor_rollout_ref.model": "model",
    "custom_reward_function": ("reward.custom_path", "reward.custom_name"),
    # the reference's own offload (before the prefix rewrite, which would make it the actor's)
    "actor_rollout_ref.ref.fsdp_config.param_offload": "actor.reference.offload_params",
    "actor_rollout_ref.ref.fsdp_config.offload_policy": "actor.reference.offload_params",
    # model
    "model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "model.lora_rank": "actor.lora.rank",
    "model.lora_alpha": "actor.lora.alpha",
    "model.target_modules": "actor.lora.target_modules",
    "model.exclude_modules": "actor.lora.exclude_modules",
    "model.tokenizer": "model.tokenizer_path",
    # data
    "data.filter_overlong_prompts": "data.truncation",
    "data.seed": "trainer.seed",
    "data.val_batch_size_per_gpu": "data.val_batch_size",
    # actor (and the reference policy, whose prefix maps here)
    "actor.ppo_micro_batch_size": "actor.micro_batch_size",
    "actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor.log_prob_micro_batch_size": "actor.micro_batch_size",
    "actor.log_prob_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor.clip_ratio": ("actor.policy_loss.clip_ratio_low", "actor.policy_loss.clip_ratio_high"),
    "actor.clip_ratio_low": "actor.policy_loss.clip_ratio_low",
    "actor.clip_ratio_high": "actor.policy_loss.clip_ratio_high",
    "actor.clip_ratio_c": "actor.policy_loss.clip_ratio_c",
    "actor.loss_agg_mode": "actor.policy_loss.loss_agg_mode",
    "actor.policy_loss.loss_mode": "actor.policy_loss.name",
    "actor.use_kl_loss": "algorithm.kl.use_kl_loss",
    "actor.kl_loss_coef": "algorithm.kl.kl_loss_coef",
    "actor.kl_loss_type": "algorithm.kl.kl_loss_kind",
    "actor.grad_clip": "actor.optim.grad_clip",
    "actor.optim.lr_warmup_steps": "actor.optim.warmup_steps",
    "actor.optim.lr_warmup_steps_ratio": "actor.optim.warmup_ratio",
    "actor.optim.warmup_style": "actor.optim.scheduler",
    "actor.optim.lr_scheduler_type": "actor.optim.scheduler",
    "actor.fsdp_config": "actor.fsdp2",
    "actor.ulysses_sequence_parallel_size": "actor.fsdp2.ulysses_sequence_parallel_size",
    "critic.ulysses_sequence_parallel_size": "critic.fsdp2.ulysses_sequence_parallel_size",
    "actor.fsdp_config.param_offload": "actor.fsdp2.offload_params",
    "actor.fsdp_config.offload_policy": "actor.fsdp2.offload_params",
    "actor.fsdp_config.optimizer_offload": "actor.fsdp2.offload_optimizer",
    "actor.strategy": "actor.engine",
    # verl's dynamic batch size: ranks balanced by tokens, micro-batches cut by a token budget
    "actor.use_dynamic_bsz": ("actor.balance_tokens", "actor.fsdp2.micro_batch_tokens"),
    "actor.log_prob_use_dynamic_bsz": ("actor.balance_tokens", "actor.fsdp2.micro_batch_tokens"),
    "actor.ppo_max_token_len_per_gpu": "actor.fsdp2.micro_batch_tokens",
    "actor.log_prob_max_token_len_per_gpu": "actor.fsdp2.micro_batch_tokens",
    # rollout
    "rollout.name": "rollout.engine",
    "rollout.response_length": "data.max_response_length",
    "rollout.prompt_length": "data.max_prompt_length",
    "rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "rollout.log_prob_micro_batch_size": "rollout.micro_batch_size",
    "rollout.log_prob_micro_batch_size_per_gpu": "rollout.micro_batch_size",
    "rollout.val_kwargs.temperature": "rollout.val_temperature",
    "rollout.val_kwargs.top_p": "rollout.val_top_p",
    "rollout.val_kwargs.n": "rollout.val_n",
    "rollout.multi_turn": "rollout.agent",
    "rollout.log_prob_use_dynamic_bsz": ("actor.balance_tokens", "actor.fsdp2.micro_batch_tokens"),
    "rollout.log_prob_max_token_len_per_gpu": "actor.fsdp2.micro_batch_tokens",
    # critic
    "critic.model.path": "critic.model_path",
    "critic.ppo_micro_batch_size": "critic.micro_batch_size",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size",
    "critic.forward_micro_batch_size_per_gpu": "critic.micro_batch_size",
    "critic.grad_clip": "critic.optim.grad_clip",
    "critic.optim.lr_warmup_steps": "critic.optim.warmup_steps",
    "critic.optim.lr_warmup_steps_ratio": "critic.optim.warmup_ratio",
    "critic.optim.warmup_style": "critic.optim.scheduler",
    "critic.fsdp_config": "critic.fsdp2",
    "critic.model.fsdp_config": "critic.fsdp2",
    "critic.model.fsdp_config.param_offload": "critic.fsdp2.offload_params",
    "critic.model.fsdp_config.offload_policy": "critic.fsdp2.offload_params",
    "critic.model.fsdp_config.optimizer_offload": "critic.fsdp2.offload_optimizer",
    "critic.strategy": "critic.engine",
    "critic.use_dynamic_bsz": ("critic.balance_tokens", "critic.fsdp2.micro_batch_tokens"),
    "critic.ppo_max_token_len_per_gpu": "critic.fsdp2.micro_batch_tokens",
    "critic.forward_max_token_len_per_gpu": "critic.fsdp2.micro_batch_tokens",
    # algorithm
    "algorithm.adv_estimator": "algorithm.advantage.estimator",
    "algorithm.gamma": "algorithm.advantage.gamma",
    "algorithm.lam": "algorithm.advantage.lam",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.advantage.norm_by_std",
    "algorithm.use_kl_in_reward": "algorithm.kl.use_kl_in_reward",
    "algorithm.kl_penalty": "algorithm.kl.kl_in_reward_kind",
    "algorithm.kl_ctrl": "algorithm.kl",
    "algorithm.kl_ctrl.type": "algorithm.kl.kl_ctrl",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl.kl_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl.kl_target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl.kl_horizon",
    # reward (verl's custom_reward_function.path/name arrive here via PREFIXES)
    "reward.custom_reward_kwargs": "reward.custom_kwargs",
    "reward_model.model.path": "reward_model.model_path",
    "reward_model.enable": "reward_model.enabled",
    # trainer
    "trainer.total_epochs": "trainer.total_steps",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.epochs": "trainer.total_steps",
    "trainer.max_steps": "trainer.total_steps",
    "trainer.n_gpus_per_node": "trainer.n_workers_per_node",
    "trainer.num_nodes": "trainer.nnodes",
    "trainer.logger": ("trainer.tracking_uri", "trainer.experiment_name"),
    "trainer.project_name": "trainer.experiment_name",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.save_freq": "trainer.checkpoint.every",
    "trainer.max_actor_ckpt_to_keep": "trainer.checkpoint.keep",
    "trainer.test_freq": "trainer.val_every",
    "trainer.resume_mode": "trainer.resume",
    "trainer.resume_from_path": "trainer.resume",
}

# a sentence added to the suggestion of these keys (after the prefix rewrite)
NOTES: dict[str, str] = {
    "actor_rollout_ref": "verl's actor_rollout_ref.actor.* is actor.*, .rollout.* rollout.*, .model.* model.*",
    "trainer.logger": "verity always logs to MLflow; these choose the store and the experiment",
    "trainer.total_epochs": "verity counts RL steps: epochs x training rows / data.train_batch_size",
    "trainer.epochs": "verity counts RL steps: epochs x training rows / data.train_batch_size",
    "data.filter_overlong_prompts": "data.truncation=filter drops prompts over data.max_prompt_length",
}
# verl's dynamic batch size and its token budgets
_DYNAMIC_BSZ_NOTE = (
    "verl's use_dynamic_bsz is two settings here: balance_tokens (on by default) gives every rank about the "
    "same tokens, fsdp2.micro_batch_tokens cuts micro-batches longest first under a token budget; docs/engines.md"
)
_TOKEN_LEN_NOTE = (
    "fsdp2.micro_batch_tokens counts positions: rows x their padding-free window, the real tokens in a packed "
    "layout; 0 (the default) cuts by micro_batch_size rows only; docs/engines.md"
)
NOTES.update(
    {
        key: _DYNAMIC_BSZ_NOTE
        for key in (
            "actor.use_dynamic_bsz",
            "actor.log_prob_use_dynamic_bsz",
            "rollout.log_prob_use_dynamic_bsz",
            "critic.use_dynamic_bsz",
        )
    }
)
NOTES.update(
    {
        key: _TOKEN_LEN_NOTE
        for key in (
            "actor.ppo_max_token_len_per_gpu",
            "actor.log_prob_max_token_len_per_gpu",
            "rollout.log_prob_max_token_len_per_gpu",
            "critic.ppo_max_token_len_per_gpu",
            "critic.forward_max_token_len_per_gpu",
        )
    }
)
# verl's FSDP param_offload and verity's offload_params do not move the same thing at the same time
_PARAM_OFFLOAD_NOTE = (
    "verl's param_offload moves the parameter shards to host memory between phases; offload_params keeps "
    "them there and copies each layer to the device per use (verl's FSDP2 offload_policy); docs/engines.md"
)
NOTES.update(
    {
        key: _PARAM_OFFLOAD_NOTE
        for key in (
            "actor_rollout_ref.ref.fsdp_config.param_offload",
            "actor.fsdp_config.param_offload",
            "critic.model.fsdp_config.param_offload",
        )
    }
)

# the last part of a key renamed within its section: actor.optim.learning_rate -> actor.optim.lr
LEAF_SYNONYMS: dict[str, str] = {
    "learning_rate": "lr",
    "epochs": "ppo_epochs",
    "num_epochs": "ppo_epochs",
    "ppo_micro_batch_size_per_gpu": "micro_batch_size",
    "max_grad_norm": "grad_clip",
    "clip_grad": "grad_clip",
    "lr_warmup_steps": "warmup_steps",
    "lr_warmup_steps_ratio": "warmup_ratio",
    "warmup_style": "scheduler",
    "lr_scheduler_type": "scheduler",
}

# the last part of a key alone -> a verity key, whichever section it was typed in
NAME_KEYS: dict[str, str] = {
    "n_samples": "rollout.n",
    "num_samples": "rollout.n",
    "num_generations": "rollout.n",
    "num_return_sequences": "rollout.n",
    "group_size": "rollout.n",
    "max_new_tokens": "data.max_response_length",
    "max_tokens": "data.max_response_length",
    "max_completion_length": "data.max_response_length",
    "response_length": "data.max_response_length",
    "max_prompt_len": "data.max_prompt_length",
    "prompt_length": "data.max_prompt_length",
    "beta": "algorithm.kl.kl_loss_coef",
    "adv_estimator": "algorithm.advantage.estimator",
}


def alias_for(key: str, known: Callable[[str], bool]) -> tuple[str, str | None] | None:
    """``(the verity key(s) meant, a note or None)`` for the unknown ``key``, or None when no table has it.

    ``known(key)`` says whether a key exists in the schema; a translation is offered only
    when every key it names exists.
    """
    candidates: list[tuple[str | tuple[str, ...], str | None]] = []
    if key in KEYS:  # a whole verl section typed as one (a config file's actor_rollout_ref:)
        candidates.append((KEYS[key], NOTES.get(key)))
    for old, new in PREFIXES.items():
        if key.startswith(old):
            key = new + key[len(old) :]
            candidates.append((key, None))
            break
    if key in KEYS:
        candidates.append((KEYS[key], NOTES.get(key)))
    parent, _, leaf = key.rpartition(".")
    if leaf in LEAF_SYNONYMS:
        candidates.append((f"{parent}.{LEAF_SYNONYMS[leaf]}" if parent else LEAF_SYNONYMS[leaf], None))
    if leaf in NAME_KEYS:
        candidates.append((NAME_KEYS[leaf], None))
    for found, note in candidates:
        names = (found,) if isinstance(found, str) else found
        if all(known(name) for name in names):
            return " or ".join(names), note
    return None
