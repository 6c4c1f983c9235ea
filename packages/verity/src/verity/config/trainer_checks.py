"""Checks of the ``trainer`` section, and of what ``trainer.device`` rules out, before any compute.

Each raises :class:`~verity.config.errors.ConfigError` naming the key, the value and
what was expected: intervals and counts, CPUs per worker, the device name, checkpoint
and resume settings, and the rollout settings that cannot run on an explicit
``trainer.device=cpu`` (with ``auto`` the workers find their device, and the engine
raises the same sentence when it builds).
"""

from __future__ import annotations

from pathlib import Path

from verity.config.errors import ConfigError
from verity.config.schema import VerityConfig

__all__ = ["DEVICE_NAMES", "check_trainer"]

# what trainer.device accepts: verity.hardware's backends, the aliases it resolves, gpu (CUDA or ROCm), auto
DEVICE_NAMES = ("auto", "cpu", "cuda", "rocm", "npu", "gpu", "hip", "ascend")


def check_trainer(cfg: VerityConfig) -> None:
    """The trainer's own ranges, fault tolerance, and the device's limits on the rollout."""
    t = cfg.trainer
    if t.val_every < 0:
        raise ConfigError(
            f"trainer.val_every must be >= 0 (steps between held-out evaluations; 0: only before and "
            f"after training), got {t.val_every}"
        )
    if not t.cpus_per_worker > 0:
        raise ConfigError(
            f"trainer.cpus_per_worker must be > 0 (CPUs Ray reserves for each worker, also its torch "
            f"threads), got {t.cpus_per_worker}"
        )
    device = str(t.device).strip().lower()
    if device not in DEVICE_NAMES:
        raise ConfigError(f"trainer.device must be one of {'|'.join(DEVICE_NAMES)}, got {t.device!r}")
    _check_fault_tolerance(cfg)
    if device == "cpu":
        _check_cpu_rollout(cfg)


def _check_cpu_rollout(cfg: VerityConfig) -> None:
    r = cfg.rollout
    if r.engine == "sglang":
        raise ConfigError(
            "rollout.engine=sglang runs on CUDA devices only and trainer.device=cpu; use rollout.engine=hf "
            "or vllm on a CPU"
        )
    if r.engine == "vllm" and r.vllm.enable_sleep_mode:
        raise ConfigError(
            "rollout.vllm.enable_sleep_mode=true with trainer.device=cpu: vLLM has no sleep mode on CPU; "
            "leave it null or false"
        )


def _check_fault_tolerance(cfg: VerityConfig) -> None:
    """Checkpoint, resume, stage time-limit and malformed-row settings."""
    t = cfg.trainer
    if cfg.data.on_malformed not in ("error", "skip"):
        raise ConfigError(f"data.on_malformed must be error or skip, got {cfg.data.on_malformed!r}")
    if t.checkpoint.every < 0:
        raise ConfigError(
            f"trainer.checkpoint.every must be >= 0 (0: no periodic checkpoints), got {t.checkpoint.every}"
        )
    if t.checkpoint.keep < 0:
        raise ConfigError(f"trainer.checkpoint.keep must be >= 0 (0: keep all), got {t.checkpoint.keep}")
    if t.stage_timeout_s < 0:
        raise ConfigError(f"trainer.stage_timeout_s must be >= 0 (0: no limit), got {t.stage_timeout_s}")
    if not t.resume:
        raise ConfigError("trainer.resume must be auto, off or a checkpoint path, got an empty value")
    if t.resume not in ("auto", "off") and not Path(t.resume).expanduser().exists():
        raise ConfigError(
            f"trainer.resume: {t.resume!r} is neither auto, off nor an existing checkpoint path"
        )
