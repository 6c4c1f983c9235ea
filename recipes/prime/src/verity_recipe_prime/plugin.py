"""The plug-in (entry point ``verity.plugins: prime``): what PRIME adds to the runtime.

``register()`` adds, through the runtime's seams only:

- the config sections ``prm`` (:class:`~verity_recipe_prime.config.PRMConfig`) and
  ``prime`` (:class:`~verity_recipe_prime.config.PrimeConfig`);
- the advantage estimator name ``prime`` (so ``algorithm.advantage.estimator: prime``
  validates and is what the run records; the computation runs in the ``prime_advantage``
  stage, because it needs the PRM's process rewards);
- the batch keys ``prm_ref_logprobs`` and ``prm_process_rewards``;
- the role ``prm`` (:class:`~verity_recipe_prime.prm_worker.PRMWorker`): built when the
  estimator is ``prime``, placed by ``prm.placement``, trained (checkpointed, resumed,
  exportable with ``verity export --role prm``);
- the stage planner ``prime`` (:func:`~verity_recipe_prime.stages.plan_prime`).

The runtime loads it in the driver and in every worker process.
"""

from __future__ import annotations

PROVIDER = "verity-recipe-prime"


def register() -> None:
    """Register every component listed in the module docstring."""
    from verity.algorithms.advantages_base import register_advantage_estimator
    from verity.batch import register_key
    from verity.config import register_config_section
    from verity.trainer.stage_plan import register_stage_planner
    from verity.workers.registry import RoleDef, register_role

    from verity_recipe_prime.config import ESTIMATOR, PrimeConfig, PRMConfig, prime_enabled
    from verity_recipe_prime.estimator import prime_through_generic_entry_point
    from verity_recipe_prime.prm_worker import PRMWorker
    from verity_recipe_prime.stages import PRM_ROLE, plan_prime

    register_config_section("prm", PRMConfig, provider=PROVIDER)
    register_config_section("prime", PrimeConfig, provider=PROVIDER)
    register_advantage_estimator(ESTIMATOR, needs_group=True)(prime_through_generic_entry_point)
    register_key(
        "prm_ref_logprobs",
        ("B", "R"),
        "float",
        "log-prob of each response token under the PRM's frozen reference",
    )
    register_key(
        "prm_process_rewards",
        ("B", "R"),
        "float",
        "implicit process reward beta * (log pi_prm - log pi_ref) of each response token (0 off the response)",
    )
    register_role(
        RoleDef(
            PRM_ROLE,
            PRMWorker,
            enabled=prime_enabled,
            args=lambda cfg, inputs: (cfg, inputs.model_path),
            section="prm",
            trained=True,
            order=30,
        )
    )
    register_stage_planner("prime", plan_prime)
