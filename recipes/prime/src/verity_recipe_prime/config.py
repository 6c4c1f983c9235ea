"""The two config sections PRIME adds: ``prm`` (the implicit PRM role) and ``prime`` (estimator, filter).

Every field has its default here and only here. ``algorithm.advantage.estimator: prime``
switches PRIME on; both sections are read only then, and a config that changes them
without it is rejected (``validate_run``), so no key is silently unused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verity.engines.optim import OptimConfig
from verity.engines.options import FSDP2Options

from verity_recipe_prime.estimator import PROCESS_REWARD_NORMS

ESTIMATOR = "prime"
PRM_UPDATES = ("before", "after", "none")
PLACEMENTS = ("colocated", "separate")


def _prm_optim() -> OptimConfig:
    return OptimConfig(lr=1e-6, grad_clip=10.0)  # verl's PRIME recipe


def prime_enabled(cfg: Any) -> bool:
    """Whether this run is PRIME (``algorithm.advantage.estimator == "prime"``)."""
    return cfg.algorithm.advantage.estimator == ESTIMATOR


def _changed(section: Any, default: Any = None) -> list[str]:
    """Dotted names of the fields of ``section`` that differ from ``default`` (the section's defaults)."""
    default = type(section)() if default is None else default
    out = []
    for f in dataclasses.fields(section):
        mine, theirs = getattr(section, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(mine) and dataclasses.is_dataclass(theirs) and type(mine) is type(theirs):
            out += [f"{f.name}.{name}" for name in _changed(mine, theirs)]
        elif mine != theirs:
            out.append(f.name)
    return out


@dataclass
class PRMConfig:
    # the implicit process reward model (role "prm"): a causal LM initialised from model_path, trained
    # online with cross-entropy on the verifier's labels; its frozen reference is the same checkpoint
    model_path: str | None = None  # None: the policy's starting checkpoint (model.path), as in the paper
    beta: float = 0.05  # r_t = beta * (log pi_prm(y_t) - log pi_ref(y_t))
    # when the PRM trains on a step's rollouts: before (then its process rewards are computed: the
    # paper's double forward) | after (rewards from the PRM as it was: single forward) | none (frozen)
    update: str = "before"
    engine: str = "fsdp2"  # training backend (verity.engines.registry)
    fsdp2: FSDP2Options = field(default_factory=FSDP2Options)
    optim: OptimConfig = field(default_factory=_prm_optim)
    mini_batch_size: int = 32  # prompts per PRM optimizer step (rows = prompts x rollout.n)
    epochs: int = 1  # passes over each step's rollouts
    micro_batch_size: int = 64  # rows per forward/backward inside a worker
    placement: str = "colocated"  # colocated: in the actor's processes | separate: its own worker group
    n_workers: int | None = None  # workers of a separate PRM group; None: trainer.n_workers
    nnodes: int | None = None  # nodes a separate PRM group spans (n_workers / nnodes each); None: fewest that fit

    def validate(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if self.update not in PRM_UPDATES:
            raise ValueError(f"update must be one of {'|'.join(PRM_UPDATES)}, got {self.update!r}")
        for key in ("mini_batch_size", "epochs", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {'|'.join(PLACEMENTS)}, got {self.placement!r}")
        if self.n_workers is not None and self.n_workers < 1:
            raise ValueError(f"n_workers must be >= 1 (or null: trainer.n_workers), got {self.n_workers}")
        if self.n_workers is not None and self.placement == "colocated":
            raise ValueError(
                f"n_workers = {self.n_workers} applies only to placement=separate; a colocated PRM "
                "runs in the actor's trainer.n_workers processes"
            )
        if self.nnodes is not None and self.placement != "separate":
            raise ValueError(f"nnodes = {self.nnodes} applies only to placement=separate (its own worker group)")
        if self.nnodes is not None and (self.nnodes < 1 or (self.n_workers or self.nnodes) % self.nnodes):
            raise ValueError(f"nnodes = {self.nnodes}: the PRM group's n_workers must divide over its nodes")
        try:
            self.optim.validate()
        except ValueError as err:
            raise ValueError(f"optim.{err}") from None
        for key in ("offload_params", "offload_optimizer"):
            if getattr(self.fsdp2, key):
                raise ValueError(
                    f"fsdp2.{key}=true: the PRM's engines do not offload yet (its frozen reference shares "
                    "prm.fsdp2, and its workers form no process group for host tensors); set it to false"
                )
        if self.model_path is not None and not (Path(self.model_path).expanduser() / "config.json").is_file():
            raise ValueError(f"model_path {self.model_path!r} is not a local HF checkpoint folder")
        from verity.engines.registry import TRAINING_ENGINES
        from verity.registry import UnknownNameError

        try:
            TRAINING_ENGINES.get(self.engine)
        except UnknownNameError as err:
            raise ValueError(f"engine: {err}") from None

    def n_ranks(self, cfg: Any) -> int:
        """Data-parallel ranks the PRM trains on in this run."""
        if self.placement == "separate" and self.n_workers is not None:
            return self.n_workers
        return cfg.trainer.n_workers

    def validate_run(self, cfg: Any) -> None:
        """Checks that need the whole run config (called by the runtime after :meth:`validate`)."""
        if not prime_enabled(cfg):
            changed = _changed(self)
            if changed:
                raise ValueError(
                    f"prm.{', prm.'.join(changed)} set, but the PRM runs only with "
                    f"algorithm.advantage.estimator=prime (it is {cfg.algorithm.advantage.estimator!r})"
                )
            return
        rows = self.mini_batch_size * cfg.rollout.n
        ranks = self.n_ranks(cfg)
        if rows % ranks:
            raise ValueError(
                f"a PRM mini-batch of prm.mini_batch_size x rollout.n = {self.mini_batch_size} x "
                f"{cfg.rollout.n} = {rows} rows does not divide over the PRM's {ranks} workers"
            )


@dataclass
class FilterConfig:
    # keep the prompts whose sample accuracy (mean of `acc` over the group) lies in
    # [accuracy_lower, accuracy_upper]; the step trains the PRM and the actor on those only
    enabled: bool = True
    accuracy_lower: float = 0.2  # inclusive
    accuracy_upper: float = 0.8  # inclusive
    # prompt batches of data.train_batch_size drawn and sampled per step; the step keeps at most
    # data.train_batch_size groups in range (first drawn first). verl's oversample_factor
    oversample: int = 1

    def validate(self) -> None:
        if not 0.0 <= self.accuracy_lower <= self.accuracy_upper <= 1.0:
            raise ValueError(
                "need 0 <= accuracy_lower <= accuracy_upper <= 1, got "
                f"[{self.accuracy_lower}, {self.accuracy_upper}]"
            )
        if self.oversample < 1:
            raise ValueError(f"oversample must be >= 1, got {self.oversample}")
        if self.oversample > 1 and not self.enabled:
            raise ValueError("oversample > 1 needs the filter enabled (it chooses which groups to keep)")


@dataclass
class PrimeConfig:
    # PRIME's advantage (RLOO over outcomes + leave-one-out return of the process rewards) and its
    # prompt filter; read when algorithm.advantage.estimator=prime
    outcome_weight: float = 1.0  # w_o: weight of the RLOO outcome term (verl: reward_gt_coef)
    process_weight: float = 1.0  # w_p: weight of the process-reward term (verl: reward_dpo_coef)
    gamma: float = 1.0  # discount of the process return (the paper: 1)
    # none | max_abs_return: divide the process rewards by the batch's largest |return| (verl's batch_norm)
    process_reward_norm: str = "none"
    whiten: bool = False  # whiten the advantages over the batch's response tokens (verl does)
    filter: FilterConfig = field(default_factory=FilterConfig)

    def validate(self) -> None:
        if self.outcome_weight < 0 or self.process_weight < 0:
            raise ValueError(
                f"outcome_weight and process_weight must be >= 0, got {self.outcome_weight}, {self.process_weight}"
            )
        if self.outcome_weight == 0 and self.process_weight == 0:
            raise ValueError("outcome_weight and process_weight are both 0: the advantage would be 0")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if self.process_reward_norm not in PROCESS_REWARD_NORMS:
            raise ValueError(
                f"process_reward_norm must be one of {'|'.join(PROCESS_REWARD_NORMS)}, "
                f"got {self.process_reward_norm!r}"
            )
        try:
            self.filter.validate()
        except ValueError as err:
            raise ValueError(f"filter.{err}") from None

    def validate_run(self, cfg: Any) -> None:
        """Checks that need the whole run config (called by the runtime after :meth:`validate`)."""
        if not prime_enabled(cfg):
            changed = _changed(self)
            if changed:
                raise ValueError(
                    f"prime.{', prime.'.join(changed)} set, but PRIME runs only with "
                    f"algorithm.advantage.estimator=prime (it is {cfg.algorithm.advantage.estimator!r})"
                )
            return
        if cfg.algorithm.kl.use_kl_in_reward:
            raise ValueError(
                "algorithm.kl.use_kl_in_reward is not supported with the prime estimator (its advantage "
                "combines the outcome and process rewards only); use algorithm.kl.use_kl_loss instead"
            )
