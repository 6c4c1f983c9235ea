"""Checks of the ``trainer`` section, and of what ``trainer.device`` rules out, before any compute.

Each raises :class:`~verity.config.errors.ConfigError` naming the key, the value and
what was expected: intervals and counts, CPUs per worker, the device name, the output
and checkpoint folders (a file in the way, no write permission), checkpoint and resume
settings, and the rollout and engine settings that cannot run on the CPU (an SGLang
rollout, vLLM's sleep mode, ``fsdp2.cuda_graphs``): with
``trainer.device=cpu``, or ``auto`` on a machine without an accelerator and a private
Ray cluster (``trainer.ray_address`` null). On a cluster the workers find their device,
and the engine raises the same sentence when it builds.
"""

from __future__ import annotations

import os
from pathlib import Path

from verity.config.cluster_checks import cluster_address
from verity.config.derived import needs_critic
from verity.config.errors import ConfigError
from verity.config.schema import VerityConfig

__all__ = ["DEVICE_NAMES", "check_trainer"]

# what trainer.device accepts: verity.hardware's backends, the aliases it resolves, gpu (CUDA or ROCm), auto
DEVICE_NAMES = ("auto", "cpu", "cuda", "rocm", "npu", "gpu", "hip", "ascend")


def check_trainer(cfg: VerityConfig) -> None:
    """The trainer's own ranges, fault tolerance, and the device's limits on the rollout."""
    t = cfg.trainer
    device = str(t.device).strip().lower()
    if device not in DEVICE_NAMES:
        raise ConfigError(f"trainer.device must be one of {'|'.join(DEVICE_NAMES)}, got {t.device!r}")
    _check_fault_tolerance(cfg)
    _check_folder("trainer.output_dir", t.output_dir)
    if t.checkpoint.dir:
        _check_folder("trainer.checkpoint.dir", t.checkpoint.dir)
    graphed = _cuda_graph_sections(cfg)
    if graphed and device in ("npu", "ascend"):
        raise ConfigError(
            f"{graphed[0]}.fsdp2.cuda_graphs=true needs a CUDA or ROCm device, and trainer.device={t.device}; "
            "set it to false"
        )
    needs_accelerator = (
        cfg.rollout.engine == "sglang"
        or (cfg.rollout.engine == "vllm" and cfg.rollout.vllm.enable_sleep_mode)
        or bool(graphed)
    )
    if needs_accelerator and (
        device == "cpu" or (device == "auto" and not cluster_address(cfg) and _local_device_is_cpu())
    ):
        _check_cpu_rollout(cfg)
        if graphed:
            raise ConfigError(
                f"{graphed[0]}.fsdp2.cuda_graphs=true needs a CUDA device, and this run's device is the CPU "
                f"(trainer.device={t.device}); set it to false on a CPU"
            )


def _cuda_graph_sections(cfg: VerityConfig) -> list[str]:
    """The trained roles whose engine is asked to replay CUDA graphs."""
    sections = ["actor"] + (["critic"] if needs_critic(cfg) else [])
    return [s for s in sections if getattr(cfg, s).engine == "fsdp2" and getattr(cfg, s).fsdp2.cuda_graphs]


def _local_device_is_cpu() -> bool:
    """Whether ``trainer.device=auto`` on this machine's private Ray cluster resolves to the CPU."""
    from verity.hardware import detect_backend

    return detect_backend().name == "cpu"


def _check_folder(key: str, value: str) -> None:
    """``value`` is a folder, or one that can be made: no file on its path, write access where it starts."""
    path = Path(value).expanduser().absolute()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key} {value!r} exists and is not a folder; give a folder's path")
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key} {value!r} cannot be created: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} {value!r} cannot be created: no write permission in {str(parent)!r}")


def _check_cpu_rollout(cfg: VerityConfig) -> None:
    r = cfg.rollout
    if r.engine == "sglang":
        raise ConfigError(
            f"rollout.engine=sglang runs on CUDA devices only, and this run's device is the CPU "
            f"(trainer.device={cfg.trainer.device}); use rollout.engine=hf or vllm on a CPU"
        )
    if r.engine == "vllm" and r.vllm.enable_sleep_mode:
        raise ConfigError(
            f"rollout.vllm.enable_sleep_mode=true on the CPU (trainer.device={cfg.trainer.device}): vLLM has "
            "no sleep mode on CPU; leave it null or false"
        )


def _check_fault_tolerance(cfg: VerityConfig) -> None:
    """``trainer.resume``: auto, off or a checkpoint that exists."""
    t = cfg.trainer
    if not t.resume:
        raise ConfigError("trainer.resume must be auto, off or a checkpoint path, got an empty value")
    if t.resume not in ("auto", "off") and not Path(t.resume).expanduser().exists():
        raise ConfigError(
            f"trainer.resume: {t.resume!r} is neither auto, off nor an existing checkpoint path"
        )
