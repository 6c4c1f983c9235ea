"""A plug-in used by verity's tests: everything here reaches the runtime through its seams.

``register()`` (the entry point in group ``verity.plugins``) adds:

- the config section ``demo:`` (:class:`DemoConfig`), with a check of its own
  (``validate``) and one that reads the rest of the run config (``validate_run``);
- the advantage estimator ``demo_centered`` (score minus the batch mean, no groups);
- the role ``demo_probe``, colocated with the actor when ``demo.enabled``: each rank
  reports its process id and whether this plug-in's estimator is registered *in that
  worker process* (it is only if the runtime loaded the plug-in there);
- a stage planner that, when ``demo.enabled``, inserts the stage ``demo_bonus`` after
  ``reward``: it adds ``demo.bonus`` to every score and asks the probe role to run.

No file of the runtime names this package; a test installs it and trains with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from verity.algorithms.advantages_base import register_advantage_estimator
from verity.algorithms.registry import ADVANTAGE_ESTIMATORS
from verity.batch import Batch
from verity.config import register_config_section
from verity.controller import Dispatch, Worker, register
from verity.rewards.manager import token_rewards_from_scores
from verity.trainer.stage_plan import StagePlan, register_stage_planner
from verity.trainer.stages import Stage, StepContext
from verity.workers.registry import RoleDef, register_role


@dataclass
class DemoConfig:
    enabled: bool = False  # insert the demo_bonus stage and start the demo_probe role
    bonus: float = 0.0  # added to every sample's score

    def validate(self) -> None:
        if self.bonus < 0:
            raise ValueError(f"bonus must be >= 0, got {self.bonus}")

    def validate_run(self, cfg) -> None:
        if self.enabled and cfg.rollout.n < 2:
            raise ValueError(f"enabled needs rollout.n >= 2 (a check that reads another section), got {cfg.rollout.n}")


def demo_centered(*, token_rewards, response_mask, config, **_):
    """``A_i = s_i - mean(s)`` over the whole batch, broadcast over the response tokens."""
    scores = token_rewards.sum(dim=-1)
    advantages = (scores - scores.mean()).unsqueeze(-1) * response_mask
    return advantages, scores.unsqueeze(-1) * response_mask


class DemoProbeWorker(Worker):
    """Reports, per rank, where it runs and what this process's registries hold."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    @register(Dispatch.BROADCAST)
    def init_model(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    @register(Dispatch.DP_SPLIT)
    def probe(self, batch: Batch) -> Batch:
        rows = len(batch)
        return Batch.from_dict(
            {
                "demo_pid": torch.full((rows,), os.getpid(), dtype=torch.long),
                "demo_registered": torch.full((rows,), float("demo_centered" in ADVANTAGE_ESTIMATORS)),
            }
        )


def demo_bonus(ctx: StepContext, batch: Batch) -> Batch:
    """Add ``demo.bonus`` to every score; record which processes ran the probe."""
    batch["scores"] = batch["scores"] + ctx.cfg.demo.bonus
    batch["token_rewards"] = token_rewards_from_scores(batch["scores"], batch["response_mask"])
    probe = ctx.role("demo_probe").probe(batch.select("responses"))
    pids = set(probe["demo_pid"].tolist())
    ctx.metrics["demo/probe_processes"] = float(len(pids))
    ctx.metrics["demo/driver_in_probe"] = float(os.getpid() in pids)
    ctx.metrics["demo/registered_in_workers"] = float(probe["demo_registered"].min())
    return batch


def plan_demo(cfg, plan: StagePlan) -> None:
    if cfg.demo.enabled:
        plan.insert_after("reward", Stage("demo_bonus", demo_bonus))


def register() -> None:
    """The entry point: register every component above."""
    from verity.batch import declared_keys, register_key

    register_config_section("demo", DemoConfig, provider="verity-demo-plugin")
    register_advantage_estimator("demo_centered")(demo_centered)
    for key, dtype, meaning in (
        ("demo_pid", "int", "process id of the worker that probed the row"),
        ("demo_registered", "float", "1 when the demo estimator is registered in that worker"),
    ):
        if key not in declared_keys():
            register_key(key, ("B",), dtype, meaning)
    register_role(
        RoleDef(
            "demo_probe",
            DemoProbeWorker,
            enabled=lambda cfg: cfg.demo.enabled,
            args=lambda cfg, inputs: (cfg,),
            order=50,
        )
    )
    register_stage_planner("demo", plan_demo)
