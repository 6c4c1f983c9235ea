"""Checks of the offload settings against the run's device and layout, before anything is built.

``<section>.fsdp2.offload_params`` / ``offload_optimizer`` (actor, critic) and
``actor.reference.offload_params`` move tensors from an accelerator to host memory
(:mod:`verity.engines.offload`). On a CPU run they would move nothing, so a key that is set
there is refused, naming it: with ``trainer.device=cpu``, or ``auto`` on a machine without
an accelerator and a private Ray cluster (on a cluster the workers find their device and
the engine raises the same sentence when it builds). The reference's offload needs FSDP2
sharding of its own layers, which it takes from ``actor.fsdp2``. What each
``fsdp2`` section says alone (offload with ``sharding=replicate``, both offloads at once)
is :meth:`verity.engines.options.FSDP2Options.validate`'s; keys of a part the run does not
build (a critic's section without a critic, the reference without a KL term) are
:mod:`verity.config.idle_settings`'.
"""

from __future__ import annotations

from verity.config.cluster_checks import cluster_address
from verity.config.derived import needs_critic, needs_reference
from verity.config.errors import ConfigError
from verity.config.schema import VerityConfig

__all__ = ["check_offload", "offload_keys"]


def offload_keys(cfg: VerityConfig) -> list[str]:
    """The offload keys set to true in the parts of ``cfg`` this run builds, as ``key=true``."""
    keys: list[str] = []
    sections = ["actor"] + (["critic"] if needs_critic(cfg) else [])
    for section in sections:
        role = getattr(cfg, section)
        if role.engine != "fsdp2":
            continue
        keys += [
            f"{section}.fsdp2.{name}"
            for name in ("offload_params", "offload_optimizer")
            if getattr(role.fsdp2, name)
        ]
    if _builds_fsdp2_reference(cfg) and cfg.actor.reference.offload_params:
        keys.append("actor.reference.offload_params")
    return keys


def _builds_fsdp2_reference(cfg: VerityConfig) -> bool:
    """A KL term needs the reference, and it is a separate fsdp2 engine (not the adapter-free actor)."""
    return needs_reference(cfg) and not cfg.actor.lora.enabled and cfg.actor.engine == "fsdp2"


def check_offload(cfg: VerityConfig) -> None:
    """Refuse offload on a CPU run, and the reference's offload where the actor's layout rules it out."""
    keys = offload_keys(cfg)
    if not keys:
        return
    device = str(cfg.trainer.device).strip().lower()
    if device == "cpu" or (device == "auto" and not cluster_address(cfg) and _local_device_is_cpu()):
        raise ConfigError(
            f"{keys[0]}=true moves tensors from an accelerator to host memory, and this run's device is the "
            f"CPU (trainer.device={cfg.trainer.device}), where they already are; set it to false"
        )
    if "actor.reference.offload_params" in keys:
        fsdp2 = cfg.actor.fsdp2
        if fsdp2.sharding != "full":
            raise ConfigError(
                "actor.reference.offload_params=true is FSDP2's offload policy for sharded layers, and the "
                f"reference keeps the actor's actor.fsdp2.sharding={fsdp2.sharding} (a whole copy per device); "
                "set actor.fsdp2.sharding=full or actor.reference.offload_params=false"
            )
        if fsdp2.cuda_graphs:
            raise ConfigError(
                "actor.reference.offload_params=true with actor.fsdp2.cuda_graphs=true: the graphs replay "
                "fixed device addresses of weights that offload keeps in host memory; switch one off"
            )


def _local_device_is_cpu() -> bool:
    """Whether ``trainer.device=auto`` on this machine's private Ray cluster resolves to the CPU."""
    from verity.hardware import detect_backend

    return detect_backend().name == "cpu"
