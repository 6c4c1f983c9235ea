"""The structured run configuration: one dataclass per component, composed by Hydra.

Every field has a default here and only here (no YAML defaults that drift). A recipe
YAML or a command-line override (``actor.optim.lr=1e-5``) changes fields; an unknown
key is an error. Units are in the field comments; batch sizes count *prompts* unless
the name says rows (a row is one prompt with one response, so rows = prompts x n).

Each field declares what it accepts in its type (``Annotated[str, OneOf("sync", "async")]``,
``Annotated[int, AtLeast(1)]``: :mod:`verity.config.fields`), and each section with keys a run
may not read says which in ``idle_parts(cfg)`` (:mod:`verity.config.idle_settings`), so a new
key is one field and its comment; checks across keys live in :mod:`verity.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Annotated, Any

from verity.algorithms.configs import AdvantageConfig, KLConfig, PolicyLossConfig
from verity.config.fields import Above, AtLeast, AtMost, OneOf
from verity.config.idle_settings import (
    ADAPTIVE_KL_KEYS,
    EMBEDDED_ONLY,
    ESTIMATOR_KEYS,
    KL_IN_REWARD_KEYS,
    KL_LOSS_KEYS,
    LOSS_PREFIXES,
    IdlePart,
    engine_option_parts,
    estimators_fix,
    reference_parts,
    replicated_parts,
)
from verity.config.moe import MoEConfig
from verity.engines.lora import LoRAConfig
from verity.engines.optim import OptimConfig
from verity.engines.options import ATTN_IMPLEMENTATIONS, FSDP2Options, MegatronOptions
from verity.rollout.agent.config import AgentConfig
from verity.rollout.options import SGLangOptions, VLLMOptions


@dataclass
class ModelConfig:
    # "embedded" builds (or reuses) the tiny Qwen2 model + character tokenizer warm-started
    # by SFT on the arithmetic task; otherwise a local HF checkpoint folder.
    path: str = "embedded"
    tokenizer_path: str | None = None  # defaults to `path`
    dtype: Annotated[str, OneOf("float32", "bfloat16")] = "float32"  # parameter dtype for training
    # HF attention kernel every role loads with
    attn_implementation: Annotated[str, OneOf(*ATTN_IMPLEMENTATIONS)] = "sdpa"
    gradient_checkpointing: bool = False  # recompute activations in backward (trained roles)
    # embedded default only: which preset (task, teacher, model shape, SFT; verity_toyworld.presets),
    # its SFT warm-start steps and the cache folder
    embedded_preset: str = "default"  # default, multiply-tools, shape-count (tiny Qwen2.5-VL), moe (tiny Qwen3-MoE), a plug-in's
    # None: the preset's own (see verity_toyworld.build)
    embedded_sft_steps: Annotated[int, AtLeast(0, "0: no warm-start")] | None = None
    embedded_cache_dir: str = "~/.cache/verity/embedded"  # where the embedded default is built and reused

    def idle_parts(self, cfg: Any) -> list[IdlePart]:
        """The embedded model's keys when ``model.path`` names a checkpoint."""
        if self.path == "embedded":
            return []
        why = f"model.path is {self.path!r}, not embedded"
        return [IdlePart(f"model.{k}", why, "it applies to model.path=embedded") for k in EMBEDDED_ONLY]


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet/jsonl in the verl schema
    val_files: list[str] = field(default_factory=list)  # held-out files for validation (same schema)
    train_batch_size: Annotated[int, AtLeast(1)] = 32  # prompts per RL step
    val_batch_size: Annotated[int, AtLeast(1)] = 256  # prompts per evaluation generate call
    # verl's defaults, for real checkpoints; the embedded model's own (48, 8) apply when unset
    # (the toy world's embedded-tiny preset, verity.config.model_presets)
    max_prompt_length: Annotated[int, AtLeast(1)] = 512  # tokens
    max_response_length: Annotated[int, AtLeast(1)] = 512  # tokens
    truncation: Annotated[str, OneOf("error", "filter", "truncate_left", "truncate_right")] = "error"
    # rows not in the verl schema: error (list them) | skip (log and count them)
    on_malformed: Annotated[str, OneOf("error", "skip")] = "error"
    shuffle: bool = True  # draw training prompts in a seeded random order (resumable)
    val_max_samples: int = -1  # -1: the whole validation set


@dataclass
class RolloutConfig:
    engine: str = "hf"  # generation backend, from the rollout-engine registry (verity.rollout.registry)
    n: Annotated[int, AtLeast(1)] = 8  # samples per prompt
    temperature: Annotated[float, AtLeast(0)] = 1.0  # sampling temperature during training (0: greedy)
    # nucleus sampling: keep the smallest token set with this total probability
    top_p: Annotated[float, Above(0), AtMost(1)] = 1.0
    top_k: Annotated[int, AtLeast(-1, "0 or -1: no top-k")] = 0  # 0 (or -1): no top-k
    # held-out evaluation: 0 greedy, > 0 one sample at this temperature
    val_temperature: Annotated[float, AtLeast(0, "0: greedy")] = 0.0
    # held-out evaluation, k samples per prompt at val_temperature (> 0): val/avg_at_k and val/pass_at_k
    # beside the greedy val/acc; 1: no sampled evaluation (val/acc as val_temperature says)
    val_n: Annotated[int, AtLeast(1, "samples per held-out prompt")] = 1
    # nucleus sampling of held-out answers (val_temperature > 0); None: top_p
    val_top_p: Annotated[float, Above(0), AtMost(1)] | None = None
    micro_batch_size: Annotated[int, AtLeast(1)] = 256  # rows per generate call inside a worker
    # how a training step's generate spreads its rows over the rollout replicas: load (chunks of whole
    # prompt groups, the next chunk to whichever replica finishes first, rows put back in order; each
    # chunk seeded by its index) | split (one equal part per replica) | null: load, but split with the
    # agent loop (a chunk is one call, whose trajectories overlap their tool waits only among
    # themselves). One replica: split (docs/rollout-engines.md, "Load-balanced generation")
    balance: Annotated[str, OneOf("load", "split")] | None = None
    # rollout.balance=load: rows per chunk, rounded up to whole prompt groups (n rows each); null: the
    # batch in 8 chunks per replica (smaller chunks balance finer; each is one engine call of its rows)
    balance_chunk_rows: Annotated[int, AtLeast(1)] | None = None
    # ranks one rollout replica spans (tensor parallelism): trainer.mode=sync makes the actor's workers
    # n_workers / tensor_parallel_size replicas of consecutive ranks (inside one node), each rank holding
    # and receiving 1/tensor_parallel_size of the weights; async: the rollout group's workers
    # (docs/rollout-engines.md, "Tensor-parallel rollout")
    tensor_parallel_size: Annotated[int, AtLeast(1)] = 1
    # the dtype the rollout serves the policy in: float32 | bfloat16; null: bfloat16 on a GPU or NPU, model.dtype
    # on a CPU. A bf16 rollout of float32 training weights gets each weight sync rounded to bf16
    # (docs/rollout-engines.md, "Serving dtype")
    dtype: Annotated[str, OneOf("float32", "bfloat16")] | None = None
    # MiB of weights each weight sync gathers at once (float32 sizes). Peak extra memory of a sync on
    # several ranks: about 3x this over gloo (CPU), 2x over NCCL; fewer MiB, more collectives
    # (docs/engines.md, "Loading a checkpoint")
    sync_bucket_mb: Annotated[int, AtLeast(1)] = 256
    # trainer.mode=async: Ray workers of the rollout's own worker group
    n_workers: Annotated[int, AtLeast(1, "the async rollout group")] = 1
    nnodes: int | None = None  # trainer.mode=async: nodes that group spans (n_workers / nnodes each); None: fewest that fit
    # the vllm and sglang engines' own settings, read when rollout.engine names them
    # (docs/rollout-engines.md)
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    sglang: SGLangOptions = field(default_factory=SGLangOptions)
    # multi-turn generation with tool calls around whichever engine runs (docs/agent-loop.md)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def idle_parts(self, cfg: Any) -> list[IdlePart]:
        """Other engines' options; the async rollout group's size in sync mode; the chunk size without
        load balancing; ``val_top_p`` when greedy."""
        from verity.rollout.registry import ROLLOUT_ENGINES

        parts = engine_option_parts(self, "rollout", ROLLOUT_ENGINES)
        if cfg.trainer.mode != "async":
            why = f"trainer.mode={cfg.trainer.mode}: the rollout runs in the actor's workers"
            fix = "set trainer.mode=async for a rollout worker group of its own"
            parts.append(IdlePart("rollout.n_workers", why, fix))
            parts.append(IdlePart("rollout.nnodes", f"{why}, on the actor's nodes", fix))
        from verity.config.derived import generate_balance

        if generate_balance(cfg) == "split":
            why = f"rollout.balance={self.balance or 'null (split with the agent loop)'}: each replica gets one equal part, no chunks"
            parts.append(
                IdlePart("rollout.balance_chunk_rows", why, "set rollout.balance=load to cut chunks")
            )
        if self.val_temperature == 0:
            why = "rollout.val_temperature=0: held-out answers are greedy"
            parts.append(IdlePart("rollout.val_top_p", why, "set rollout.val_temperature > 0 to sample them"))
        return parts


@dataclass
class OffPolicyConfig:
    # truncated importance weights min(pi_old / pi_rollout, is_cap) on every token's loss, against the
    # sampler's recorded rollout_logprobs (docs/algorithms.md, "Off-policy correction"); 0: off
    is_cap: Annotated[float, AtLeast(0, "0: no importance weights")] = 0.0


@dataclass
class ReferenceConfig:
    # the frozen reference policy (built when a KL term needs it) runs the actor's engine with the actor's
    # actor.fsdp2 settings, except this: its parameter shards in host memory, copied to the device per layer
    # in use (FSDP2's CPUOffloadPolicy; an accelerator only; docs/engines.md, "Offload")
    offload_params: bool = False


@dataclass
class ActorConfig:
    engine: str = "fsdp2"  # training backend, from the training-engine registry (verity.engines.registry)
    fsdp2: FSDP2Options = field(default_factory=FSDP2Options)  # settings of the fsdp2 engine
    megatron: MegatronOptions = field(default_factory=MegatronOptions)  # settings of the megatron engine
    optim: OptimConfig = field(default_factory=OptimConfig)
    # LoRA adapters: rank > 0 trains only low-rank adapters on the frozen model (docs/engines.md, "LoRA")
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    ppo_mini_batch_size: Annotated[int, AtLeast(1)] = 32  # prompts per optimizer step
    ppo_epochs: Annotated[int, AtLeast(1)] = 1  # passes over each RL step's batch
    micro_batch_size: Annotated[int, AtLeast(1)] = 64  # rows per forward/backward inside a worker
    entropy_coeff: float = 0.0  # entropy bonus: loss -= coeff * aggregate(entropy)
    # where the PPO ratio's behaviour log-probs come from: auto (recompute, skipped when on-policy) |
    # recompute (a forward before the update) | rollout (the sampler's own log-probs); see docs/algorithms.md
    old_logprobs: Annotated[str, OneOf("auto", "recompute", "rollout")] = "auto"
    # run forward + backward only over rows with a non-zero advantage (the loss still normalised
    # over all rows): auto (where that leaves the gradient exactly unchanged) | on | off; docs/engines.md
    skip_zero_advantage: Annotated[str, OneOf("auto", "on", "off")] = "auto"
    # off-policy correction of the PPO ratio against the sampler's own log-probs (docs/algorithms.md)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    # the reference policy's own settings (the KL terms' log-probs)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    # give every data-parallel rank about the same tokens in the update and the log-prob passes (the
    # reference's too): rows reordered within each mini-batch, answers put back in order; the loss is
    # unchanged (docs/engines.md, "Token-balanced ranks")
    balance_tokens: bool = True
    # a mixture-of-experts policy's router losses and rollout routing replay (verity.config.moe)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def idle_parts(self, cfg: Any) -> list[IdlePart]:
        """Other engines' options, FSDP2 resharding under replication, other policy losses' parameters,
        the reference's settings when no reference engine is built."""
        from verity.algorithms.registry import POLICY_LOSSES
        from verity.engines.registry import TRAINING_ENGINES

        parts = engine_option_parts(self, "actor", TRAINING_ENGINES) + replicated_parts(self, "actor")
        parts += reference_parts(self, cfg)
        name = self.policy_loss.name
        if name not in POLICY_LOSSES:
            return parts
        loss = POLICY_LOSSES.canonical(name)
        for prefix in LOSS_PREFIXES:
            if prefix == loss:
                continue
            for f in fields(self.policy_loss):
                if f.name.startswith(prefix + "_"):
                    key = f"actor.policy_loss.{f.name}"
                    parts.append(IdlePart(key, f"actor.policy_loss.name={name}", f"it applies to actor.policy_loss.name={prefix}"))
        return parts


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@dataclass
class CriticConfig:
    # the critic (value model) for estimators that need values (gae): the actor's backbone
    # with a scalar head, initialised from the actor checkpoint, colocated with the actor
    enabled: bool | None = None  # None (auto): on exactly when the estimator needs values
    model_path: str | None = None  # None: the actor's checkpoint (model.path)
    engine: str = "fsdp2"  # training backend (verity.engines.registry)
    fsdp2: FSDP2Options = field(default_factory=FSDP2Options)
    # colocated: in the actor's processes | separate: its own worker group
    placement: Annotated[str, OneOf("colocated", "separate")] = "colocated"
    n_workers: Annotated[int, AtLeast(1)] | None = None  # workers of a separate critic group; None: trainer.n_workers
    nnodes: int | None = None  # nodes a separate critic group spans (n_workers / nnodes each); None: fewest that fit
    optim: OptimConfig = field(default_factory=_critic_optim)
    ppo_mini_batch_size: Annotated[int, AtLeast(1)] = 32  # prompts per optimizer step
    ppo_epochs: Annotated[int, AtLeast(1)] = 1  # passes over each RL step's batch
    micro_batch_size: Annotated[int, AtLeast(1)] = 64  # rows per forward/backward inside a worker
    cliprange_value: float | None = 0.5  # values kept within +-this of the old values; null: no clip
    loss_agg_mode: str = "token-mean"  # value-loss aggregation (see docs/algorithms.md)
    # RL steps at the start that train only the critic (the actor waits)
    warmup_steps: Annotated[int, AtLeast(0)] = 0
    # every data-parallel rank about the same tokens in the value pass and the update, as actor.balance_tokens
    balance_tokens: bool = True

    def idle_parts(self, cfg: Any) -> list[IdlePart]:
        """The whole section without a critic; otherwise other engines' options and resharding under replication."""
        from verity.config.derived import needs_critic
        from verity.engines.registry import TRAINING_ENGINES

        if needs_critic(cfg):
            return engine_option_parts(self, "critic", TRAINING_ENGINES) + replicated_parts(self, "critic")
        estimator = cfg.algorithm.advantage.estimator
        why = (
            "critic.enabled=false"
            if self.enabled is False
            else f"algorithm.advantage.estimator={estimator} reads no values (critic.enabled=null: auto)"
        )
        fix = "set critic.enabled=true to train one, or drop them"
        return [IdlePart("critic", f"this run has no critic: {why}", fix, keep=("critic.enabled",))]


@dataclass
class AlgorithmConfig:
    # advantage estimator (algorithm.advantage.estimator=grpo|rloo|gae|...) and KL
    # regularisation (in the reward and/or as a loss term); see docs/algorithms.md
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    kl: KLConfig = field(default_factory=KLConfig)

    def idle_parts(self, cfg: Any) -> list[IdlePart]:
        """KL settings of the KL terms that are off; estimator parameters the chosen estimator does not read."""
        from verity.algorithms.registry import ADVANTAGE_ESTIMATORS

        parts: list[IdlePart] = []
        kl = self.kl
        if not kl.use_kl_in_reward:
            why, fix = "algorithm.kl.use_kl_in_reward=false", "set algorithm.kl.use_kl_in_reward=true"
            parts += [IdlePart(f"algorithm.kl.{key}", why, fix) for key in KL_IN_REWARD_KEYS]
        elif kl.kl_ctrl != "adaptive":
            why, fix = f"algorithm.kl.kl_ctrl={kl.kl_ctrl}", "they steer algorithm.kl.kl_ctrl=adaptive"
            parts += [IdlePart(f"algorithm.kl.{key}", why, fix) for key in ADAPTIVE_KL_KEYS]
        if not kl.use_kl_loss:
            why, fix = "algorithm.kl.use_kl_loss=false", "set algorithm.kl.use_kl_loss=true"
            parts += [IdlePart(f"algorithm.kl.{key}", why, fix) for key in KL_LOSS_KEYS]
        if not (kl.use_kl_loss or kl.use_kl_in_reward):
            why = "no KL term (algorithm.kl.use_kl_loss and use_kl_in_reward are false)"
            parts.append(IdlePart("algorithm.kl.kl_clamp", why, "turn one of them on"))
        estimator = self.advantage.estimator
        reads = ADVANTAGE_ESTIMATORS.get(estimator).reads if estimator in ADVANTAGE_ESTIMATORS else None
        if reads is not None:
            why = f"algorithm.advantage.estimator={estimator} does not read it"
            for key in ESTIMATOR_KEYS:
                if key not in reads:
                    parts.append(IdlePart(f"algorithm.advantage.{key}", why, estimators_fix(key)))
        return parts


@dataclass
class RewardConfig:
    num_workers: int = 1  # processes scoring rewards
    timeout_s: float = 10.0  # per sample
    failure_score: float = 0.0  # score of a sample whose verifier timed out or crashed
    custom_path: str | None = None  # file with a user reward function (used for every data_source)
    custom_name: str = "compute_score"  # the function to call in custom_path
    custom_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of that function
    # {data_source: reward spec} over the default table (a built-in name, module:function, file.py:function)
    overrides: dict[str, str] = field(default_factory=dict)
    timeout_overrides: dict[str, float] = field(default_factory=dict)  # {data_source: seconds per sample}
    max_failure_rate: float = 0.5  # a step with more failed (error/timeout) samples than this share stops
    max_workers: int | None = None  # processes while samples hang (null: max(num_workers, 16))
    # where training samples are scored: workers (each rollout rank scores the rows it generated, so the
    # responses stay there and only per-row scores, accuracies and statuses come back) | driver (one
    # reward manager in the driver process; every response comes back). Held-out evaluation is scored
    # on the driver either way. On a cluster, a reward function file must be on every node for workers.
    placement: Annotated[str, OneOf("driver", "workers")] = "workers"


@dataclass
class RewardModelConfig:
    # a learned reward model (a sequence classifier on a causal-LM backbone, e.g.
    # Qwen2ForSequenceClassification) scoring each response; its score is added to the rule reward
    enabled: bool = False
    model_path: str | None = None  # local HF folder of the reward model (required when enabled)
    tokenizer_path: str | None = None  # None: model_path
    weight: float = 1.0  # score = rule score + weight x reward-model score; 0: logged only
    max_length: Annotated[int, AtLeast(1)] = 1024  # tokens of prompt + response, truncated on the left
    micro_batch_size: Annotated[int, AtLeast(1)] = 16  # rows per forward pass
    # colocated: in the actor's processes | separate: its own worker group
    placement: Annotated[str, OneOf("colocated", "separate")] = "colocated"
    # workers of a separate reward-model group; None: trainer.n_workers
    n_workers: Annotated[int, AtLeast(1)] | None = None
    nnodes: int | None = None  # nodes a separate reward-model group spans; None: fewest that fit

    def idle_parts(self, cfg: Any) -> list[IdlePart]:
        """The whole section when the reward model is off."""
        if self.enabled:
            return []
        fix = "set reward_model.enabled=true to score with it, or drop them"
        return [IdlePart("reward_model", "reward_model.enabled=false", fix, keep=("reward_model.enabled",))]


@dataclass
class CheckpointConfig:
    every: Annotated[int, AtLeast(0, "0: no periodic checkpoints")] = 0  # RL steps between checkpoints; 0: none
    keep: Annotated[int, AtLeast(0, "0: keep all")] = 2  # complete checkpoints kept (oldest removed first); 0: keep all
    save_final: bool = True  # a checkpoint after the last step
    dir: str | None = None  # None: <trainer.output_dir>/checkpoints


@dataclass
class TrainerConfig:
    # verl counts epochs (total_epochs) where verity counts steps: 200 x 32 prompts is about one pass
    # over GSM8K's 7,473 questions; for your data, epochs x rows / data.train_batch_size. The embedded
    # model's own (100) applies when unset
    total_steps: int = 200  # RL steps (each: train_batch_size prompts x rollout.n samples)
    # actor workers (Ray actors) in all nodes together; = nnodes x n_workers_per_node
    n_workers: Annotated[int, AtLeast(1)] = 2
    # nodes the actor's pool spans (ranks node by node: rank r on node r // n_workers_per_node); None: 1 on
    # a private cluster, the fewest nodes that hold n_workers on a joined one (docs/multi-node.md)
    nnodes: int | None = None
    n_workers_per_node: int | None = None  # None: n_workers / nnodes
    device: str = "auto"  # auto | cpu | cuda | rocm | npu | gpu (cuda or rocm, whichever is here)
    seed: int = 0  # seeds data order, sampling and initialisation: same seed, same machine, same run
    output_dir: str = "outputs/run"  # summary, metrics, curves, checkpoints and the MLflow store go here
    experiment_name: str = "verity"  # MLflow experiment
    run_name: str | None = None  # MLflow run name; None: MLflow picks one
    tracking_uri: str | None = None  # None: sqlite store in output_dir
    val_before_train: bool = True  # evaluate the starting model on the held-out set
    # steps between held-out evaluations; 0: only before and after training
    val_every: Annotated[int, AtLeast(0, "steps between held-out evaluations; 0: only before and after training")] = 0
    ray_address: str | None = None  # None: a private local Ray cluster | auto | host:port | ray://host:10001
    # seconds to wait for the cluster to hold the run's pools (nodes still joining) before stopping with
    # what was asked and what the cluster has
    placement_timeout_s: Annotated[float, Above(0)] = 60.0
    # memory of one worker in GiB, for the memory plan checked before any worker starts (docs/hardware.md,
    # "Memory plan"): an accelerator's memory (80 for an 80 GB GPU), on CPU each worker's share of the host;
    # null: detected on this machine (a device's total memory; the host's memory / workers on a node)
    device_memory_gb: Annotated[float, Above(0, "GiB of memory per worker; null: detected")] | None = None
    # CPUs reserved per worker (Ray) and torch threads per worker
    cpus_per_worker: Annotated[float, Above(0, "CPUs Ray reserves for each worker, also its torch threads")] = 1.0
    progress: bool = True  # print a progress line
    # auto: continue from the newest complete checkpoint (fresh start if none) | off | a checkpoint path
    resume: str = "auto"
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # a stage running longer fails the run, naming it; 0: no limit
    stage_timeout_s: Annotated[float, AtLeast(0, "0: no limit")] = 3600.0
    # sync: generate, then train, in turn | async: the rollout group generates step t+1's batch while
    # the actor trains on step t's (one-step off-policy, docs/async.md)
    mode: Annotated[str, OneOf("sync", "async")] = "sync"


@dataclass
class VerityConfig:
    # plug-in packages this config needs (distribution names, e.g. verity-recipe-dapo); a missing
    # one fails validation naming it. Installed plug-ins load whether listed or not (verity.plugins).
    plugins: list[str] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
