"""Memory of the reference policy with LoRA: the actor's model with adapters disabled vs a separate copy.

    python -m ci.bench_lora_memory [--hidden 768] [--layers 12] [--rank 32] [--out outputs/bench/lora_memory.json]

A Qwen2-architecture model (random weights, character vocabulary unless ``--vocab``) is
saved to a temporary folder; then each setup runs in a fresh process, as an actor worker
builds it (one process, float32, CPU):

- ``lora+adapter-free-ref``: the LoRA actor (``FSDP2LoRAEngine``) and its
  ``adapter_free_reference()`` — no second copy of the weights;
- ``lora+separate-ref``: the same LoRA actor plus a frozen ``FSDP2Engine`` loaded from the
  same folder (what a reference costs without the adapters trick);
- ``full``: full fine-tuning with a separate reference (for scale).

Each process reports its parameter bytes (exact: the tensors it holds) and its resident
set size (``VmRSS`` from ``/proc/self/status``) after building the engines and after one
training step and one reference log-prob pass (``VmHWM``: the peak). RSS includes the
interpreter, torch and transformers (a few hundred MB, the same in every setup), so the
difference between two setups is what is compared. Memory figures do not depend on the
machine's load; the script prints them side by side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SETUPS = ("lora+adapter-free-ref", "lora+separate-ref", "full")


def proc_status_kib(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def build_model(folder: Path, hidden: int, layers: int, vocab: int | None) -> int:
    import torch
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(
        tokenizer,
        hidden=hidden,
        layers=layers,
        heads=hidden // 64,
        kv_heads=max(1, hidden // 256),
        intermediate=4 * hidden,
    )
    if vocab is not None:
        model.resize_token_embeddings(vocab)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run_setup(setup: str, folder: str, rank: int) -> dict:
    """Build ``setup`` in this process; one train step and one reference pass; memory figures."""
    import torch
    from verity.engines import FSDP2Engine, OptimConfig
    from verity.engines.fsdp2_lora import FSDP2LoRAEngine
    from verity.engines.hf_loading import load_causal_lm
    from verity.engines.lora import LoRAConfig

    torch.set_num_threads(1)
    baseline = proc_status_kib("VmRSS")
    optim = OptimConfig(lr=1e-4)
    if setup == "full":
        actor = FSDP2Engine(load_causal_lm(folder), optim)
    else:
        actor = FSDP2LoRAEngine(load_causal_lm(folder), optim, lora=LoRAConfig(rank=rank, alpha=2.0 * rank))
    if setup == "lora+adapter-free-ref":
        reference = actor.adapter_free_reference()
        ref_tensors: list = []
    else:
        separate = FSDP2Engine(load_causal_lm(folder), None)
        reference = separate
        ref_tensors = list(separate.model.parameters())
    built = proc_status_kib("VmRSS")

    vocab = actor.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows, prompt, response = 8, 32, 32
    ids = torch.randint(4, vocab, (rows, prompt + response), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(prompt + response).expand(rows, -1).contiguous(),
        "responses": ids[:, prompt:],
        "response_mask": torch.ones(rows, response),
    }

    def loss_fn(mb, logprobs, entropy, agg):
        return -(logprobs * mb["response_mask"]).sum() / agg.global_tokens, {}

    actor.train_step(batch, loss_fn, 4)
    reference.compute_logprobs(batch, 4, compute_entropy=False)
    actor_params = sum(p.numel() * p.element_size() for p in actor.model.parameters())
    return {
        "setup": setup,
        "actor_param_bytes": actor_params,
        "reference_param_bytes": sum(p.numel() * p.element_size() for p in ref_tensors),
        "trainable_params": actor.trainable_parameters(),
        "optimizer_state_bytes": actor.optimizer_state_bytes(),
        "rss_before_mib": baseline / 1024,
        "rss_built_mib": built / 1024,
        "rss_after_step_mib": proc_status_kib("VmRSS") / 1024,
        "rss_peak_mib": proc_status_kib("VmHWM") / 1024,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=None, help="resize the vocabulary (default: characters)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    parser.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)  # child process
    parser.add_argument("--model", help=argparse.SUPPRESS)  # child process
    args = parser.parse_args(argv)
    if args.setup:
        print(json.dumps(run_setup(args.setup, args.model, args.rank)))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(Path(tmp), args.hidden, args.layers, args.vocab)
        rows = []
        for setup in SETUPS:
            command = [
                sys.executable,
                "-m",
                "ci.bench_lora_memory",
                "--setup",
                setup,
                "--model",
                tmp,
                "--rank",
                str(args.rank),
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"model: {n_params / 1e6:.1f}M parameters ({n_params * 4 / 2**20:.0f} MiB float32), LoRA rank {args.rank}"
    )
    header = f"{'setup':24} {'actor params MiB':>16} {'ref params MiB':>14} {'trainable':>11} {'optim MiB':>10} {'RSS built':>10} {'RSS peak':>9}"
    print(header)
    for r in rows:
        print(
            f"{r['setup']:24} {r['actor_param_bytes'] / 2**20:16.1f} {r['reference_param_bytes'] / 2**20:14.1f} "
            f"{r['trainable_params']:11,d} {r['optimizer_state_bytes'] / 2**20:10.1f} "
            f"{r['rss_built_mib']:10.0f} {r['rss_peak_mib']:9.0f}"
        )
    free, separate = rows[0], rows[1]
    print(
        f"reference for free saves {separate['reference_param_bytes'] / 2**20:.0f} MiB of parameters; "
        f"RSS after building: {separate['rss_built_mib'] - free['rss_built_mib']:.0f} MiB less, "
        f"peak RSS: {separate['rss_peak_mib'] - free['rss_peak_mib']:.0f} MiB less"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"n_params": n_params, "rank": args.rank, "setups": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
