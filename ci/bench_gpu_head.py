"""The loss head's kernels on one micro-batch of logits, side by side, on a GPU.

    python -m ci.bench_gpu_head                          # [12,304 x 151,936] bf16: 16 rows x 769 positions
    python -m ci.bench_gpu_head --rows 49216 --out outputs/bench_gpu/head.json   # the 64-row micro-batch
    python -m ci.bench_gpu_head --device cpu --rows 64 --vocab 4096 --repeats 2  # a dry run (no Triton sides)

Sides, all on the same logits and labels:

| side | what |
|---|---|
| ``triton`` | :mod:`verity.engines.triton_head` at the engines' block and warps |
| ``triton-fwd-BxW`` / ``triton-bwd-BxW`` | the same kernels at other blocks and warps (``--forward-configs``, ``--backward-configs``) |
| ``triton-2026-11-26`` | the forward the engines ran before 2026-11-27: per-lane running sums, two exponentials per logit |
| ``inductor`` | :func:`verity.engines.compiled_head.head_forward` / ``head_backward`` through ``torch.compile``, rows dynamic, as on CPU |
| ``torch`` | plain PyTorch: ``log_softmax`` in float32, ``gather``, the entropy; backward through autograd |

Each time is the median of ``--repeats`` calls timed by CUDA events after ``--warmup``
calls. The forward reads the ``N x V`` logits once at best, the backward reads them and
writes the gradient; GB/s counts those bytes, and a device-to-device copy of the logits
in the same run (read + write) is the yardstick: ``of_copy`` is a side's GB/s over the
copy's. Each side's log-probs are compared with ``triton``'s (``max_abs_diff_logprobs``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ci.bench_gpu import environment

__all__ = ["main", "parse_args", "run"]


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn`` (CUDA events on CUDA, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_seconds(x: torch.Tensor, device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of a device-to-device copy of ``x`` (reads and writes its bytes once)."""
    target = torch.empty_like(x)
    return timed(lambda: target.copy_(x), device, warmup, repeats)


def previous_triton_forward() -> Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, ...]]:
    """The forward kernel the engines ran until 2026-11-27, kept here as the same-run baseline.

    Per lane of a 4096-column block, 8 warps: running maximum, ``sum e^(z-m)`` and
    ``sum e^(z-m)(z-m)``, rescaled per lane at every step (two exponentials per logit).
    """
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        logits_ptr,
        labels_ptr,
        logprobs_ptr,
        entropy_ptr,
        lse_ptr,
        row_stride,
        vocab,
        inv_t,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], dtype=tl.float32)
        t = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            z = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, z)
            seen = m_new > float("-inf")
            m_ref = tl.where(seen, m_new, 0.0)
            alpha = tl.where(seen, tl.exp(m - m_ref), 1.0)
            e = tl.exp(z - m_ref)
            d = tl.where(e > 0.0, z - m_ref, 0.0)
            t = alpha * (t + tl.where(s > 0.0, m - m_ref, 0.0) * s) + e * d
            s = alpha * s + e
            m = m_new
        big_m = tl.max(m, axis=0)
        used = s > 0.0
        w = tl.where(used, tl.exp(m - big_m), 0.0)
        big_s = tl.sum(w * s, axis=0)
        big_t = tl.sum(w * (t + tl.where(used, m - big_m, 0.0) * s), axis=0)
        log_s = tl.log(big_s)
        lse = big_m + log_s
        chosen = tl.load(base + tl.load(labels_ptr + row)).to(tl.float32) * inv_t
        tl.store(logprobs_ptr + row, chosen - lse)
        tl.store(entropy_ptr + row, log_s - big_t / big_s)
        tl.store(lse_ptr + row, lse)

    def forward(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
        out = torch.empty(3, logits.shape[0], dtype=torch.float32, device=logits.device)
        kernel[(logits.shape[0],)](
            logits, labels, out[0], out[1], out[2], logits.stride(0), logits.shape[1], 1.0 / temperature,
            BLOCK=4096, num_warps=8,
        )  # fmt: skip
        return out[0], out[1], out[2]

    return forward


def _config(text: str) -> tuple[int, int]:
    block, warps = text.lower().split("x")
    return int(block), int(warps)


def run(args: argparse.Namespace) -> dict:
    """Every side on the same logits; the JSON written at the end (each side's failure recorded, the rest still run)."""
    from verity.engines.compiled_head import head_backward, head_forward

    device = torch.device(args.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=gen) * 3).to(device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, args.vocab, (args.rows,), generator=gen).to(device)
    grad_out = torch.randn(args.rows, generator=gen).to(device)
    tau = args.temperature
    n_bytes = logits.numel() * logits.element_size()
    time_it = lambda fn: timed(fn, device, args.warmup, args.repeats)  # noqa: E731

    copy_gbs = 2 * n_bytes / copy_seconds(logits, device, args.warmup, args.repeats) / 1e9
    sides: dict[str, dict] = {}
    reference: list[torch.Tensor] = []

    def record(
        name: str,
        forward: Callable[[], tuple],
        backward: Callable[[], Any] | None,
        *,
        time_forward: bool = True,
    ) -> None:
        """``forward`` runs once for the log-prob check, and is timed only with ``time_forward``."""
        try:
            side: dict[str, Any] = {}
            logp = forward()[0]
            if not reference:
                reference.append(logp.float())
            side["max_abs_diff_logprobs"] = (logp.float() - reference[0]).abs().max().item()
            if time_forward:
                side["forward_ms"] = time_it(forward) * 1e3
                side["forward_gb_per_s"] = n_bytes / side["forward_ms"] * 1e3 / 1e9
                side["forward_of_copy"] = side["forward_gb_per_s"] / copy_gbs
            if backward is not None:
                side["backward_ms"] = time_it(backward) * 1e3
                side["backward_gb_per_s"] = 2 * n_bytes / side["backward_ms"] * 1e3 / 1e9
                side["backward_of_copy"] = side["backward_gb_per_s"] / copy_gbs
        except Exception as err:  # one side's failure must not lose the others
            side = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        sides[name] = side
        print(
            f"[bench_gpu_head] {name}: {json.dumps({k: v for k, v in side.items() if k != 'traceback'})}",
            flush=True,
        )

    if device.type == "cuda":
        from verity.engines import triton_head as th

        _, _, lse = th.triton_head_forward(logits, labels, tau)
        record(
            "triton",
            lambda: th.triton_head_forward(logits, labels, tau),
            lambda: th.triton_head_backward(logits, labels, lse, grad_out, tau),
        )
        for block, warps in map(_config, args.forward_configs):
            record(
                f"triton-fwd-{block}x{warps}",
                lambda b=block, w=warps: th.triton_head_forward(logits, labels, tau, block=b, num_warps=w),
                None,
            )
        for block, warps in map(_config, args.backward_configs):
            record(
                f"triton-bwd-{block}x{warps}",
                lambda: th.triton_head_forward(logits, labels, tau),
                lambda b=block, w=warps: th.triton_head_backward(
                    logits, labels, lse, grad_out, tau, block=b, num_warps=w
                ),
                time_forward=False,  # the engines' forward, timed in the ``triton`` side
            )
        old = previous_triton_forward()
        record("triton-2026-11-26", lambda: old(logits, labels, tau), None)
    fwd, bwd = torch.compile(head_forward, fullgraph=True), torch.compile(head_backward, fullgraph=True)
    for t in (logits, labels, grad_out):
        torch._dynamo.mark_dynamic(t, 0)
    _, _, lse_i = fwd(logits, labels, tau)
    torch._dynamo.mark_dynamic(lse_i, 0)
    record("inductor", lambda: fwd(logits, labels, tau), lambda: bwd(logits, labels, lse_i, grad_out, tau))

    leaf = logits.detach().requires_grad_()

    def torch_forward() -> tuple:
        logp_all = (leaf.float() / tau).log_softmax(-1)
        logp = logp_all.gather(-1, labels[:, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    def torch_backward() -> None:
        logp, _ = torch_forward()
        torch.autograd.grad(logp, leaf, grad_out)

    with torch.no_grad():
        record("torch", torch_forward, None)
    sides["torch"]["forward_and_backward_ms"] = (
        time_it(torch_backward) * 1e3 if "error" not in sides["torch"] else None
    )
    env = environment(device)
    if device.type == "cuda":
        import triton

        env["triton"] = triton.__version__
    result = {
        "environment": env,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "logits": {"rows": args.rows, "vocab": args.vocab, "dtype": "bfloat16", "bytes": n_bytes},
        "copy_gb_per_s": copy_gbs,
        "sides": sides,
    }
    base = sides.get("triton", {})
    for name, side in sides.items():
        if name != "triton" and "forward_ms" in side and "forward_ms" in base:
            side["forward_vs_triton"] = side["forward_ms"] / base["forward_ms"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_table(result: dict) -> str:
    """One line a side: milliseconds and the share of the copy's bandwidth."""
    lines = [
        f"device: {result['environment']['device']}  logits: {result['logits']['rows']} x "
        f"{result['logits']['vocab']} bf16  copy: {result['copy_gb_per_s']:.0f} GB/s",
        f"{'side':22} {'fwd ms':>8} {'of copy':>8} {'bwd ms':>8} {'of copy':>8}",
    ]
    for name, side in result["sides"].items():
        if "error" in side:
            lines.append(f"{name:22} error: {side['error'][:70]}")
            continue
        fwd, bwd = side.get("forward_ms"), side.get("backward_ms")
        lines.append(
            f"{name:22} {'' if fwd is None else f'{fwd:8.3f}':>8} "
            f"{'' if fwd is None else format(side['forward_of_copy'], '8.1%'):>8} "
            f"{'' if bwd is None else f'{bwd:8.3f}':>8} "
            f"{'' if bwd is None else format(side['backward_of_copy'], '8.1%'):>8}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("outputs/bench_gpu/head.json"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=12_304, help="N: micro-batch rows x scored positions")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--forward-configs", default="4096x8,8192x8,2048x4,8192x4", help="BLOCKxWARPS,...")
    p.add_argument("--backward-configs", default="4096x4,8192x8,2048x4", help="BLOCKxWARPS,...")
    args = p.parse_args(argv)
    for key in ("forward_configs", "backward_configs"):
        texts = [c for c in getattr(args, key).split(",") if c]
        for text in texts:
            try:
                block, warps = _config(text)
            except ValueError:
                p.error(f"--{key.replace('_', '-')}: {text!r} is not BLOCKxWARPS (e.g. 4096x4)")
            if block < 1 or block & (block - 1) or warps < 1 or warps & (warps - 1):
                p.error(f"--{key.replace('_', '-')}: {text!r}: block and warps must be powers of two")
        setattr(args, key, texts)
    for key in ("rows", "vocab", "repeats"):
        if getattr(args, key) < 1:
            p.error(f"--{key}: expected an int >= 1, got {getattr(args, key)}")
    if args.temperature <= 0:
        p.error(f"--temperature: expected > 0, got {args.temperature}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (use --device cpu for a dry run)")
    return args


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    print(format_table(result), flush=True)
    return 1 if any("error" in side for side in result["sides"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
