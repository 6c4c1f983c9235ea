"""Export a LoRA checkpoint: the merged model as an HF folder, or the adapter as a ``peft`` folder.

A LoRA checkpoint's role folder holds the adapters only (``lora_A`` / ``lora_B`` of every
adapted layer, and their optimizer state); its ``meta.json`` names the adapter settings and
the base model folder the run trained on (:meth:`verity.engines.fsdp2_lora.FSDP2LoRAEngine.checkpoint_meta`).

- **merged** (:func:`export_merged`): the base model loaded from that folder (or
  ``base_model``) in the dtype the run trained it in, each adapted weight replaced by
  ``W + s B A`` (:func:`verity.resharding.lora_merge.merge_lora_weight`, the same function
  the weight sync uses, so the folder holds exactly the weights the trainer's rollout had);
- **adapter** (:func:`export_adapter`): ``adapter_config.json`` and
  ``adapter_model.safetensors`` in ``peft``'s format, which
  ``peft.PeftModel.from_pretrained(base_model, folder)`` loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from verity.resharding.lora_merge import merge_lora_weight

META_FILE = "meta.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def adapter_meta(role_dir: str | Path) -> dict[str, Any] | None:
    """The ``adapter`` entry of a role folder's ``meta.json`` (``None`` for a full-model checkpoint)."""
    path = Path(role_dir) / META_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("adapter")


def base_model_folder(meta: dict[str, Any], base_model: str | Path | None) -> Path:
    """The base model folder: ``base_model`` if given, else the one the run trained on."""
    folder = Path(base_model or meta.get("base_model") or "").expanduser()
    if not str(base_model or meta.get("base_model") or "") or not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"the base model of this LoRA checkpoint ({folder if str(folder) != '.' else 'not recorded'}) is not "
            "an HF model folder here: give it with --base-model PATH"
        )
    return folder


def adapter_pairs(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer name: (A, B)}`` from a checkpoint's adapter tensors (``<layer>.lora_A.<adapter>.weight``, ...)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        for kind in ("lora_A", "lora_B"):
            marker = f".{kind}."
            if marker in name:
                layer = name.split(marker, 1)[0]
                pairs.setdefault(layer, {})[kind] = tensor
    broken = sorted(layer for layer, p in pairs.items() if set(p) != {"lora_A", "lora_B"})
    if broken or not pairs:
        raise ValueError(
            f"the checkpoint's adapter tensors are incomplete (layers {broken[:5]}, {len(pairs)} found)"
        )
    return {layer: (p["lora_A"], p["lora_B"]) for layer, p in pairs.items()}


def merged_model(adapters: dict[str, torch.Tensor], meta: dict[str, Any], base: Path) -> Any:
    """The base model at ``base`` with every adapted weight replaced by ``W + s B A`` (an HF module, CPU)."""
    from transformers import AutoModelForCausalLM

    from verity.engines.hf_loading import quiet_loading

    dtype = _DTYPES.get(str(meta.get("base_dtype", "float32")), torch.float32)
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype, local_files_only=True)
    scale = float(meta["alpha"]) / int(meta["rank"])
    pairs = adapter_pairs(adapters)
    if len(pairs) != int(meta.get("adapted_layers", len(pairs))):
        raise ValueError(
            f"the checkpoint holds adapters for {len(pairs)} layers, its meta.json says {meta['adapted_layers']}"
        )
    with torch.no_grad():
        for layer, (lora_a, lora_b) in pairs.items():
            try:
                weight = model.get_parameter(f"{layer}.weight")
            except AttributeError:
                raise ValueError(f"adapted layer {layer!r} is not in the base model at {base}") from None
            weight.copy_(merge_lora_weight(weight, lora_a, lora_b, scale))
    return model


def export_adapter(adapters: dict[str, torch.Tensor], meta: dict[str, Any], base: Path, out: Path) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (``peft``'s format) into ``out``."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    config = LoraConfig(
        r=int(meta["rank"]),
        lora_alpha=float(meta["alpha"]),
        lora_dropout=float(meta.get("dropout", 0.0)),
        target_modules=list(meta["target_modules"]),
        exclude_modules=list(meta.get("exclude_modules") or []) or None,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base),
    )
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    tensors = {}
    for layer, (lora_a, lora_b) in adapter_pairs(adapters).items():
        # peft's saved names: base_model.model.<layer>.lora_A.weight (the adapter name left out)
        tensors[f"base_model.model.{layer}.lora_A.weight"] = lora_a.contiguous()
        tensors[f"base_model.model.{layer}.lora_B.weight"] = lora_b.contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
