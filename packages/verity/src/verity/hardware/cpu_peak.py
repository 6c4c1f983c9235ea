"""A CPU's matmul peak, measured: the denominator of CPU MFU.

CPUs have no spec-sheet peak in :mod:`verity.hardware.flops` (it depends on the
cores a run is given, their vector units and clocks), so the harness measures
one: dense float32 matmuls of ``size x size`` on the threads the actor's workers
use, timed until ``min_seconds`` have passed, the best of ``repeats`` rounds.
That is the achieved matmul rate of this machine at that moment — an upper
bound a training step can approach, not the silicon's theoretical peak — so a CPU
MFU reads "share of what this machine's matmuls reach".

FLOPs of one ``[n, n] @ [n, n]`` matmul: ``2 n^3`` (a multiply and an add per
term).

:func:`cpu_has_native_bf16` says whether the cores multiply bfloat16 in hardware
(Intel AMX or AVX-512 BF16); only then does bf16 mixed precision speed a CPU run up
(``ci/reports/2026-12-06-docstring-figures.md``). :func:`cpu_matmul_isa` names the
widest matrix instruction set a CPU has, so that results from two CPUs a virtual machine
names alike (``"Intel(R) Xeon(R) Processor"`` with and without AMX) stay apart.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of hardware bf16 multiplies
MATMUL_ISA_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
"""``/proc/cpuinfo`` flags from the widest matrix arithmetic down: bf16 tiles (AMX), AVX-512
with bf16 dot products, AVX-512, AVX2. The first one a CPU has is its :func:`cpu_matmul_isa`."""


def _cpu_flags(cpuinfo: str | Path) -> set[str] | None:
    """The first ``flags`` line of ``cpuinfo`` as a set; None where it cannot be read or has none."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (a ``NATIVE_BF16_FLAGS`` flag in ``cpuinfo``).

    False where the file cannot be read (not Linux): then nothing is known, and bf16 is
    not assumed to be fast.
    """
    flags = _cpu_flags(cpuinfo) or set()
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def cpu_matmul_isa(cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The widest matrix instruction set of this CPU: a flag of :data:`MATMUL_ISA_FLAGS`, e.g. ``"amx_bf16"``.

    None where ``cpuinfo`` cannot be read (not Linux) or names none of them.
    """
    flags = _cpu_flags(cpuinfo) or set()
    return next((flag for flag in MATMUL_ISA_FLAGS if flag in flags), None)


def measure_matmul_flops(
    threads: int,
    *,
    size: int = 512,
    min_seconds: float = 0.25,
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Best achieved FLOP/s of ``[size, size] @ [size, size]`` matmuls on ``threads`` CPU threads.

    Args:
        threads: torch intra-op threads to measure with (restored afterwards), >= 1.
        size: matrix side (elements).
        min_seconds: seconds each round runs at least.
        repeats: rounds; the fastest one is returned.
        dtype: element type (float32: what verity trains with on CPU).

    Returns:
        FLOP/s (``2 size^3`` per matmul), a float > 0.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if size < 1 or repeats < 1 or min_seconds <= 0:
        raise ValueError(
            f"size, repeats >= 1 and min_seconds > 0 expected, got {size}, {repeats}, {min_seconds}"
        )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator, dtype=dtype)
        b = torch.randn(size, size, generator=generator, dtype=dtype)
        out = torch.empty(size, size, dtype=dtype)
        torch.matmul(a, b, out=out)  # warm-up: thread pool and caches
        best = 0.0
        for _ in range(repeats):
            count, started = 0, time.perf_counter()
            while True:
                torch.matmul(a, b, out=out)
                count += 1
                elapsed = time.perf_counter() - started
                if elapsed >= min_seconds:
                    break
            best = max(best, 2.0 * size**3 * count / elapsed)
        return best
    finally:
        torch.set_num_threads(before)
