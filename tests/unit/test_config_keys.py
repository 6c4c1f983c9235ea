"""Did you mean: verl's key names and common synonyms suggest verity's keys (verity.config.key_aliases)."""

from __future__ import annotations

import pytest
from verity.config import ConfigError, VerityConfig, load_config
from verity.config.keys import schema_keys


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("actor.optim.learning_rate", "actor.optim.lr"),
        ("actor_rollout_ref.actor.optim.lr", "actor.optim.lr"),
        ("rollout.n_samples", "rollout.n"),
        ("trainer.logger", "trainer.tracking_uri or trainer.experiment_name? verity always logs to MLflow"),
        ("actor_rollout_ref.rollout.n", "rollout.n"),
        ("actor_rollout_ref.rollout.name", "rollout.engine"),
        ("actor_rollout_ref.rollout.response_length", "data.max_response_length"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor.micro_batch_size"),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "actor.micro_batch_size"),
        ("actor_rollout_ref.model.path", "model.path"),
        ("critic.ppo_micro_batch_size_per_gpu", "critic.micro_batch_size"),
        ("algorithm.adv_estimator", "algorithm.advantage.estimator"),
        ("algorithm.kl_ctrl.kl_coef", "algorithm.kl.kl_coef"),
        ("trainer.total_epochs", "trainer.total_steps"),
        ("trainer.total_training_steps", "trainer.total_steps"),
        ("trainer.n_gpus_per_node", "trainer.n_workers_per_node"),
        ("trainer.default_local_dir", "trainer.output_dir"),
        ("trainer.save_freq", "trainer.checkpoint.every"),
        ("trainer.test_freq", "trainer.val_every"),
        ("custom_reward_function.path", "reward.custom_path"),
        ("rollout.num_generations", "rollout.n"),
        ("data.max_new_tokens", "data.max_response_length"),
        ("actor.epochs", "actor.ppo_epochs"),
        ("trainer.totl_steps", "trainer.total_steps"),  # a misspelling still gets the closest name
    ],
)
def test_the_keys_people_type_suggest_the_key_they_mean(typed, meant) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([f"{typed}=1"])
    assert f"{typed} [override '{typed}=1'] (did you mean {meant}" in str(err.value)


def test_a_verl_section_in_a_config_file_names_verity_sections(tmp_path) -> None:
    path = tmp_path / "verl.yaml"
    path.write_text("defaults: [verity, _self_]\nactor_rollout_ref: {actor: {optim: {lr: 1.0e-6}}}\n")
    with pytest.raises(
        ConfigError, match=r"actor_rollout_ref \[config file\] \(did you mean actor or rollout"
    ):
        load_config([], config_file=path)


def test_every_target_of_the_alias_tables_is_a_key_of_the_schema() -> None:
    """So that a renamed key cannot leave the table suggesting a key that no longer exists."""
    from verity.config import key_aliases

    keys = schema_keys(VerityConfig)
    leaves = {k.rsplit(".", 1)[-1] for k in keys}
    for typed, meant in key_aliases.KEYS.items():
        for name in (meant,) if isinstance(meant, str) else meant:
            assert name in keys, f"KEYS[{typed!r}] -> {name!r} is not a key"
        assert typed not in keys, f"KEYS[{typed!r}] is a key already: it is never looked up"
        assert key_aliases.alias_for(typed, keys.__contains__) is not None, typed
    for old, new in key_aliases.PREFIXES.items():
        assert old.rstrip(".") not in keys and any(k.startswith(new) for k in keys), (old, new)
    for name, key in key_aliases.NAME_KEYS.items():
        assert key in keys, f"NAME_KEYS[{name!r}] -> {key!r} is not a key"
    for name, leaf in key_aliases.LEAF_SYNONYMS.items():
        assert leaf in leaves, f"LEAF_SYNONYMS[{name!r}] -> {leaf!r} is no key's last part"
    assert set(key_aliases.NOTES) <= set(key_aliases.KEYS)


def test_a_translation_to_a_key_that_does_not_exist_is_not_offered() -> None:
    from verity.config import key_aliases

    assert key_aliases.alias_for("rollout.n_samples", lambda key: False) is None
