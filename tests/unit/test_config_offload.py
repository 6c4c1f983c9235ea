"""The offload keys in a run config: accepted on an accelerator, refused on the CPU and where they
cannot apply, verl's names translated, and what the workers build from them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import verity.config.offload_checks as offload_checks
from verity.config import ConfigError, load_config

CUDA = ["trainer.device=cuda"]
FULL = ["actor.fsdp2.sharding=full"]  # the embedded model's preset replicates the actor
KL = ["algorithm.kl.use_kl_loss=true"]
GAE = ["algorithm.advantage.estimator=gae"]


@pytest.mark.parametrize(
    "overrides",
    [
        [*FULL, "actor.fsdp2.offload_params=true"],
        ["actor.fsdp2.offload_optimizer=true"],
        ["actor.fsdp2.offload_optimizer=true", "actor.fsdp2.sharding=replicate"],
        [*GAE, "critic.fsdp2.offload_params=true", "critic.fsdp2.offload_optimizer=false"],
        [*GAE, "critic.fsdp2.offload_optimizer=true"],
        [*KL, *FULL, "actor.reference.offload_params=true"],
    ],
)
def test_offload_is_accepted_on_an_accelerator(overrides):
    cfg = load_config([*CUDA, *overrides])
    assert any(
        (cfg.actor.fsdp2.offload_params, cfg.actor.fsdp2.offload_optimizer, cfg.actor.reference.offload_params)
    ) or any((cfg.critic.fsdp2.offload_params, cfg.critic.fsdp2.offload_optimizer))


def test_auto_on_a_machine_with_an_accelerator_accepts_it_and_without_one_refuses_it(monkeypatch):
    monkeypatch.setattr(offload_checks, "_local_device_is_cpu", lambda: False)
    auto = ["trainer.device=auto", *FULL, "actor.fsdp2.offload_params=true"]
    assert load_config(auto).actor.fsdp2.offload_params
    monkeypatch.setattr(offload_checks, "_local_device_is_cpu", lambda: True)
    with pytest.raises(ConfigError, match=r"this run's device is the CPU \(trainer\.device=auto\)"):
        load_config(auto)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ([*FULL, "actor.fsdp2.offload_params=true"], "actor.fsdp2.offload_params"),
        (["actor.fsdp2.offload_optimizer=true"], "actor.fsdp2.offload_optimizer"),
        ([*GAE, "critic.fsdp2.offload_params=true"], "critic.fsdp2.offload_params"),
        ([*GAE, "critic.fsdp2.offload_optimizer=true"], "critic.fsdp2.offload_optimizer"),
        ([*KL, *FULL, "actor.reference.offload_params=true"], "actor.reference.offload_params"),
    ],
)
def test_offload_on_the_cpu_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(["trainer.device=cpu", *overrides])
    assert str(err.value) == (
        f"{key}=true moves tensors from an accelerator to host memory, and this run's device is the CPU "
        "(trainer.device=cpu), where they already are; set it to false"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [*FULL, "actor.fsdp2.offload_params=true", "actor.fsdp2.offload_optimizer=true"],
            r"actor\.fsdp2\.offload_params=true already keeps the AdamW state in host memory .*"
            r"set fsdp2\.offload_optimizer=false",
        ),
        (
            ["actor.fsdp2.offload_params=true", "actor.fsdp2.sharding=replicate"],
            r"actor\.fsdp2\.offload_params=true is FSDP2's offload policy for sharded layers, and "
            r"fsdp2\.sharding=replicate keeps a whole copy",
        ),
        (
            [*FULL, "actor.fsdp2.offload_params=true", "actor.fsdp2.cuda_graphs=true", "actor.fsdp2.compile=true"],
            r"offload_params=true with fsdp2\.cuda_graphs=true",
        ),
        (
            [*KL, "actor.reference.offload_params=true", "actor.fsdp2.sharding=replicate"],
            r"actor\.reference\.offload_params=true is FSDP2's offload policy .* actor\.fsdp2\.sharding=replicate",
        ),
        ([*FULL, "actor.fsdp2.offload_params=maybe"], r"actor\.fsdp2\.offload_params must be true or false"),
    ],
)
def test_offload_where_it_cannot_apply_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([*CUDA, *overrides])


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["actor.reference.offload_params=true"], r"no KL term .* no reference is built"),
        (["critic.fsdp2.offload_params=true"], r"this run has no critic"),
        (
            [*KL, "actor.reference.offload_params=true", "actor.lora.rank=4"],
            r"actor\.lora\.rank=4: the reference is the actor's model with its adapters off",
        ),
    ],
)
def test_offload_keys_of_parts_the_run_does_not_build_are_idle(overrides, reason):
    if any("lora" in o for o in overrides):
        pytest.importorskip("peft")
    with pytest.raises(ConfigError, match=reason):
        load_config([*CUDA, *overrides])


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor.fsdp2.offload_params"),
        ("actor_rollout_ref.actor.fsdp_config.offload_policy", "actor.fsdp2.offload_params"),
        ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", "actor.fsdp2.offload_optimizer"),
        ("actor_rollout_ref.ref.fsdp_config.param_offload", "actor.reference.offload_params"),
        ("actor_rollout_ref.ref.fsdp_config.offload_policy", "actor.reference.offload_params"),
        ("critic.model.fsdp_config.param_offload", "critic.fsdp2.offload_params"),
        ("critic.model.fsdp_config.offload_policy", "critic.fsdp2.offload_params"),
        ("critic.model.fsdp_config.optimizer_offload", "critic.fsdp2.offload_optimizer"),
    ],
)
def test_verls_offload_keys_suggest_ours(typed, meant):
    with pytest.raises(ConfigError) as err:
        load_config([f"{typed}=true"])
    assert f"{typed} [override '{typed}=true'] (did you mean {meant}" in str(err.value)
    if typed.endswith("param_offload"):  # verl's param_offload is not the same move: the note says so
        assert "verl's param_offload moves the parameter shards to host memory between phases" in str(err.value)


def test_the_reference_gets_its_own_offload_and_no_optimizer_offload():
    from verity.workers.actor_rollout import reference_options

    cfg = load_config(
        [*CUDA, *KL, *FULL, "actor.fsdp2.offload_optimizer=true", "actor.reference.offload_params=true"]
    )
    options = reference_options(cfg)
    assert options.offload_params is True and options.offload_optimizer is False
    assert options.sharding == cfg.actor.fsdp2.sharding and cfg.actor.fsdp2.offload_params is False
    cfg = load_config([*CUDA, *KL, *FULL, "actor.fsdp2.offload_params=true"])
    assert reference_options(cfg).offload_params is False  # the actor's choice is not the reference's


def test_the_process_group_gets_gloo_for_host_tensors_only_when_parameters_are_offloaded():
    from verity.workers.role_training import process_group_backend

    cuda = SimpleNamespace(dist_backend="nccl", device_type="cuda")
    assert process_group_backend(load_config(CUDA), cuda) == "nccl"
    assert process_group_backend(load_config([*CUDA, "actor.fsdp2.offload_optimizer=true"]), cuda) == "nccl"
    for overrides in (
        [*FULL, "actor.fsdp2.offload_params=true"],
        [*KL, *FULL, "actor.reference.offload_params=true"],
        [*GAE, "critic.fsdp2.offload_params=true"],
    ):
        assert process_group_backend(load_config([*CUDA, *overrides]), cuda) == "cpu:gloo,cuda:nccl"


def test_the_offload_settings_reach_the_engine():
    import torch
    from helpers.tiny_models import tiny_qwen2
    from verity.engines import OptimConfig
    from verity.engines.registry import EngineBuildContext, _build_fsdp2

    cfg = load_config([*CUDA, "actor.fsdp2.offload_optimizer=true"])
    ctx = EngineBuildContext(
        role="actor",
        load_model=tiny_qwen2,
        model_path="unused",
        device=torch.device("cpu"),
        optim=OptimConfig(lr=1e-3),
        options=cfg.actor.fsdp2,
    )
    seen = {}

    import verity.engines.fsdp2 as fsdp2

    def record(self, model, optim, **kwargs):
        seen.update(kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fsdp2.FSDP2Engine, "__init__", record)
        _build_fsdp2(ctx)
    assert seen["offload_optimizer"] is True and seen["offload_params"] is False
