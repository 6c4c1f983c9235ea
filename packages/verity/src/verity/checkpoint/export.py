"""Turn a sharded checkpoint into a Hugging Face model folder, offline, in one process.

    export_hf("outputs/run/checkpoints/step_60", "outputs/run/hf")
    AutoModelForCausalLM.from_pretrained("outputs/run/hf")     # loads as any HF model

The role's DCP metadata says the full shape and dtype of every model tensor; they are
read in buckets of at most ``max_shard_bytes`` and each bucket written as one safetensors
file (:mod:`verity.checkpoint.export_stream`), so exporting never holds the whole model.
DCP fills each bucket from however many shard files the training workers wrote
(``no_dist``: no process group, so any number of saving workers works). The
optimizer state in the same files is never read. The model class comes from the
``hf/`` config copied into every checkpoint; the tokenizer from the same folder.
A LoRA checkpoint holds only the adapters: it exports merged onto its base model, or as
a ``peft`` adapter folder (:mod:`verity.checkpoint.export_lora`).
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from verity.checkpoint.export_stream import DEFAULT_SHARD_BYTES, saved_model_tensors, write_safetensors_shards
from verity.checkpoint.layout import find_latest, is_complete
from verity.checkpoint.manager import HF_DIR, PREPROCESSOR_CONFIG
from verity.checkpoint.sharded import DCP_DIR

logger = logging.getLogger("verity.checkpoint")

MODEL_PREFIX = "model."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def find_checkpoint(path: str | Path) -> Path:
    """A complete ``step_N`` folder from ``path``: itself, the newest under it, or under ``path/checkpoints``."""
    p = Path(path).expanduser()
    if is_complete(p):
        return p
    for base in (p, p / "checkpoints"):
        found = find_latest(base)
        if found is not None:
            return found
    raise FileNotFoundError(
        f"{p}: not a complete checkpoint (a step_N folder holding trainer_state.json), "
        "nor a folder holding checkpoints"
    )


def check_output_folder(out_dir: str | Path) -> Path:
    """``out_dir`` as a Path; ValueError when it exists and is not a folder (a file, say)."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"{out}: exists and is not a folder; give the path of a folder to write the model into"
        )
    return out


def refuse_overwriting_inputs(out: Path, ckpt: Path, base_model: str | Path | None = None) -> None:
    """ValueError when writing the model to ``out`` would overwrite what the export reads.

    That is: the checkpoint ``ckpt`` itself (or a folder in it), or the model the run
    started from (the ``model_path`` in its ``trainer_state.json``, or ``base_model``) --
    a merged export written there would replace the original weights.
    """
    from verity.checkpoint.state import TrainerState

    target = out.expanduser().resolve()
    step = ckpt.resolve()
    if target == step or step in target.parents:
        raise ValueError(
            f"{out}: is inside the checkpoint being exported ({ckpt}); writing the model there would "
            f"change the checkpoint: give a folder outside it, e.g. {ckpt.parent.parent / 'hf'}"
        )
    try:
        state = TrainerState.read(ckpt)
        started_from = (
            Path(state.working_dir or ".") / Path(state.model_path).expanduser() if state.model_path else ""
        )
    except (OSError, ValueError, TypeError):
        started_from = ""
    for source in (base_model, started_from):
        if source and str(source) != "embedded" and target == Path(source).expanduser().resolve():
            raise ValueError(
                f"{out}: is the model folder this run started from; exporting there would overwrite "
                "the original weights: give another folder"
            )


def read_model_state(role_dir: str | Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of one role's DCP checkpoint, keyed by module name, on CPU.

    ``role_dir`` is e.g. ``step_60/actor``; shapes and dtypes are those saved (float32 master weights).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(role_dir) / DCP_DIR
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder}: no DCP checkpoint (missing .metadata)")
    metadata = FileSystemReader(str(folder)).read_metadata()
    state: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata):
            state[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    if not state:
        raise ValueError(
            f"{folder}: the checkpoint holds no model tensors (keys starting with {MODEL_PREFIX!r})"
        )
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": single process on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return {key[len(MODEL_PREFIX) :]: tensor for key, tensor in state.items()}


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    role: str = "actor",
    dtype: str | None = None,
    adapter: bool = False,
    base_model: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write an HF model folder (safetensors weights, config, generation config, tokenizer).

    Args:
        checkpoint: a ``step_N`` folder, a checkpoint folder or a run output folder
            (see :func:`find_checkpoint`).
        out_dir: the folder to write (created; existing files are overwritten).
        role: the trained role to export: ``actor`` (a causal LM), ``critic`` (a value model:
            ``AutoModelForTokenClassification`` with ``num_labels=1``), a plug-in's role.
        dtype: ``float32`` | ``bfloat16`` | ``float16``; default: as saved.
        adapter: a LoRA checkpoint only: write the adapter as a ``peft`` folder instead of
            the merged model (:mod:`verity.checkpoint.export_lora`).
        base_model: a LoRA checkpoint's base model folder; default: the one the run trained on.
        max_shard_bytes: bytes per safetensors file written, and the host memory the export
            holds at once (:mod:`verity.checkpoint.export_stream`); a LoRA merge holds the
            base model whole.

    Returns the output folder. Raises ValueError when the saved tensors do not match the
    model class named by the checkpoint's config (missing or unexpected names), or when
    ``adapter`` is asked of a checkpoint that trained every weight.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from verity.checkpoint.export_lora import adapter_meta, base_model_folder, export_adapter, merged_model

    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"{out}: exists and is not a folder; give the path of a folder to write the model into"
        )
    ckpt = find_checkpoint(checkpoint)
    refuse_overwriting_inputs(out, ckpt, base_model)
    role_dir = ckpt / role
    if not role_dir.is_dir():
        roles = sorted(p.name for p in ckpt.iterdir() if (p / DCP_DIR).is_dir())
        raise FileNotFoundError(f"{ckpt}: no role {role!r} (roles here: {roles})")
    hf_dir = ckpt / HF_DIR
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json (this checkpoint was saved without its HF assets)")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")

    lora = adapter_meta(role_dir)
    if adapter and lora is None:
        raise ValueError(
            f"{role_dir}: this checkpoint trained every weight; it has no LoRA adapter to export"
        )
    if lora is not None:
        weights = read_model_state(role_dir)
        base = base_model_folder(lora, base_model)
        if adapter:
            export_adapter(weights, lora, base, out)
            _readable_files(out)
            logger.info("exported the LoRA adapter of %s (%s) to %s", ckpt, role, out)
            return out
        model = merged_model(weights, lora, base)
        if dtype is not None:
            model = model.to(DTYPES[dtype])
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out))
    else:
        # shard by shard: host memory holds one output file's tensors, never the whole model
        config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
        saved = saved_model_tensors(role_dir / DCP_DIR, MODEL_PREFIX)
        if not saved:
            raise ValueError(
                f"{role_dir / DCP_DIR}: the checkpoint holds no model tensors (keys starting with {MODEL_PREFIX!r})"
            )
        model = _empty_model(role_dir, {n: shape for n, (shape, _) in saved.items()}, config)
        out.mkdir(parents=True, exist_ok=True)
        names = [n for n in model.state_dict() if n in saved]
        write_safetensors_shards(
            role_dir / DCP_DIR,
            MODEL_PREFIX,
            names,
            out,
            dtype=DTYPES[dtype] if dtype else None,
            max_shard_bytes=max_shard_bytes,
        )
        model.config.architectures = [type(model).__name__]
        model.config.dtype = dtype or str(saved[names[0]][1]).removeprefix("torch.")
        model.config.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True).save_pretrained(str(out))
    if (hf_dir / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(str(hf_dir)).save_pretrained(str(out))
    if (hf_dir / PREPROCESSOR_CONFIG).is_file():  # a vision-language model's image processor
        shutil.copyfile(hf_dir / PREPROCESSOR_CONFIG, out / PREPROCESSOR_CONFIG)
    _readable_files(out)
    logger.info("exported %s (%s) to %s", ckpt, role, out)
    return out


def _readable_files(folder: Path) -> None:
    """Give every file in ``folder`` the mode ``open()`` would (transformers writes its weights 0600)."""
    from verity.tracking.summary import umask

    mode = 0o666 & ~umask()
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)


def _empty_model(role_dir: Path, shapes: dict[str, tuple[int, ...]], config: Any) -> Any:
    """The HF model of ``config`` on the ``meta`` device, after checking ``shapes`` (saved name -> shape) fit it.

    A causal LM, a Qwen2-VL-family vision-language model, or — for a critic, whose weights
    end in a scalar ``score`` head — the ``*ForTokenClassification`` value model
    (``num_labels=1``) it trained as (:mod:`verity.workers.critic`). ValueError names the
    missing, unexpected or misshapen tensors.
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    from verity.data.multimodal import VISION_LANGUAGE_MODEL_TYPES

    vision = getattr(config, "model_type", None) in VISION_LANGUAGE_MODEL_TYPES
    with torch.device("meta"):
        if "score.weight" in shapes and shapes["score.weight"][0] == 1:
            config.num_labels, config.classifier_dropout = 1, 0.0  # as verity.workers.critic builds it
            model = AutoModelForTokenClassification.from_config(config)
        else:
            model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(config)
    state = model.state_dict()
    expected = set(state)
    tied = {name for name in expected - set(shapes) if _is_tied(model, name)}
    missing = sorted(expected - set(shapes) - tied)
    unexpected = sorted(set(shapes) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{role_dir}: saved tensors do not match {type(model).__name__}: "
            f"missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    wrong = [n for n in shapes if tuple(state[n].shape) != tuple(shapes[n])]
    if wrong:
        raise ValueError(
            f"{role_dir}: saved tensor {wrong[0]!r} has shape {list(shapes[wrong[0]])}, "
            f"but the checkpoint's config makes it {list(state[wrong[0]].shape)}"
        )
    return model


def _is_tied(model: Any, name: str) -> bool:
    """Whether parameter ``name`` shares its storage with another (tied input/output embeddings)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(name)
    if target is None:
        return False
    return any(other is target for key, other in params.items() if key != name)
