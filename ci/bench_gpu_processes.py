"""``python -m ci.bench_gpu --process-per-side``: each side in a fresh process, their figures merged.

Sides that share a process share its device memory: a CUDA-graph side keeps its graphs'
private pool (27.7 GiB at 64-row micro-batches on an H200) and the caching allocator keeps
what it reserved, so on 2026-11-27 the stacked-projection side ran out of memory after the
plain CUDA-graph side that had fit alone (99 GiB of 140). Running each side as its own
``python -m ci.bench_gpu ... --sides NAME`` gives every side the whole device; the
parent never touches the device and writes one JSON in the usual layout, its ratios
computed from the children's medians as if they had shared a process.

The matmul rate each child measured at its start is kept per side; MFU against the
measured matmul uses their median, so the sides are divided by the same number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FLAG = "--process-per-side"


def child_argv(argv: Sequence[str], side: str, out: Path) -> list[str]:
    """``argv`` without ``--process-per-side``, then ``--sides side --out out`` (argparse: the last one wins)."""
    return [a for a in argv if a != FLAG] + ["--sides", side, "--out", str(out)]


def side_from_child(side: str, returncode: int, out: Path) -> tuple[dict, dict | None]:
    """The side's figures and the child's whole result (None when it wrote none).

    A child that died before writing its result (killed, out of host memory, a crash in
    the driver) leaves the side an ``error`` naming its exit code.
    """
    if out.is_file():
        child = json.loads(out.read_text())
        if side in child.get("sides", {}):
            return child["sides"][side], child
    return {"error": f"the side's process exited with {returncode} before writing its result ({out})"}, None


def run_each_side_apart(
    args: argparse.Namespace,
    argv: Sequence[str],
    module: str,
    summarise: Callable[[argparse.Namespace, dict[str, dict], float | None, float | None], dict],
) -> dict:
    """Every side of ``args.sides`` as ``python -m module <argv> --sides side``, one after another.

    ``argv``: the parent's command line (the children get it less ``--process-per-side``).
    ``summarise``: bench_gpu's, called on the merged sides. Returns the merged result, also
    written to ``args.out`` after each side (a call cut short keeps the sides that ran).
    """
    result: dict[str, Any] = {
        "environment": None,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
        "datasheet_peak_flops": None,
        "measured_matmul_flops": None,
        "measured_matmul_flops_per_side": {},
        "sides": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench_gpu_sides_") as scratch:
        for name in args.sides:
            out = Path(scratch) / f"{name}.json"
            print(f"[bench_gpu] {name} in its own process ...", flush=True)
            done = subprocess.run([sys.executable, "-m", module, *child_argv(argv, name, out)], check=False)
            side, child = side_from_child(name, done.returncode, out)
            if child is not None:
                side["pid"] = child["environment"].get("pid")
                if result["environment"] is None:
                    result["environment"] = child["environment"]
                    result["datasheet_peak_flops"] = child["datasheet_peak_flops"]
                result["measured_matmul_flops_per_side"][name] = child["measured_matmul_flops"]
            result["sides"][name] = side
            rates = [r for r in result["measured_matmul_flops_per_side"].values() if r is not None]
            result["measured_matmul_flops"] = statistics.median(rates) if rates else None
            result["summary"] = summarise(
                args, result["sides"], result["datasheet_peak_flops"], result["measured_matmul_flops"]
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result
