"""``verity export CHECKPOINT OUT [--role actor] [--dtype bfloat16]``: a checkpoint as an HF model folder.

    verity export outputs/run/checkpoints/step_60 outputs/run/hf
    verity export outputs/run outputs/run/hf        # the run's newest complete checkpoint

Runs offline in one process, whatever number of workers wrote the checkpoint. The
folder holds safetensors weights, ``config.json``, the generation config and the
tokenizer; ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it.
Exit codes: 0 written; 2 no such checkpoint, role or dtype, or OUT is an existing file.
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
    args = parser.parse_args(argv)
    from verity.checkpoint.export import check_output_folder, export_hf, find_checkpoint

    try:
        check_output_folder(args.out)
        source = find_checkpoint(args.checkpoint)
        out = export_hf(source, args.out, role=args.role, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"verity export: {err}", file=sys.stderr)
        return 2
    print(f"exported {source} ({args.role}) -> {out}")
    return 0
