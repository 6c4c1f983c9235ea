"""Actor-update MFU and rollout tokens/s of a Qwen2.5-0.5B-shaped model, verity beside its peers.

    python -m ci.bench_gpu --out outputs/bench_gpu/result.json            # on a CUDA machine
    python -m ci.bench_gpu --model tiny --device cpu --out /tmp/b.json    # a small check anywhere
    python -m ci.bench_gpu --model qwen2.5-vocab-small-body --device cpu --rows 8 --micro-rows 8 \
        --prompt-len 64 --response-len 192 --sides update-verity-autograd-head,update-verity --out ...
                                                 # the loss head's cost where the vocabulary dominates

The model is built from Qwen2.5-0.5B's published shape (hidden 896, 24 layers, 14 query
and 2 key/value heads, MLP 4864, vocabulary 151,936, tied embeddings), randomly
initialised: a step's cost does not depend on the weights' values, and nothing is
downloaded. Every row is a distinct random prompt of ``--prompt-len`` tokens followed by
``--response-len`` response tokens (no padding), so the FLOPs are known exactly.

| side | what runs |
|---|---|
| ``update-verity`` | ``FSDP2Engine.train_step`` (one process, bf16 autocast over float32 master weights, SDPA, fused AdamW), a GRPO policy-gradient loss |
| ``update-verity-compiled`` | the same with ``compile_layers=True``: each decoder layer through inductor, and the loss head (:mod:`verity.engines.compiled_head`) |
| ``update-verity-cudagraphs`` | ``update-verity-compiled`` with ``cuda_graphs=True``: each layer's training forward and backward replayed as CUDA graphs (:mod:`verity.engines.compiled_layers`) |
| ``update-verity-compiled-eager-head`` | compiled layers, the eager chunked loss head (:mod:`verity.engines.fused_logprobs`): what the compiled head adds |
| ``update-verity-autograd-head`` | ``update-verity`` with the loss head through autograd (``entropy_requires_grad=True``: a float32 ``[N, V]`` log-softmax kept for the backward, the entropy in the graph; the head every step ran before :mod:`verity.engines.fused_logprobs`, then with ``logsumexp``) |
| ``update-torch`` | a plain PyTorch loop on the same work: bf16 autocast, ``logits_to_keep``, log-softmax, the same loss, backward, clip, fused AdamW |
| ``update-torch-compiled`` | that loop with each decoder layer compiled (``layer.compile()``), as verity's compiled side does |
| ``generate-verity`` | ``HFRollout.generate`` (its own KV-cache decode loop), bf16 weights, EOS ignored |
| ``generate-hf`` | ``transformers`` ``model.generate`` on the same prompts, bf16, ``min_new_tokens`` = ``max_new_tokens`` |

**Model FLOPs of one training token** (forward + backward = 3 x forward), counted as
the work the model needs, not what a kernel happens to do: ``6 * N_body`` for the
decoder's weight matmuls (every token), ``6 * V * H`` for the output projection (only the
``R`` positions whose log-probabilities the loss reads, plus the one before them, as the
engine runs it), and ``6 * L * H * S`` per token for causal attention's score and value
products (half of the ``S x S`` matrix; the 12 L H S of the non-causal formula would
double it). MFU = those FLOPs per second over the device's dense bf16 peak (the vendor
datasheet's, :mod:`verity.hardware.flops`), and also over the bf16 matmul rate measured
at the start of the run (an 8192-cube product on random data).

``--sdpa-backend cudnn|flash|efficient|math`` lets attention use that one SDPA kernel in every
side (the default, ``auto``, is torch's choice: cuDNN's on an H200 with torch 2.11); the
JSON's ``config`` records it. Compare backends across runs of one machine, one per process.

``--process-per-side`` runs each side in a fresh process (:mod:`bench_gpu_processes`) and merges
their figures into one JSON with the same ratios: sides sharing a process share its device
memory, and a CUDA-graph side's pools made the next side run out of memory on an H200.

Times are medians over ``--steps`` steps after ``--warmup`` steps, with the device
synchronised around each; the JSON records the device, torch and transformers versions
and every step's seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ci.bench_gpu_model import (
    EOS_ID,
    MODELS,
    PAD_ID,
    QWEN25_05B,
    TINY,
    VOCAB_SMALL_BODY,
    build_model,
    param_counts,
    policy_loss,
    train_batch,
    training_flops_per_row,
)
from ci.bench_gpu_processes import FLAG as PROCESS_PER_SIDE
from ci.bench_gpu_processes import run_each_side_apart
from ci.bench_gpu_profile import maybe_profile, sync

__all__ = [
    "MODELS",
    "QWEN25_05B",
    "SDPA_BACKENDS",
    "SIDES",
    "TINY",
    "VOCAB_SMALL_BODY",
    "build_model",
    "main",
    "param_counts",
    "policy_loss",
    "train_batch",
    "training_flops_per_row",
]

SIDES = (
    "update-verity",
    "update-verity-compiled",
    "update-verity-cudagraphs",
    "update-verity-compiled-eager-head",
    "update-verity-autograd-head",
    "update-torch",
    "update-torch-compiled",
    "generate-verity",
    "generate-hf",
)


def timed_steps(step: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> dict:
    """Seconds of ``warmup`` then ``steps`` calls of ``step``, synchronised around each; ``last``: its last result."""
    seconds, last = [], None
    for _ in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        last = step()
        sync(device)
        seconds.append(time.perf_counter() - start)
    return {
        "warmup_seconds": seconds[:warmup],
        "step_seconds": seconds[warmup:],
        "median_seconds": statistics.median(seconds[warmup:]),
        "last": last,
    }


def measure_matmul_peak(device: torch.device, n: int = 8192, repeats: int = 10) -> float | None:
    """bf16 FLOP/s of an ``n``-cube matrix product on random data (CUDA only; None elsewhere)."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2.0 * n**3 / statistics.median(times)


def update_verity(
    args: argparse.Namespace,
    device: torch.device,
    compiled: bool,
    autograd_head: bool = False,
    compiled_head: bool | None = None,
    cuda_graphs: bool = False,
) -> dict:
    """``FSDP2Engine.train_step`` seconds on the bench batch; the engine's own ``ran`` facts.

    ``autograd_head``: the loss head through autograd (an entropy gradient asked for, which
    the policy loss then ignores: the same gradient, autograd's cost for the head).
    ``compiled_head``: the engine's ``compile_head`` (default: as ``compiled``).
    ``cuda_graphs``: the engine's ``cuda_graphs``; the side then also records inductor's
    CUDA-graph counters (graphs recorded, skips), so a silent fallback shows.
    """
    from torch._dynamo.utils import counters
    from verity.engines import FSDP2Engine, OptimConfig

    model = build_model(MODELS[args.model], device)
    engine = FSDP2Engine(
        model,
        OptimConfig(lr=1e-6),
        device=device,
        mixed_precision=args.bf16,
        attn_implementation="sdpa",
        compile_layers=compiled,
        compile_head=compiled_head,
        cuda_graphs=cuda_graphs,
    )
    counters.clear()
    batch = train_batch(MODELS[args.model], args.rows, args.prompt_len, args.response_len, seed=1)

    def step() -> dict:
        return engine.train_step(batch, policy_loss, args.micro_rows, entropy_requires_grad=autograd_head)

    out = timed_steps(step, device, args.warmup, args.steps)
    name = (
        "update-verity"
        + ("-compiled" if compiled and not cuda_graphs else "")
        + ("-cudagraphs" if cuda_graphs else "")
        + ("-eager-head" if compiled and not engine.compiled_head else "")
        + ("-autograd-head" if autograd_head else "")
    )
    maybe_profile(args, name, step)
    metrics = out.pop("last")
    out["engine_tokens"] = metrics["tokens"]  # what the engine says it trained on, checked below
    if metrics["tokens"] != args.rows * (args.prompt_len + args.response_len):
        raise RuntimeError(
            f"the engine trained {metrics['tokens']} tokens, the bench counts "
            f"{args.rows * (args.prompt_len + args.response_len)}"
        )
    out["compiled_layers"] = bool(getattr(engine, "compiled_layers", False))
    out["compiled_head"] = engine.compiled_head
    out["mixed_precision"] = engine.mixed_precision
    out["cuda_graphs"] = engine.cuda_graphs
    out["inductor_counters"] = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    out["unique_graphs"] = counters["stats"].get("unique_graphs", 0)
    return out


def update_torch(args: argparse.Namespace, device: torch.device, compiled: bool = False) -> dict:
    """The same update as a plain PyTorch loop (no verity code); ``compiled``: each decoder layer compiled."""
    model = build_model(MODELS[args.model], device).train()
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    batch = {
        k: v.to(device)
        for k, v in train_batch(
            MODELS[args.model], args.rows, args.prompt_len, args.response_len, seed=1
        ).items()
    }
    tokens = batch["response_mask"].sum()
    r = args.response_len

    def step() -> None:
        for start in range(0, args.rows, args.micro_rows):
            rows = slice(start, start + args.micro_rows)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                logits = model(
                    input_ids=batch["input_ids"][rows],
                    attention_mask=batch["attention_mask"][rows],
                    position_ids=batch["position_ids"][rows],
                    logits_to_keep=r + 1,
                    use_cache=False,
                ).logits[:, :-1]
            logp = logits.float().log_softmax(-1).gather(-1, batch["responses"][rows, :, None]).squeeze(-1)
            loss = -(logp * batch["advantages"][rows] * batch["response_mask"][rows]).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = timed_steps(step, device, args.warmup, args.steps)
    out.pop("last")
    maybe_profile(args, "update-torch" + ("-compiled" if compiled else ""), step)
    return out


def _gen_prompts(args: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(
        2, MODELS[args.model]["vocab_size"], (args.gen_rows, args.gen_prompt_len), generator=g
    )
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate_verity(args: argparse.Namespace, device: torch.device) -> dict:
    """``HFRollout.generate`` seconds for ``gen_rows`` x ``gen_new_tokens`` sampled tokens."""
    from verity.rollout import HFRollout, SamplingParams

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    rollout = HFRollout(
        build_model(MODELS[args.model], device, dtype).eval(), pad_token_id=PAD_ID, eos_token_ids=[EOS_ID]
    )
    params = SamplingParams(max_new_tokens=args.gen_new_tokens, ignore_eos=True)
    prompts = _gen_prompts(args)
    out = timed_steps(lambda: rollout.generate(prompts, params), device, 1, args.gen_repeats)
    out["response_tokens"] = int(out.pop("last")["response_mask"].sum())
    return out


def generate_hf(args: argparse.Namespace, device: torch.device) -> dict:
    """``model.generate`` seconds for the same prompts and length."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = build_model(MODELS[args.model], device, dtype).eval()
    prompts = {k: v.to(device) for k, v in _gen_prompts(args).items()}
    n = args.gen_new_tokens

    def step() -> Any:
        with torch.no_grad():
            return model.generate(
                **prompts,
                do_sample=True,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=PAD_ID,
                eos_token_id=EOS_ID,
                top_k=0,
                top_p=1.0,
            )

    out = timed_steps(step, device, 1, args.gen_repeats)
    out["response_tokens"] = int((out.pop("last").shape[1] - args.gen_prompt_len) * args.gen_rows)
    return out


def summarise(
    args: argparse.Namespace, sides: dict[str, dict], peak: float | None, measured: float | None
) -> dict:
    """Tokens/s, MFU and the verity/peer ratios from the raw side results."""
    shape = MODELS[args.model]
    row_flops = training_flops_per_row(shape, args.prompt_len, args.response_len)
    tokens = args.rows * (args.prompt_len + args.response_len)
    summary: dict[str, Any] = {"train_tokens_per_step": tokens, "model_flops_per_step": row_flops * args.rows}
    for name, side in sides.items():
        if "median_seconds" not in side:
            continue
        sec = side["median_seconds"]
        if name.startswith("update"):
            side["tokens_per_s"] = tokens / sec
            side["model_tflops_per_s"] = row_flops * args.rows / sec / 1e12
            side["mfu_vs_datasheet"] = None if peak is None else row_flops * args.rows / sec / peak
            side["mfu_vs_measured_matmul"] = (
                None if measured is None else row_flops * args.rows / sec / measured
            )
        else:
            side["tokens_per_s"] = side["response_tokens"] / sec
    pairs = {
        "update_verity_vs_torch": ("update-verity", "update-torch"),
        "update_verity_compiled_vs_torch": ("update-verity-compiled", "update-torch"),
        "update_verity_compiled_vs_torch_compiled": ("update-verity-compiled", "update-torch-compiled"),
        "update_verity_cudagraphs_vs_compiled": ("update-verity-cudagraphs", "update-verity-compiled"),
        "update_verity_cudagraphs_vs_torch_compiled": ("update-verity-cudagraphs", "update-torch-compiled"),
        "update_verity_compiled_vs_eager_head": (
            "update-verity-compiled",
            "update-verity-compiled-eager-head",
        ),
        "update_verity_vs_autograd_head": ("update-verity", "update-verity-autograd-head"),
        "generate_verity_vs_hf": ("generate-verity", "generate-hf"),
    }
    for key, (ours, peer) in pairs.items():
        if "tokens_per_s" in sides.get(ours, {}) and "tokens_per_s" in sides.get(peer, {}):
            summary[key] = sides[ours]["tokens_per_s"] / sides[peer]["tokens_per_s"]
    return summary


def environment(device: torch.device) -> dict:
    """What ran: device name, torch, CUDA and transformers versions, date, this process's id."""
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "pid": os.getpid(),
    }


def format_table(result: dict) -> str:
    """A short text table of the sides."""
    lines = [
        f"device: {(result['environment'] or {}).get('device', 'unknown')}  model: {result['config']['model']}",
        f"{'side':34} {'s (median)':>11} {'tokens/s':>12} {'MFU(sheet)':>11} {'MFU(meas.)':>11}",
    ]
    for name, side in result["sides"].items():
        if "error" in side:
            lines.append(f"{name:34} error: {side['error'][:80]}")
            continue
        mfu = side.get("mfu_vs_datasheet")
        meas = side.get("mfu_vs_measured_matmul")
        lines.append(
            f"{name:34} {side['median_seconds']:11.4f} {side['tokens_per_s']:12.0f} "
            f"{'' if mfu is None else f'{mfu:.1%}':>11} {'' if meas is None else f'{meas:.1%}':>11}"
        )
    for key, value in result["summary"].items():
        if "_vs_" in key:
            lines.append(f"{key}: {value:.2f}x")
    return "\n".join(lines)


SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")


def sdpa_backend(name: str) -> contextlib.AbstractContextManager:
    """Only SDPA kernel ``name`` while a side runs (``auto``: torch's own choice).

    The compiled sides trace their layers inside it, so the kernel is fixed in their graphs;
    one backend per process, since dynamo's cache does not key on it. A shape the kernel
    cannot take fails the side ("No viable backend ...") rather than falling back.
    """
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]
    return sdpa_kernel([backend])


def run(args: argparse.Namespace) -> dict:
    """Every requested side in turn (each failure recorded, the rest still run); the JSON written after each."""
    from verity.engines.compiled_head import use_kernels
    from verity.hardware.flops import peak_flops_for

    use_kernels(args.compiled_head_kernels)
    device = torch.device(args.device)
    env = environment(device)
    peak = peak_flops_for(env["device"]) if device.type == "cuda" else None
    measured = measure_matmul_peak(device)
    result: dict[str, Any] = {
        "environment": env,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
        "datasheet_peak_flops": peak,
        "measured_matmul_flops": measured,
        "sides": {},
    }
    runners: dict[str, Callable[[], dict]] = {
        "update-verity": lambda: update_verity(args, device, compiled=False),
        "update-verity-compiled": lambda: update_verity(args, device, compiled=True),
        "update-verity-cudagraphs": lambda: update_verity(args, device, compiled=True, cuda_graphs=True),
        "update-verity-compiled-eager-head": lambda: update_verity(
            args, device, compiled=True, compiled_head=False
        ),
        "update-verity-autograd-head": lambda: update_verity(
            args, device, compiled=False, autograd_head=True
        ),
        "update-torch": lambda: update_torch(args, device),
        "update-torch-compiled": lambda: update_torch(args, device, compiled=True),
        "generate-verity": lambda: generate_verity(args, device),
        "generate-hf": lambda: generate_hf(args, device),
    }
    for name in args.sides:
        print(f"[bench_gpu] {name} ...", flush=True)
        try:
            with sdpa_backend(args.sdpa_backend):
                side = runners[name]()
            if device.type == "cuda":
                side["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        except Exception as err:  # one side's failure must not lose the others' figures
            side = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        result["sides"][name] = side
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        result["summary"] = summarise(args, result["sides"], peak, measured)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"[bench_gpu] {name}: {json.dumps({k: v for k, v in side.items() if k != 'traceback'})}",
            flush=True,
        )
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("outputs/bench_gpu/result.json"))
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="float32 throughout")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--micro-rows", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=768)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--gen-rows", type=int, default=128)
    p.add_argument("--gen-prompt-len", type=int, default=256)
    p.add_argument("--gen-new-tokens", type=int, default=256)
    p.add_argument("--gen-repeats", type=int, default=2)
    p.add_argument(
        "--compiled-head-kernels",
        choices=("auto", "inductor", "triton"),
        default="auto",
        help="what the compiled sides' loss head runs (verity.engines.compiled_head.use_kernels)",
    )
    p.add_argument(
        "--sdpa-backend",
        choices=SDPA_BACKENDS,
        default="auto",
        help="the only SDPA kernel every side may use (torch.nn.attention.sdpa_kernel); auto: torch's choice",
    )
    p.add_argument("--profile", type=Path, default=None, help="folder for one profiled step per update side")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, from {','.join(SIDES)}")
    p.add_argument(
        PROCESS_PER_SIDE,
        action="store_true",
        help="each side in a fresh process, so no side runs in memory an earlier one holds (bench_gpu_processes)",
    )
    args = p.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(args.sides) - set(SIDES))
    if unknown:
        p.error(f"--sides: unknown {unknown}; expected names from {list(SIDES)}")
    for name in (
        "rows",
        "micro_rows",
        "prompt_len",
        "response_len",
        "steps",
        "gen_rows",
        "gen_prompt_len",
        "gen_new_tokens",
        "gen_repeats",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (use --device cpu with --model tiny)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.process_per_side:
        result = run_each_side_apart(args, argv, "ci.bench_gpu", summarise)
    else:
        result = run(args)
    print(format_table(result), flush=True)
    return 1 if any("error" in side for side in result["sides"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
