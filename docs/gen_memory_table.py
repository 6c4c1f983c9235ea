"""Write the memory plan's table for Qwen2.5-7B/32B/72B into docs/hardware.md ("Memory plan").

    python docs/gen_memory_table.py            # rewrite the table between the markers
    python docs/gen_memory_table.py --check    # exit 1 when the page's table is out of date

The shapes are Qwen2.5's published configs (hidden size, layers, heads, KV heads, MLP width,
vocabulary), counted on the meta device: nothing is downloaded. Each row is the plan
(:mod:`verity.launch.memory_plan`) of one GRPO run: the actor, the reference (a KL loss) and the
HF rollout colocated in every worker, on ``nodes x 8`` GPUs of 80 GiB, with the batch shape of
:data:`OVERRIDES`. ``tests/unit/test_memory_plan.py`` rebuilds it and compares it with the page.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

PAGE = Path(__file__).parent / "hardware.md"
START, END = "<!-- memory-table:start -->", "<!-- memory-table:end -->"

#: Qwen2.5 shapes: hidden, layers, attention heads, KV heads, MLP width (vocabulary 152,064, untied)
QWEN25 = {
    "Qwen2.5-7B": (3584, 28, 28, 4, 18944),
    "Qwen2.5-32B": (5120, 64, 40, 8, 27648),
    "Qwen2.5-72B": (8192, 80, 64, 8, 29568),
}
NODES = (1, 2, 4)
GPUS_PER_NODE = 8
DEVICE_GIB = 80
#: the run every row plans: GRPO with a KL loss (so a reference), 64 prompts x 8 samples per step,
#: sequences of 512 + 3584 = 4096 tokens, one 4096-token row per micro-batch, gradient
#: checkpointing, float32 master weights with bf16 compute, a bf16 rollout
OVERRIDES = [
    "algorithm.advantage.estimator=grpo",
    "algorithm.kl.use_kl_loss=true",
    "data.train_batch_size=64",
    "actor.ppo_mini_batch_size=16",
    "rollout.n=8",
    "data.max_prompt_length=512",
    "data.max_response_length=3584",
    "actor.fsdp2.sharding=full",
    "actor.micro_batch_size=64",
    "actor.fsdp2.micro_batch_tokens=4096",
    "model.gradient_checkpointing=true",
    "model.dtype=float32",
    "rollout.dtype=bfloat16",
    "trainer.device=cuda",
    f"trainer.device_memory_gb={DEVICE_GIB}",
]


def qwen25_shape(name: str) -> Any:
    """The :class:`~verity.launch.memory_terms.ModelShape` of a Qwen2.5 size, from its public config."""
    from transformers import Qwen2Config
    from verity.launch.memory_terms import ModelShape

    hidden, layers, heads, kv_heads, width = QWEN25[name]
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=width,
        vocab_size=152064,
        tie_word_embeddings=False,
    )
    return ModelShape.from_hf_config(config)


def plan(name: str, nodes: int, offload: bool, rollout_tp: int = 1) -> Any:
    """The memory plan of one row: ``name`` on ``nodes x 8`` GPUs, FSDP2 offload on or off, the rollout
    split over ``rollout_tp`` GPUs (``rollout.tensor_parallel_size``)."""
    from verity.config import load_config
    from verity.launch.memory_plan import MemoryCapacity, plan_memory, run_pools

    shape = [f"trainer.nnodes={nodes}", f"trainer.n_workers_per_node={GPUS_PER_NODE}"]
    cluster = ["trainer.ray_address=auto"] if nodes > 1 else []
    cfg = load_config([*OVERRIDES, *shape, *cluster])
    # set after loading: the config's own model (embedded) is not the planned one, whose heads it divides
    cfg.rollout.tensor_parallel_size = rollout_tp
    if offload:  # the FSDP2 offload settings (actor.fsdp2.offload_params), read as the plan reads them
        cfg.actor.fsdp2.offload_params = True
    capacity = MemoryCapacity.declared(DEVICE_GIB * 2**30)
    return plan_memory(cfg, {"actor": qwen25_shape(name)}, run_pools(cfg), "cuda", capacity)


def render() -> str:
    """The table's Markdown: one row per model, node count, offload setting and rollout split (whole, or
    with offload over as many of a node's 8 GPUs as the model's key/value heads allow)."""
    from verity.launch.memory_terms import gib

    rows = [
        "| model | parameters | GPUs | offload | rollout TP | peak per GPU (stage) | host per GPU | fits in 72 GiB | largest term |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in QWEN25:
        n_params = qwen25_shape(name).n_params
        for nodes in NODES:
            split = min(GPUS_PER_NODE, QWEN25[name][3])  # TP must divide the KV heads
            for offload, tp in ((False, 1), (True, 1), (True, split)):
                p = plan(name, nodes, offload, tp)
                worker = p.workers[0]
                peak, stage = worker.peak("device")
                host, _ = worker.peak("host")
                largest = worker.largest("device")
                rows.append(
                    f"| {name} | {n_params / 1e9:.2f} B | {nodes} x {GPUS_PER_NODE} | {'params + optimizer' if offload else 'none'} | {tp} "
                    f"| {gib(peak):g} GiB ({stage}) | {gib(host):g} GiB | {'yes' if p.fits() else '**no**'} "
                    f"| {largest.name} {gib(largest.bytes):g} GiB |"
                )
    return "\n".join(rows) + "\n"


def page_with_table(page: str, table: str) -> str:
    """``page`` with the text between the markers replaced by ``table``."""
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}{END}{tail}"


if __name__ == "__main__":
    text = PAGE.read_text(encoding="utf-8")
    new = page_with_table(text, render())
    if "--check" in sys.argv[1:]:
        sys.exit(0 if new == text else 1)
    PAGE.write_text(new, encoding="utf-8")
