"""Profiling for ``ci/bench_gpu.py``: one step's kernel table, its device idle time, its trace."""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["device_gaps", "maybe_profile", "sync"]


def sync(device: torch.device) -> None:
    """Wait for ``device`` (CUDA) to finish its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def maybe_profile(args: argparse.Namespace, name: str, step: Callable[[], Any]) -> None:
    """With ``--profile DIR``: one more ``step`` under the torch profiler.

    Writes its kernel table (``DIR/name.txt``) and, on CUDA, the device's idle time and
    longest gaps (``name.gaps.json``, :func:`device_gaps`) and the Chrome trace
    (``name.trace.json.gz``).
    """
    if args.profile is None:
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
        sync(torch.device(args.device))
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    args.profile.mkdir(parents=True, exist_ok=True)
    (args.profile / f"{name}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    if torch.cuda.is_available():
        gaps = device_gaps(
            [(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if _on_gpu(e)]
        )
        (args.profile / f"{name}.gaps.json").write_text(json.dumps(gaps, indent=1) + "\n")
        trace = args.profile / f"{name}.trace.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            dst.write(src.read())
        trace.unlink()


def _on_gpu(event: Any) -> bool:
    """Whether a profiler event is device work (a kernel or a copy), not a host op."""
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def device_gaps(kernels: list[tuple[float, float, str]], top: int = 15) -> dict:
    """How long the device sat idle between its first and last kernel, and the longest gaps.

    ``kernels``: ``(start us, end us, name)`` of the device's work. Returns ``span_ms``,
    ``busy_ms`` (the union of the kernels' intervals), ``idle_ms`` and the ``top`` gaps as
    ``(offset ms from the first kernel, gap ms, kernel before, kernel after)``.
    """
    if not kernels:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": []}
    kernels = sorted(kernels)
    first, busy, gaps = kernels[0][0], 0.0, []
    cur_start, cur_end, cur_name = kernels[0]
    for start, end, name in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append(((cur_end - first) / 1e3, (start - cur_end) / 1e3, cur_name, name))
            cur_start, cur_end, cur_name = start, end, name
        elif end > cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    span = cur_end - first
    gaps.sort(key=lambda g: -g[1])
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3, "gaps": gaps[:top]}
