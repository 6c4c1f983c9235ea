"""The DAPO plug-in: its config section, stages and stage planner, and its embedded task.

``register()`` is the entry point (group ``verity.plugins``, see ``pyproject.toml``). It adds

- the config section ``dapo:`` (:mod:`verity_recipe_dapo.config`);
- the stage planner ``dapo``, which edits a run's plan only for the components switched on:

  ====================================  ===============================================================
  ``dapo.overlong_shaping.enabled``     ``overlong_shaping`` inserted before ``old_log_prob`` (after
                                        the scoring stages)
  ``dapo.dynamic_sampling.enabled``     ``generate`` and the scoring stages folded into one
                                        ``dynamic_sampling`` stage that runs them round after round
  any component                         ``dapo_signal`` after ``advantage`` (the metrics below)
  ``dapo.overlong_filter.enabled``      ``update_actor`` replaced by the same update with truncated
                                        rows masked out of the loss
  ====================================  ===============================================================

  e.g. all on: ``dynamic_sampling -> old_log_prob -> advantage -> dapo_signal -> update_actor``;
- the embedded preset ``dapo-arith4`` and its warm-start teacher (:mod:`verity_recipe_dapo.task`).

``dapo_signal`` logs, on the batch the actor trains on: ``dapo/zero_adv_group_share``
(groups whose advantages are all zero: no gradient), ``dapo/truncated_share`` (rows with
no EOS within the budget), ``dapo/overlong_penalty_mean`` and
``dapo/overlong_penalized_share`` (with shaping), and, when dynamic sampling is off,
``dapo/sampled_acc_mean`` / ``dapo/sampled_truncated_share`` (the batch is then every
sample generated).
"""

from __future__ import annotations

import torch
from verity.batch import Batch
from verity.trainer.stage_plan import StagePlan
from verity.trainer.stages import Stage, StepContext

from verity_recipe_dapo.config import DapoConfig
from verity_recipe_dapo.dynamic_sampling import make_dynamic_sampling
from verity_recipe_dapo.overlong import overlong_filtered_update_actor, overlong_shaping, truncated_rows

PROVIDER = "verity-recipe-dapo"
ZERO = 1e-8  # |advantage| at or below this counts as zero


def zero_advantage_group_share(group: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of groups whose every response token has ``|advantage| <= 1e-8`` (``group [B]``, the rest ``[B, R]``)."""
    per_row = (advantages.abs() * mask).amax(dim=-1)
    _, inverse = torch.unique(group, return_inverse=True)
    per_group = torch.zeros(int(inverse.max()) + 1).scatter_reduce(0, inverse, per_row.float(), "amax")
    return float((per_group <= ZERO).float().mean())


def dapo_signal(ctx: StepContext, batch: Batch) -> Batch:
    """Log how much signal the trained batch carries (see the module docstring); the batch is unchanged."""
    from verity_recipe_dapo.overlong import eos_ids

    mask = batch["response_mask"].float()
    metrics = {
        "dapo/zero_adv_group_share": zero_advantage_group_share(batch["group"], batch["advantages"], mask)
    }
    truncated = truncated_rows(batch, ctx.cfg.data.max_response_length, eos_ids(ctx))
    metrics["dapo/truncated_share"] = float(truncated.float().mean())
    if "overlong_penalty" in batch:
        penalty = batch["overlong_penalty"]
        metrics["dapo/overlong_penalty_mean"] = float(penalty.mean())
        metrics["dapo/overlong_penalized_share"] = float((penalty < 0).float().mean())
    if not ctx.cfg.dapo.dynamic_sampling.enabled:
        metrics["dapo/sampled_truncated_share"] = metrics["dapo/truncated_share"]
        if "acc" in batch:
            metrics["dapo/sampled_acc_mean"] = float(batch["acc"].float().mean())
    ctx.metrics.update(metrics)
    return batch


def plan_dapo(cfg, plan: StagePlan) -> None:
    """Edit the stage plan for the DAPO components ``cfg.dapo`` switches on (table in the module docstring)."""
    d: DapoConfig = cfg.dapo
    if d.overlong_shaping.enabled:
        plan.insert_before("old_log_prob", Stage("overlong_shaping", overlong_shaping))
    if d.dynamic_sampling.enabled:  # the stages up to scoring run once per sampling round, inside it
        names = plan.names()
        last = names[names.index("old_log_prob") - 1]

        def sampling_rounds(span: list[Stage]) -> Stage:
            start = [s.name for s in span].index("generate")
            return Stage("dynamic_sampling", make_dynamic_sampling(span[:start], span[start + 1 :]))

        plan.wrap(names[0], last, sampling_rounds)
    if d.any_enabled():
        plan.insert_before("update_actor", Stage("dapo_signal", dapo_signal))  # advantages are final here
    if d.overlong_filter.enabled:
        plan.replace("update_actor", Stage("update_actor", overlong_filtered_update_actor))


def register() -> None:
    """The entry point: the ``dapo`` config section, batch keys, stage planner and embedded preset."""
    from verity.batch import declared_keys, register_key
    from verity.config import register_config_section
    from verity.trainer.stage_plan import register_stage_planner

    from verity_recipe_dapo.task import register_task

    register_config_section("dapo", DapoConfig, provider=PROVIDER)
    if "overlong_penalty" not in declared_keys():
        register_key(
            "overlong_penalty", ("B",), "float", "soft overlong punishment added to the score (DAPO)"
        )
    register_stage_planner("dapo", plan_dapo, after=("prime",))  # its sampling rounds wrap the stages PRIME adds there
    register_task()
