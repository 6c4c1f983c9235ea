"""Checks of the loss head's Triton kernels that need no GPU, run in a child process by ``tests/unit/test_triton_head.py``.

``python -m helpers.triton_head_checks interpret OUT.json`` (with ``TRITON_INTERPRET=1``):
the kernels' arithmetic on CPU tensors through Triton's interpreter, against a float64
reference. ``python -m helpers.triton_head_checks compile OUT.json``: the kernels compiled
for sm_90 and sm_80 with the Triton wheel's own ``ptxas`` (no device needed), and the forward
loop's instructions counted in the SASS. Each check's outcome goes to ``OUT.json`` as
``{name: "ok" | "FAIL: ..."}`` (plus ``isa``: the counts), so one child process serves
every test and the parent process never imports Triton (vLLM's CPU build runs without it).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

VOCAB = 10_000  # two full blocks of 4096 and a partial one; five of 2048


def reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
    """float64 ``(log p(labels), entropy, lse)`` of ``logits / temperature``; a logit at -inf adds nothing."""
    z = logits.double() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels[:, None])[:, 0] - lse
    p = torch.exp(z - lse[:, None])
    entropy = torch.where(p > 0, p * (lse[:, None] - z), torch.zeros_like(p)).sum(-1)
    return logp, entropy, lse


def reference_grad(
    logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, temperature: float
) -> torch.Tensor:
    """float64 ``(onehot - p) g / tau``."""
    z = logits.double() / temperature
    onehot = torch.zeros_like(z).scatter_(1, labels[:, None], 1.0)
    return (onehot - torch.exp(z - lse.double()[:, None])) * (g.double() / temperature)[:, None]


def hard_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """``[10, VOCAB]`` float64 logits that stress the online normaliser, and a label per row."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, VOCAB, generator=gen, dtype=torch.float64) * 3
    x[1] = -1.0e4 + torch.randn(VOCAB, generator=gen, dtype=torch.float64)  # far below zero
    x[2, : VOCAB // 2] = float("-inf")  # masked logits: the first blocks hold nothing
    x[3] = torch.linspace(-20.0, 20.0, VOCAB, dtype=torch.float64)  # a new maximum in every block
    x[4] = torch.linspace(20.0, -20.0, VOCAB, dtype=torch.float64)  # the maximum in the first column
    x[5] = 0.0  # uniform: entropy log V
    x[6, 9_999] = 60.0  # one token takes all the mass, in the partial last block
    x[7] = x[7] * 10  # sharper
    x[8, :] = -30.0
    x[8, 4_096] = 5.0  # the maximum opening the second block
    labels = torch.randint(0, VOCAB, (10,), generator=gen)
    labels[2] = VOCAB - 1  # a row whose label sits past the masked half
    labels[6] = VOCAB - 1
    labels[4] = 0
    return x, labels


def check_forward(dtype: torch.dtype, temperature: float, block: int, warps: int) -> None:
    from verity.engines.triton_head import triton_head_forward

    x, labels = hard_rows()
    logits = x.to(dtype)
    logp, entropy, lse = triton_head_forward(logits, labels, temperature, block=block, num_warps=warps)
    ref_logp, ref_entropy, ref_lse = reference(logits, labels, temperature)
    # float32 rounds z = x / tau to ~6e-8 of the row's largest |z|; everything else is relative to it
    finite = logits.double().masked_fill(~torch.isfinite(logits.double()), 0.0)
    scale = 1.0 + finite.abs().amax(-1) / temperature
    for name, got, want, tol in (
        ("log p", logp, ref_logp, 4e-7),
        ("lse", lse, ref_lse, 4e-7),
        ("entropy", entropy, ref_entropy, 4e-6),
    ):
        if got.dtype != torch.float32 or got.shape != (10,):
            raise AssertionError(f"{name}: expected float32 [10], got {got.dtype} {tuple(got.shape)}")
        err = (got.double() - want).abs() / scale
        if not torch.isfinite(got).all() or err.max() > tol:
            raise AssertionError(
                f"{name}: largest error {err.max().item():.3g} x (1 + max|z|) > {tol}, rows {err.tolist()}"
            )
    if abs(entropy[5].item() - math.log(VOCAB)) > 1e-5:
        raise AssertionError(f"a uniform row's entropy {entropy[5].item()} != log V {math.log(VOCAB)}")


def check_backward(dtype: torch.dtype, temperature: float) -> None:
    from verity.engines.triton_head import triton_head_backward, triton_head_forward

    x, labels = hard_rows()
    logits = x.to(dtype)
    _, _, lse = triton_head_forward(logits, labels, temperature)
    g = torch.linspace(-2.0, 2.0, 10)
    grad = triton_head_backward(logits, labels, lse, g, temperature)
    if grad.dtype != dtype or grad.shape != logits.shape:
        raise AssertionError(
            f"gradient: expected {dtype} {tuple(logits.shape)}, got {grad.dtype} {tuple(grad.shape)}"
        )
    _, _, ref_lse = reference(logits, labels, temperature)
    want = reference_grad(logits, labels, ref_lse, g, temperature)
    # bf16: within one of its steps; float32: z - lse is rounded at the scale of the row's largest |z|
    finite = logits.double().masked_fill(~torch.isfinite(logits.double()), 0.0)
    rel = (
        2.0**-7
        if dtype == torch.bfloat16
        else 4e-7 * (1.0 + finite.abs().amax(-1, keepdim=True) / temperature)
    )
    err = (grad.double() - want).abs() - rel * want.abs() - 1e-7
    if not torch.isfinite(grad).all() or err.max() > 0:
        raise AssertionError(f"gradient off by {err.max().item():.3g} beyond rtol {rel}")


def check_rows_independent() -> None:
    from verity.engines.triton_head import triton_head_forward

    x, labels = hard_rows()
    together = triton_head_forward(x.float(), labels, 1.0)
    alone = triton_head_forward(x[3:4].float(), labels[3:4], 1.0)
    for a, b in zip(together, alone, strict=True):
        if not torch.equal(a[3:4], b):
            raise AssertionError(f"row 3 alone {b.tolist()} != among others {a[3:4].tolist()}")


def check_bad_arguments() -> None:
    from verity.engines.triton_head import triton_head_forward

    x = torch.zeros(4, 64)
    cases = (
        (lambda: triton_head_forward(x.t(), torch.zeros(64, dtype=torch.long), 1.0), "unit column stride"),
        (lambda: triton_head_forward(x, torch.zeros(3, dtype=torch.long), 1.0), "labels [N]"),
        (
            lambda: triton_head_forward(x, torch.zeros(4, dtype=torch.long), 1.0, block=3000),
            "block must be a power of two",
        ),
    )
    for call, words in cases:
        try:
            call()
        except ValueError as err:
            if words not in str(err):
                raise AssertionError(f"expected {words!r} in {err}") from err
        else:
            raise AssertionError(f"no ValueError for a call that should say {words!r}")


def interpret_checks() -> dict[str, Callable[[], None]]:
    checks: dict[str, Callable[[], None]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for temperature in (1.0, 0.7):
            for block, warps in ((4096, 4), (2048, 8)):
                name = f"forward-{str(dtype)[6:]}-t{temperature}-b{block}w{warps}"
                checks[name] = lambda d=dtype, t=temperature, b=block, w=warps: check_forward(d, t, b, w)
            checks[f"backward-{str(dtype)[6:]}-t{temperature}"] = lambda d=dtype, t=temperature: (
                check_backward(d, t)
            )
    checks["rows-independent"] = check_rows_independent
    checks["bad-arguments"] = check_bad_arguments
    return checks


FORWARD_SIGNATURE = {
    "logits_ptr": "*bf16",
    "labels_ptr": "*i64",
    "logprobs_ptr": "*fp32",
    "entropy_ptr": "*fp32",
    "lse_ptr": "*fp32",
    "row_stride": "i64",
    "vocab": "i32",
    "scale": "fp32",
    "BLOCK": "constexpr",
}
BACKWARD_SIGNATURE = {
    "logits_ptr": "*bf16",
    "labels_ptr": "*i64",
    "lse_ptr": "*fp32",
    "grad_out_ptr": "*fp32",
    "grad_ptr": "*bf16",
    "row_stride": "i64",
    "vocab": "i32",
    "scale": "fp32",
    "inv_temperature": "fp32",
    "BLOCK": "constexpr",
}


def compile_kernel(kernel: object, signature: dict, block: int, warps: int, arch: int) -> object:
    """The kernel compiled for ``sm_<arch>``, pointers and sizes taken 16-aligned as at run time (151,936 = 16 x 9,496)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind[0] in "*i"}
    source = ASTSource(fn=kernel, signature=signature, constexprs={"BLOCK": block}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def loop_instructions(cubin: bytes) -> list[str]:
    """The SASS opcodes of the kernel's loop (from the target of its one backward branch to the branch)."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run(
            [str(cuobjdump), "-sass", str(path)], capture_output=True, text=True, check=True
        ).stdout
    code = [
        (int(m.group(1), 16), m.group(2).strip())
        for line in sass.splitlines()
        if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", line))
    ]
    loops = [
        (int(t.group(1), 16), addr)
        for addr, text in code
        if "BRA" in text and (t := re.search(r"0x([0-9a-f]+)", text)) and int(t.group(1), 16) < addr
    ]
    if len(loops) != 1:
        raise AssertionError(f"expected one loop in the forward kernel, found {len(loops)}")
    first, last = loops[0]
    return [text.split()[1 if text.startswith("@") else 0] for addr, text in code if first <= addr <= last]


def compile_checks(isa: dict) -> dict[str, Callable[[], None]]:
    from verity.engines import triton_head as th

    def forward(arch: int) -> None:
        per_thread = th.FORWARD_BLOCK // (32 * th.FORWARD_WARPS)
        kernel = compile_kernel(
            th._forward_kernel, FORWARD_SIGNATURE, th.FORWARD_BLOCK, th.FORWARD_WARPS, arch
        )
        ops = loop_instructions(kernel.asm["cubin"])
        exps = sum(op.startswith("MUFU.EX2") for op in ops)
        isa[f"forward_sm{arch}"] = {
            "logits_per_thread_per_step": per_thread,
            "loop_instructions": len(ops),
            "instructions_per_logit": round(len(ops) / per_thread, 2),
            "ex2_per_logit": round(exps / per_thread, 3),
            "wide_loads": sum(op.startswith("LDG") and ".128" in op for op in ops),
        }
        # one exp2 per logit and one per step for the rescale; the kernel before 2026-11-27 had two per logit
        if exps > per_thread + 1:
            raise AssertionError(f"{exps} MUFU.EX2 in a loop step of {per_thread} logits a thread")
        if len(ops) > 16 * per_thread:
            raise AssertionError(
                f"{len(ops)} instructions a loop step, {len(ops) / per_thread:.1f} a logit (> 16)"
            )

    def backward(arch: int) -> None:
        kernel = compile_kernel(
            th._backward_kernel, BACKWARD_SIGNATURE, th.BACKWARD_BLOCK, th.BACKWARD_WARPS, arch
        )
        if not kernel.asm["cubin"]:
            raise AssertionError("no cubin")

    return {
        "compile-forward-sm90": lambda: forward(90),
        "compile-forward-sm80": lambda: forward(80),
        "compile-backward-sm90": lambda: backward(90),
        "compile-backward-sm80": lambda: backward(80),
    }


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    isa: dict = {}
    checks = interpret_checks() if mode == "interpret" else compile_checks(isa)
    results: dict[str, object] = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception as err:  # every check reported, not only the first failure
            results[name] = f"FAIL: {type(err).__name__}: {err}\n{traceback.format_exc()}"
    results["isa"] = isa
    out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
