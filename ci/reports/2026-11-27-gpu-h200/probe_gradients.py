"""Device calls 3 and 4 (2026-11-27, H200): the third step's gradients of two compiled engines and one
with CUDA graphs (lr 1e-9, four micro-batches a step).

    PYTHONPATH=packages/verity/src python3 ci/reports/2026-11-27-gpu-h200/probe_gradients.py --attn sdpa
    PYTHONPATH=packages/verity/src python3 ci/reports/2026-11-27-gpu-h200/probe_gradients.py --attn eager

Call 3 ran it with the model's default attention (sdpa) and every parameter printed, call 4 with
eager attention and the first layer's attention parameters and the embedding printed (the
script as run then differed only in that; reformatted here). Outputs: probe-output.txt.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from helpers.tiny_models import make_unpadded_batch, push_up_loss, tiny_qwen2  # noqa: E402
from verity.engines import FSDP2Engine, OptimConfig  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
args = parser.parse_args()
batch = make_unpadded_batch(8, seed=1)
engines = [
    FSDP2Engine(
        tiny_qwen2(tie_word_embeddings=False),
        OptimConfig(lr=1e-9),
        device="cuda",
        compile_layers=True,
        cuda_graphs=graphs,
        attn_implementation=None if args.attn == "sdpa" else "eager",
    )
    for graphs in (False, False, True)
]
for engine in engines:
    for _ in range(2):
        engine.train_step(batch, push_up_loss, 2)
print("losses", [engine.forward_backward(batch, push_up_loss, 2)["loss"] for engine in engines])
named = [engine.model.named_parameters() for engine in engines]
for (name, a), (_, b), (_, c) in zip(*named, strict=True):
    if args.attn == "eager" and not ("layers.0.self" in name or "embed" in name or "layers.0.input" in name):
        continue
    print(
        f"{name:45s} max|g| {a.grad.abs().max().item():.3e}  "
        f"plain-plain {(a.grad - b.grad).abs().max().item():.3e}  "
        f"plain-graphed {(a.grad - c.grad).abs().max().item():.3e}  "
        f"ratio-sum {(c.grad.sum() / a.grad.sum()).item():.6f}"
    )
