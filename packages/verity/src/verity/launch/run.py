"""Build everything a run needs from its config, train, and write the run's outputs.

    summary = run_training(load_config(["trainer.total_steps=50"]))

Order of work:

1. resolve the inputs (model folder, data files) and claim the output folder;
2. read the checkpoint to resume from, if any; load the prompt data; estimate each worker's memory
   (:mod:`verity.launch.memory_plan`: a plan that cannot fit stops here, in one sentence); open the tracker;
3. plan the stages once (built-in + plug-in planners; printed and logged);
4. start Ray (a private local cluster unless ``trainer.ray_address`` or ``$RAY_ADDRESS``
   names one to join) and plan the pools node by node (:mod:`verity.launch.pools`; printed, with
   the memory plan beside it);
   a plan over other nodes first checks that they see the output folder;
5. start every enabled role's worker group (:mod:`verity.launch.roles`);
6. restore the checkpoint and build the loop's hooks (:mod:`verity.launch.recovery`);
7. train and evaluate (:class:`verity.trainer.loop.RLTrainer`);
8. write ``summary.json`` (with ``ran``: the engines the workers report running),
   ``metrics.jsonl`` and ``curves.png`` into ``trainer.output_dir``.

Nothing is downloaded: ``model.path=embedded`` builds (or reuses) the tiny model.
"""

from __future__ import annotations

import functools
import logging
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verity.config.loader import ConfigError, config_to_dict
from verity.config.model_presets import preset_layer
from verity.config.schema import VerityConfig
from verity.launch.run_dir import OutputClaim

logger = logging.getLogger("verity.trainer")


@dataclass
class ResolvedInputs:
    """Local paths a run reads: an HF model folder, its tokenizer, verl-schema data files."""

    model_path: str
    tokenizer_path: str
    train_files: list[str]
    val_files: list[str]


def resolve_inputs(cfg: VerityConfig) -> ResolvedInputs:
    """Resolve ``model.path=embedded`` (build or reuse the warm-started tiny model and task files
    of the preset ``model.embedded_preset``).

    The embedded task's train and test files are used only when the config names neither
    ``data.train_files`` nor ``data.val_files``: given one, the other is required (a
    :class:`ConfigError`), so a run on the user's data never reports the embedded task's accuracy.
    """
    d = cfg.data
    if cfg.model.path == "embedded":
        from verity.data.embedded import ensure_embedded_preset

        if d.train_files and not d.val_files:
            raise ConfigError(
                "data.val_files is empty: give a held-out parquet/jsonl file of your task in the verl "
                "schema (rows kept out of data.train_files); without it the run would report accuracy "
                f"on the embedded {cfg.model.embedded_preset!r} preset's task, not on yours"
            )
        if d.val_files and not d.train_files:
            raise ConfigError(
                "data.train_files is empty: give the parquet/jsonl file(s) of your task to train on "
                "(data.val_files names your held-out rows); without them the run would train on the "
                f"embedded {cfg.model.embedded_preset!r} preset's task, not on yours"
            )
        paths = ensure_embedded_preset(
            cfg.model.embedded_preset, cfg.model.embedded_cache_dir, cfg.model.embedded_sft_steps
        )
        model_path = str(paths.model_dir)
        train = list(d.train_files) or [str(paths.train_file)]
        val = list(d.val_files) or [str(paths.test_file)]
    else:
        model_path = str(Path(cfg.model.path).expanduser())
        train, val = list(d.train_files), list(d.val_files)
        if not train:
            raise ConfigError(
                "data.train_files is empty: give at least one parquet/jsonl file in the verl schema"
            )
        if not val:
            raise ConfigError(
                "data.val_files is empty: give a held-out parquet/jsonl file in the verl schema"
            )
    tokenizer_path = (
        str(Path(cfg.model.tokenizer_path).expanduser()) if cfg.model.tokenizer_path else model_path
    )
    return ResolvedInputs(model_path, tokenizer_path, train, val)


def check_adapter_targets(cfg: VerityConfig, model_path: str) -> None:
    """With ``actor.lora`` on: every target module exists in the model (checked on the meta device,
    before any worker starts); ``ConfigError`` naming the key otherwise."""
    if not cfg.actor.lora.enabled:
        return
    from verity.engines.lora import check_lora_targets

    try:
        adapted = check_lora_targets(model_path, cfg.actor.lora)
    except ValueError as err:
        raise ConfigError(f"actor.lora.target_modules / exclude_modules: {err}") from None
    if not adapted:
        raise ConfigError(f"actor.lora: no module of {model_path} gets an adapter with these settings")


def run_training(cfg: VerityConfig) -> dict[str, Any]:
    """Train as configured; return the summary dict (also written to ``summary.json``).

    The output folder is locked for the run (:mod:`verity.launch.run_dir`): a second run
    into it fails at once, and a run that fails before training removes the lock (and the
    folder it made, when empty). A fresh start (``trainer.resume=off``, or ``auto`` with no
    checkpoint to continue) moves a previous run's outputs aside first.
    """
    from verity.launch.run_dir import claim_output_dir

    inputs = resolve_inputs(cfg)
    check_adapter_targets(cfg, inputs.model_path)
    out_dir = Path(cfg.trainer.output_dir).expanduser()
    with claim_output_dir(out_dir) as claim:
        return _train(cfg, inputs, out_dir, claim)


def _fresh_start_moves_aside(cfg: VerityConfig, out_dir: Path) -> None:
    """Before a fresh start, move what an earlier run left in the output folder aside (and say where)."""
    from verity.checkpoint.layout import find_latest
    from verity.checkpoint.resume import checkpoint_root
    from verity.launch.run_dir import move_aside

    mode, root = cfg.trainer.resume, checkpoint_root(cfg)
    if mode == "off" or (mode == "auto" and find_latest(root) is None):
        moved = move_aside(out_dir, root)
        if moved is not None:
            print(f"verity: a previous run's outputs in {out_dir} were moved to {moved}", flush=True)


def _train(cfg: VerityConfig, inputs: ResolvedInputs, out_dir: Path, claim: OutputClaim) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from verity.algorithms.kl_control import build_kl_controller
    from verity.checkpoint.signals import GracefulStop, TrainingStopped
    from verity.config.cluster_checks import cluster_address
    from verity.controller import init_ray, shutdown_ray
    from verity.data.multimodal import load_image_processor
    from verity.data.prompt_loader import PromptDataLoader
    from verity.data.verl_dataset import PromptDataset
    from verity.hardware import get_backend
    from verity.hardware.detect import BackendUnavailableError, UnknownBackendError
    from verity.launch.memory_plan import plan_for_run
    from verity.launch.outputs import write_run_outputs
    from verity.launch.pools import plan_run
    from verity.launch.recovery import open_tracker, plan_resume, prepare_recovery
    from verity.launch.roles import RoleGroups, cpus_needed, start_roles
    from verity.launch.run_dir import run_name
    from verity.launch.shared_storage import check_shared_output_dir
    from verity.rewards.manager import RewardManager
    from verity.rewards.preflight import check_rewards
    from verity.rollout.agent.tools import prompt_chat_template_kwargs
    from verity.tracking import ProgressLine, config_hash
    from verity.trainer.loop import RLTrainer, RunHooks, memory_metrics
    from verity.trainer.stage_plan import build_stage_plan
    from verity.workers.registry import RoleInputs

    cfg_dict = config_to_dict(cfg)
    _fresh_start_moves_aside(cfg, out_dir)
    resume = plan_resume(cfg, cfg_dict)  # trainer.resume (same config for auto), before any worker starts
    tokenizer = AutoTokenizer.from_pretrained(inputs.tokenizer_path)
    image_processor = load_image_processor(inputs.model_path)  # None for a text-only model
    d = cfg.data
    template_kwargs = prompt_chat_template_kwargs(cfg.rollout.agent)  # the tools, listed in prompts
    train_set = PromptDataset(
        inputs.train_files,
        tokenizer,
        max_prompt_length=d.max_prompt_length,
        truncation=d.truncation,
        on_malformed=d.on_malformed,
        chat_template_kwargs=template_kwargs,
        image_processor=image_processor,
    )
    val_set = PromptDataset(
        inputs.val_files,
        tokenizer,
        max_prompt_length=d.max_prompt_length,
        truncation=d.truncation,
        on_malformed=d.on_malformed,
        max_samples=None if d.val_max_samples < 0 else d.val_max_samples,
        chat_template_kwargs=template_kwargs,
        image_processor=image_processor,
    )
    check_rewards(cfg.reward, {"train": (inputs.train_files, train_set), "val": (inputs.val_files, val_set)})
    if len(train_set) < d.train_batch_size:
        raise ConfigError(
            f"data.train_batch_size = {d.train_batch_size} prompts but the training files hold only {len(train_set)}"
        )
    train_loader = PromptDataLoader(train_set, d.train_batch_size, shuffle=d.shuffle, seed=cfg.trainer.seed)
    val_loader = PromptDataLoader(val_set, d.val_batch_size, shuffle=False, drop_last=False)

    try:
        backend = get_backend(None if cfg.trainer.device == "auto" else cfg.trainer.device)
    except (BackendUnavailableError, UnknownBackendError) as err:
        raise ConfigError(f"trainer.device={cfg.trainer.device}: {err}") from None
    memory = plan_for_run(
        cfg, inputs.model_path, backend
    )  # before Ray starts: a plan that cannot fit stops here
    if memory.fits() is False:
        print(f"verity: memory plan per worker:\n{textwrap.indent(memory.describe(), '  ')}", flush=True)
        memory.check()
    try:
        tracker = open_tracker(
            cfg,
            out_dir,
            resume,
            experiment=cfg.trainer.experiment_name,
            tracking_uri=cfg.trainer.tracking_uri,
            run_name=cfg.trainer.run_name or run_name(cfg.trainer.experiment_name, config_hash(cfg_dict)),
            tags={"backend": backend.name, "algorithm": cfg.algorithm.advantage.estimator},
        )
    except Exception as err:  # MLflow raises its own MlflowException for a store it cannot open
        if not cfg.trainer.tracking_uri:
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"trainer.tracking_uri={cfg.trainer.tracking_uri!r}: MLflow could not open this tracking store "
            f"({first}); use a sqlite:///path.db, an http(s):// server, or null (a store in the run folder)"
        ) from err
    tracker.log_params(cfg_dict)
    tracker.log_params(
        {
            "data.train_rows_skipped": len(train_set.skipped_rows),
            "data.val_rows_skipped": len(val_set.skipped_rows),
        }
    )
    rewards = RewardManager(cfg.reward, tokenizer=tokenizer)
    stage_plan = build_stage_plan(cfg)
    plan_text = stage_plan.describe()
    print(f"verity: stages {plan_text}", flush=True)
    tracker.log_params({"trainer.stage_plan": plan_text})
    layer = preset_layer(cfg)
    if layer is not None:  # the model's preset: which keys it set (verity.config.model_presets)
        print(f"verity: {layer.describe()}", flush=True)
        tracker.log_params({"config.preset": layer.name})
    tracker.log_params(
        memory.record()
    )  # plan/<pool>/<term>_gb: beside the measured memory/<role>/<method>_gb
    address = cluster_address(cfg)
    if address is not None and cfg.trainer.ray_address is None:
        print(
            f"verity: joining the Ray cluster at RAY_ADDRESS={address} (trainer.ray_address is unset)",
            flush=True,
        )
    init_ray(
        address, **({"num_cpus": max(2, os.cpu_count() or 2, cpus_needed(cfg))} if address is None else {})
    )
    groups: RoleGroups | None = None
    status = "FAILED"
    stop = GracefulStop().install()  # after init_ray, which installs its own SIGTERM handler
    try:
        placement = plan_run(cfg, backend)
        print(f"verity: placement on {len(placement.nodes)} node(s):", flush=True)
        print(textwrap.indent(placement.describe(), "  "), flush=True)
        print(f"verity: memory plan per worker:\n{textwrap.indent(memory.describe(), '  ')}", flush=True)
        away = [node for node in placement.nodes if not node.is_driver]
        if away:  # workers on other nodes write checkpoints: they must see this run's folder
            check_shared_output_dir(out_dir, away, timeout_s=cfg.trainer.placement_timeout_s)
        groups = start_roles(cfg, RoleInputs(inputs.model_path, inputs.tokenizer_path), backend, placement)
        ran = groups.ran()
        tracker.log_params(
            {
                ("model" if name == "actor" else name) + f".{key}": getattr(report, key)
                for name, report in groups.reports.items()
                for key in ("n_params", "n_trainable_params", "n_active_params")
                if getattr(report, key) is not None
            }
        )
        tracker.set_tags({f"ran.{key}": value for key, value in ran.items()})
        show = cfg.trainer.progress and cfg.trainer.total_steps > 0
        progress = ProgressLine(cfg.trainer.total_steps, desc="train") if show else None
        kl_controller = build_kl_controller(cfg.algorithm.kl)
        recovery = prepare_recovery(
            cfg,
            plan=resume,
            groups=groups.trained,
            workers=groups.handles,
            loader=train_loader,
            kl_controller=kl_controller,
            tracker=tracker,
            stop=stop,
            out_dir=out_dir,
            cfg_dict=cfg_dict,
            cfg_hash=config_hash(cfg_dict),
            model_path=inputs.model_path,
            tokenizer_path=inputs.tokenizer_path,
        )
        hooks = RunHooks(
            tracker=recovery.tracker,
            progress=progress.update if progress else None,
            note=progress.note if progress else None,
            step_end=recovery.step_end,
            stage_guard=recovery.stage_guard,
            step_probes=(functools.partial(memory_metrics, groups.groups),),
        )
        trainer = RLTrainer(
            cfg,
            stage_plan.stages,
            roles=groups.handles,
            rewards=rewards,
            train_batches=train_loader,
            val_batches=lambda: iter(val_loader),
            kl_controller=kl_controller,
            hooks=hooks,
            start=recovery.start,
        )
        claim.training_started = True  # from here a failed run keeps its folder's lock and outputs
        try:
            result = trainer.fit()
        except TrainingStopped:
            status = "KILLED"
            raise
        if progress is not None:
            progress.close()
        summary = write_run_outputs(
            out_dir,
            result,
            cfg_dict,
            config_hash(cfg_dict),
            tracker,
            extra={
                "ran": {**ran, "device": backend.name},
                "stage_plan": plan_text.split(" -> "),
                "resumed_from_step": resume.state.step if resume.state is not None else None,
                "preset": {"name": layer.name, "set": layer.applied} if layer is not None else None,
                "memory_plan": memory.record(),
            },
        )
        status = "FINISHED"
        return summary
    finally:
        stop.uninstall()
        tracker.finish(status)
        rewards.close()
        if groups is not None:
            groups.close()
        if address is None:
            shutdown_ray()
