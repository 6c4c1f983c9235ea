"""The seams: engines, rollouts, roles, stages, config sections and plug-in loading, by config."""

from __future__ import annotations

import textwrap

import pytest
from verity.config import ConfigError, load_config
from verity.trainer.stage_plan import StagePlan, StagePlanError, build_stage_plan
from verity.trainer.stages import Stage
from verity.workers.registry import enabled_roles, role_placement


def _noop(ctx, batch):
    return batch


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "rollout.engine=nonexistent",
            "rollout.engine: unknown rollout engine 'nonexistent'; known rollout engines: hf",
        ),
        (
            "actor.engine=nonexistent",
            "actor.engine: unknown training engine 'nonexistent'; known training engines: fsdp2",
        ),
    ],
)
def test_unknown_engines_fail_at_validation_naming_key_and_known(override, message) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert message in str(err.value)


def test_critic_engine_is_checked_only_when_there_is_a_critic() -> None:
    # no critic in a GRPO run: the key would be ignored, so it is rejected as idle, not looked up
    with pytest.raises(ConfigError, match="critic.engine='nonexistent': this run has no critic"):
        load_config(["critic.engine=nonexistent"])
    with pytest.raises(ConfigError, match="critic.engine: unknown training engine"):
        load_config(["critic.engine=nonexistent", "algorithm.advantage.estimator=gae"])


def test_every_unknown_key_is_listed_with_its_closest_name_and_plus_is_accepted() -> None:
    cfg = load_config(["+trainer.total_steps=3", "++actor.optim.lr=2e-5"])
    assert (cfg.trainer.total_steps, cfg.actor.optim.lr) == (3, 2e-5)
    with pytest.raises(ConfigError) as err:
        load_config(["+trainer.totl_steps=2", "rollout.temprature=0.5", "actor.optim.lr=1e-5"])
    text = str(err.value)
    assert "2 unknown config key(s)" in text
    assert "trainer.totl_steps" in text and "did you mean trainer.total_steps?" in text
    assert "rollout.temprature" in text and "did you mean rollout.temperature?" in text


def test_stage_plan_edits_by_name() -> None:
    plan = StagePlan([Stage("a", _noop), Stage("b", _noop)])
    plan.insert_after("a", Stage("x", _noop))
    plan.insert_before("a", Stage("first", _noop))
    plan.replace("b", Stage("b2", _noop))
    plan.remove("x")
    assert plan.names() == ["first", "a", "b2"]
    with pytest.raises(StagePlanError, match="no stage 'zzz' in the plan; stages: first -> a -> b2"):
        plan.insert_after("zzz", Stage("y", _noop))
    with pytest.raises(StagePlanError, match="already has a stage 'a'"):
        plan.append(Stage("a", _noop))


def test_default_plan_follows_the_config() -> None:
    assert build_stage_plan(load_config([])).names() == [
        "generate", "reward", "old_log_prob", "advantage", "update_actor"
    ]  # fmt: skip
    names = build_stage_plan(
        load_config(["algorithm.advantage.estimator=gae", "algorithm.kl.use_kl_loss=true"])
    ).names()
    assert names == [
        "generate", "reward", "old_log_prob", "ref_log_prob", "values", "advantage", "update_critic", "update_actor"
    ]  # fmt: skip


def test_roles_follow_the_config() -> None:
    assert [r.name for r in enabled_roles(load_config([]))] == ["actor"]
    cfg = load_config(
        ["algorithm.advantage.estimator=gae", "critic.placement=separate", "critic.n_workers=1"]
    )
    roles = enabled_roles(cfg)
    assert [r.name for r in roles] == ["actor", "critic"]
    assert [r.trained for r in roles] == [True, True]
    assert role_placement(roles[1], cfg) == ("separate", 1)
    with pytest.raises(ConfigError, match="critic.placement must be one of colocated|separate"):
        load_config(["algorithm.advantage.estimator=gae", "critic.placement=elsewhere"])


def test_reward_model_section_needs_a_model_folder(tmp_path) -> None:
    with pytest.raises(ConfigError, match="reward_model.enabled=true needs reward_model.model_path"):
        load_config(["reward_model.enabled=true"])
    with pytest.raises(ConfigError, match="not a local HF checkpoint folder"):
        load_config(["reward_model.enabled=true", f"reward_model.model_path={tmp_path}"])


def test_config_file_naming_a_missing_plugin_package_says_which(tmp_path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            defaults: [verity, _self_]
            plugins: [verity-recipe-absent]
            absent: {max_num_gen_batches: 4}
            """
        )
    )
    with pytest.raises(ConfigError) as err:
        load_config([], config_file=path)
    assert "needs the plug-in package(s) verity-recipe-absent" in str(err.value)
    assert "pip install verity-recipe-absent" in str(err.value)


def test_a_section_without_plugin_or_requirement_is_an_unknown_section(tmp_path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text("defaults: [verity, _self_]\nabsent: {x: 1}\n")
    with pytest.raises(ConfigError, match="section\\(s\\) absent: no such section in verity or in an installed plug-in"):
        load_config([], config_file=path)


def test_a_misspelled_key_of_a_core_section_gets_no_plugin_hint(tmp_path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("defaults: [verity, _self_]\nactor: {optim: {lrr: 1.0e-5}}\ntrainer: {total_stepz: 3}\n")
    with pytest.raises(ConfigError) as err:
        load_config(["rollout.nn=2"], config_file=path)
    message = str(err.value)
    assert "actor.optim.lrr [config file] (did you mean actor.optim.lr?)" in message
    assert "plug-in" not in message


def test_plugins_from_the_environment_load_and_a_broken_one_is_named(tmp_path, monkeypatch) -> None:
    from verity import plugins
    from verity.algorithms.registry import POLICY_LOSSES

    (tmp_path / "envplug_ok.py").write_text(
        "from verity.algorithms.registry import POLICY_LOSSES\n"
        "def register():\n    POLICY_LOSSES.add('envplug_loss', POLICY_LOSSES.get('ppo'))\n"
    )
    (tmp_path / "envplug_broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(plugins.ENV_VAR, "envplug_ok:register")
    plugins.load_plugins()
    assert "envplug_loss" in POLICY_LOSSES
    assert "envplug_ok:register" in [p.spec for p in plugins.loaded_plugins()]
    monkeypatch.setenv(plugins.ENV_VAR, "envplug_broken")
    with pytest.raises(
        ConfigError, match="plug-in 'envplug_broken' .* failed to import: RuntimeError: boom at import"
    ):
        load_config([])


def test_demo_plugin_section_is_typed_and_validated() -> None:
    pytest.importorskip("verity_demo_plugin")
    cfg = load_config(["demo.enabled=true", "demo.bonus=0.5"])
    assert (cfg.demo.enabled, cfg.demo.bonus) == (True, 0.5)
    assert "demo_bonus" in build_stage_plan(cfg).names()
    assert "demo_probe" in [r.name for r in enabled_roles(cfg)]
    assert "demo_bonus" not in build_stage_plan(load_config([])).names()  # installed but switched off
    with pytest.raises(ConfigError, match="demo: bonus must be >= 0, got -1"):
        load_config(["demo.bonus=-1"])
    with pytest.raises(ConfigError, match="did you mean demo.bonus"):
        load_config(["demo.bonuss=1"])
    with pytest.raises(ConfigError, match="demo: enabled needs rollout.n >= 2 .*, got 1"):
        load_config(["demo.enabled=true", "rollout.n=1"])  # validate_run sees the whole config


def test_config_with_plugin_sections_pickles_for_the_workers() -> None:
    pytest.importorskip("verity_demo_plugin")
    import cloudpickle

    cfg = load_config(["demo.bonus=0.5"])
    payload = cloudpickle.dumps(cfg)
    assert b"VerityConfigWithPlugins" not in payload  # the run-time class is rebuilt, never shipped
    again = cloudpickle.loads(payload)
    assert type(again) is type(cfg) and again == cfg
    assert load_config(["demo.bonus=0.25"]).demo.bonus == 0.25  # the class still composes afterwards
