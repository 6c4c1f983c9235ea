"""``verity export CHECKPOINT OUT [--role actor] [--dtype bfloat16] [--adapter] [--base-model PATH]``.

    verity export outputs/run/checkpoints/step_60 outputs/run/hf
    verity export outputs/run outputs/run/hf        # the run's newest complete checkpoint
    verity export outputs/lora-run outputs/lora-run/adapter --adapter   # a LoRA run: the peft adapter

A LoRA checkpoint (``actor.lora.rank > 0``) exports merged onto its base model (the folder
the run trained on, or ``--base-model``), or with ``--adapter`` as a ``peft`` adapter folder.

Runs offline in one process, whatever number of workers wrote the checkpoint. The
folder holds safetensors weights, ``config.json``, the generation config and the
tokenizer; ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it.
Exit codes: 0 written; 2 no such checkpoint, role or dtype, OUT is an existing file, or OUT
is (inside) the checkpoint or the model folder the run started from (it would be overwritten).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="verity export", description="Export a verity checkpoint to a Hugging Face model folder."
    )
    parser.add_argument("checkpoint", help="a step_N checkpoint, a checkpoint folder or a run output folder")
    parser.add_argument("out", help="the HF model folder to write")
    parser.add_argument("--role", default="actor", help="the trained role to export (default: actor)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="default: as saved"
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA checkpoint: write the adapter as a peft folder instead of the merged model",
    )
    parser.add_argument(
        "--base-model",
        default=None,
        help="a LoRA checkpoint's base model folder (default: the one the run trained on)",
    )
    args = parser.parse_args(argv)
    from verity.checkpoint.export import check_output_folder, export_hf, find_checkpoint

    try:
        check_output_folder(args.out)
        source = find_checkpoint(args.checkpoint)
        out = export_hf(
            source,
            args.out,
            role=args.role,
            dtype=args.dtype,
            adapter=args.adapter,
            base_model=args.base_model,
        )
    except (FileNotFoundError, ValueError) as err:
        print(f"verity export: {err}", file=sys.stderr)
        return 2
    what = "adapter" if args.adapter else args.role
    print(f"exported {source} ({what}) -> {out}")
    return 0
