"""How the controller's (driver's) cost per GRPO step grows with the number of actor workers.

    python -m ci.bench_scaling [--workers 1,2,4,8] [--nodes 1,2] [--steps 6] [--warmup 2]
                               [--cpus 2] [--json outputs/bench/bench_scaling.json]

A benchmark, not a test: it prints a table and, with ``--json``, writes the figures with the
machine they were measured on. Each configuration is a real run of the embedded tiny model
(``model.path=embedded``, built or reused under ``~/.cache/verity/embedded``) through
:func:`verity.launch.run.run_training`, in its own process and its own output folder:
GRPO, 32 prompts x 8 samples per step (256 rows: whole prompt groups on each of 1, 2, 4 or 8
workers), one optimizer step per step (``actor.ppo_mini_batch_size=32``), no evaluation
before training, no checkpoint, 8 held-out prompts in the evaluation after the last step
(outside every measured step).

Configurations: ``W`` actor workers for each ``W`` of ``--workers`` on each node count ``K``
of ``--nodes`` that divides it. ``K = 1`` is a private local Ray cluster; ``K > 1`` is a
simulated cluster of ``K`` Ray nodes on this machine (``verity_harness.simulated_cluster``:
the same worker CPU priority as a private cluster, torn down after the run) joined with
``trainer.ray_address=<its address> trainer.nnodes=K trainer.n_workers_per_node=W/K``.
Every worker gets ``--cpus / W`` CPUs (``trainer.cpus_per_worker``; one torch thread below 1),
so each configuration uses the same CPU budget; 8 workers on 2 cores share them with the
driver, which is part of what is measured.

Per step, after the first ``--warmup`` steps (medians over the steps left):

- **step s**: ``timing/step_s`` from ``<output_dir>/metrics.jsonl`` (the sum of the stages' wall
  times, :class:`verity.trainer.loop.StageTimer`).
- **driver overhead** (ms/step): the wall time of :meth:`verity.trainer.loop.RLTrainer.step`
  (every stage plus the loop's per-step metrics) minus the time the driver's main thread spent
  blocked in ``ray.wait`` inside it. verity logs no such figure, so this script measures it: in
  the run's process it wraps ``RLTrainer.step`` (to open and close the window) and ``ray.wait``
  (summing its wall time on the main thread inside the window). Every worker call of a step is
  collected by :meth:`verity.controller.worker_group.WorkerGroup._gather`, which blocks in
  ``ray.wait`` until the next rank's answer is ready (and, by Ray's default ``fetch_local``, in
  the driver's object store). What is left is the driver's own work: planning and splitting
  calls, ``ray.put``, submitting the remote
  calls, fetching and unpickling answers (``ray.get`` after ``ray.wait``), unpacking and
  concatenating them, the driver-side stages (reward bookkeeping, advantages) and the step's
  metrics. It is the driver's busy time, including what it does while other ranks still
  compute (unpacking the first answers of a call), not only what it adds to the step's
  critical path; on a machine whose cores the workers fill, it also includes the driver's
  waits for a core. Not in it: loading the next prompt batch and logging the metrics
  (MLflow), which happen outside ``RLTrainer.step`` and do not depend on the number of
  workers. With several nodes, moving an answer from another node into the driver's store
  counts as waiting.
- **ms per worker per step**: driver overhead / workers.
- **driver KB/step**: ``perf/driver_bytes_sent + perf/driver_bytes_received`` / 1024
  (:mod:`verity.batch.transport`'s meter: what the step's group calls moved through the driver).
- **weight sync ms**: ``timing/weight_sync_s`` (actor -> rollout weights, timed on the workers
  inside ``update_actor``).

The goal (issue "Scale-out"), checked per row: the driver overhead stays under
``--max-ms-per-worker`` (10) ms per worker per step, and grows no faster than linearly in the
workers: its ms per worker is at most ``1 + --tolerance`` (1.2) times that of the row with the
fewest workers on the same number of nodes (the reference row of its group). A row prints
PASS or FAIL with the rule it broke. The exit status is 0 unless ``--fail-on-goal`` is given
and a row fails.

Absolute figures swing with the machine's load (recorded in the JSON): run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = 32  # data.train_batch_size
SAMPLES = 8  # rollout.n
MAX_MS_PER_WORKER = 10.0
TOLERANCE = 0.2
RULE = (
    "goal: driver overhead < {max_ms:g} ms per worker per step, and its ms per worker at most "
    "{factor:g} x that of the fewest-workers row on the same nodes (no faster than linear growth)"
)


# ---------------------------------------------------------------- arguments and configurations


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: distinct positive integers, in the order given."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 1, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int_list, default=[1, 2, 4, 8], help="actor workers, e.g. 1,2,4,8")
    parser.add_argument(
        "--nodes", type=int_list, default=[1, 2], help="Ray nodes (>1: simulated on this machine), e.g. 1,2"
    )
    parser.add_argument("--steps", type=int, default=6, help="RL steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--cpus", type=float, default=2.0, help="CPUs shared by each configuration's workers")
    parser.add_argument("--json", type=Path, help="write the figures and the machine here")
    parser.add_argument("--max-ms-per-worker", type=float, default=MAX_MS_PER_WORKER)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help="allowed growth of ms per worker over the reference row",
    )
    parser.add_argument("--fail-on-goal", action="store_true", help="exit 1 when a row fails the goal")
    parser.add_argument(
        "--workdir", type=Path, help="keep the runs' folders here (default: a temporary folder)"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # WORKERSxNODES: run one configuration (child)
    parser.add_argument("--one-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(
            f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): no step would be measured"
        )
    if args.warmup < 0 or args.cpus <= 0 or args.max_ms_per_worker <= 0 or args.tolerance < 0:
        parser.error("--warmup and --tolerance must be >= 0, --cpus and --max-ms-per-worker > 0")
    if not configurations(args.workers, args.nodes):
        parser.error(
            f"no configuration: no node count of {args.nodes} divides a worker count of {args.workers}"
        )
    return args


def configurations(workers: Sequence[int], nodes: Sequence[int]) -> list[tuple[int, int]]:
    """``(workers, nodes)`` pairs to run: each node count with each worker count it divides.

    Ordered by nodes, then workers; a worker count that does not split ``PROMPTS`` prompts into
    whole groups per worker is refused.
    """
    for w in workers:
        if PROMPTS % w:
            raise ValueError(
                f"{w} workers: {PROMPTS} prompts x {SAMPLES} samples do not divide into whole groups"
            )
    return [(w, k) for k in sorted(nodes) for w in sorted(workers) if w >= k and w % k == 0]


def cpus_per_worker(workers: int, cpus: float) -> float:
    """Each worker's share of ``cpus`` (rounded down to a thousandth, so the shares fit the budget)."""
    return int(cpus / workers * 1000) / 1000


def run_overrides(
    workers: int, nodes: int, steps: int, cpus: float, out_dir: Path, address: str | None
) -> list[str]:
    """The config overrides of one configuration (embedded model, the default GRPO)."""
    overrides = [
        "model.path=embedded",
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out_dir}",
        f"trainer.cpus_per_worker={cpus_per_worker(workers, cpus):g}",
        "trainer.val_before_train=false",
        "trainer.val_every=0",
        "trainer.progress=false",
        "trainer.resume=off",
        "trainer.checkpoint.save_final=false",
        "trainer.seed=0",
        f"data.train_batch_size={PROMPTS}",
        f"rollout.n={SAMPLES}",
        f"actor.ppo_mini_batch_size={PROMPTS}",
        "data.val_max_samples=8",
    ]
    if nodes == 1:
        return [*overrides, f"trainer.n_workers={workers}"]
    if address is None:
        raise ValueError(f"{nodes} nodes need a cluster address")
    return [
        *overrides,
        f"trainer.ray_address={address}",
        f"trainer.nnodes={nodes}",
        f"trainer.n_workers_per_node={workers // nodes}",
    ]


# ---------------------------------------------------------------- figures (pure)


def median_after_warmup(values: Sequence[float], warmup: int) -> float:
    """Median of ``values`` without the first ``warmup``; at least one must be left."""
    kept = list(values)[warmup:]
    if not kept:
        raise ValueError(f"{len(values)} step(s) with {warmup} warm-up step(s): nothing left to measure")
    return float(statistics.median(kept))


def summarise_run(run: Mapping[str, Any], warmup: int) -> dict[str, Any]:
    """One table row from a run's per-step figures (``run["steps"]``, in step order)."""
    steps = list(run["steps"])
    workers = int(run["workers"])

    def med(key: str) -> float:
        return median_after_warmup([float(s[key]) for s in steps], warmup)

    overhead = [float(s["window_s"]) - float(s["wait_s"]) for s in steps]
    overhead_ms = 1000 * median_after_warmup(overhead, warmup)
    window_s = med("window_s")
    return {
        "workers": workers,
        "nodes": int(run["nodes"]),
        "cpus_per_worker": run.get("cpus_per_worker"),
        "steps": len(steps),
        "measured_steps": len(steps) - warmup,
        "step_s": med("step_s"),
        "window_s": window_s,
        "wait_s": med("wait_s"),
        "driver_overhead_ms": overhead_ms,
        "ms_per_worker": overhead_ms / workers,
        "driver_share": overhead_ms / 1000 / window_s if window_s > 0 else None,
        "driver_kb": median_after_warmup(
            [(s["bytes_sent"] + s["bytes_received"]) / 1024 for s in steps], warmup
        ),
        "driver_kb_sent": med("bytes_sent") / 1024,
        "driver_kb_received": med("bytes_received") / 1024,
        "weight_sync_ms": 1000 * med("weight_sync_s"),
        "per_step": steps,
        "wall_s": run.get("wall_s"),
        "load_average": run.get("load_average"),
        "placement": run.get("placement"),
    }


def goal_check(
    rows: Sequence[dict[str, Any]], max_ms: float = MAX_MS_PER_WORKER, tolerance: float = TOLERANCE
) -> bool:
    """Judge every row against the goal (see the module docstring); sets ``goal``, ``goal_reasons`` and
    ``reference_workers`` on each. True when every row passes."""
    fewest: dict[int, dict[str, Any]] = {}
    for row in rows:
        ref = fewest.get(row["nodes"])
        if ref is None or row["workers"] < ref["workers"]:
            fewest[row["nodes"]] = row
    every = True
    for row in rows:
        ref = fewest[row["nodes"]]
        reasons = []
        if not row["ms_per_worker"] < max_ms:
            reasons.append(f"{row['ms_per_worker']:.2f} ms per worker >= {max_ms:g}")
        limit = ref["ms_per_worker"] * (1 + tolerance)
        if row is not ref and row["ms_per_worker"] > limit:
            reasons.append(
                f"faster than linear: {row['ms_per_worker']:.2f} ms per worker > {1 + tolerance:g} x "
                f"{ref['ms_per_worker']:.2f} at {ref['workers']} worker(s)"
            )
        row["reference_workers"] = ref["workers"]
        row["goal"] = "FAIL" if reasons else "PASS"
        row["goal_reasons"] = reasons
        every = every and not reasons
    return every


def format_table(
    rows: Sequence[Mapping[str, Any]], max_ms: float = MAX_MS_PER_WORKER, tolerance: float = TOLERANCE
) -> str:
    """The printed table: one line per configuration, its goal verdict, and the rule."""
    header = (
        "workers",
        "nodes",
        "step s",
        "driver ms/step",
        "ms/worker/step",
        "driver KB/step",
        "weight sync ms",
        "goal",
    )
    lines = [
        (
            str(r["workers"]),
            str(r["nodes"]),
            f"{r['step_s']:.3f}",
            f"{r['driver_overhead_ms']:.1f}",
            f"{r['ms_per_worker']:.2f}",
            f"{r['driver_kb']:.1f}",
            f"{r['weight_sync_ms']:.1f}",
            r.get("goal", "?") + (f" ({'; '.join(r['goal_reasons'])})" if r.get("goal_reasons") else ""),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths[:-1]) + "  {}"
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line) for line in lines]
    out.append(RULE.format(max_ms=max_ms, factor=1 + tolerance))
    return "\n".join(out)


# ---------------------------------------------------------------- machine


def git_commit() -> dict[str, Any]:
    """HEAD of this checkout and whether tracked files differ from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, timeout=30).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def machine_info() -> dict[str, Any]:
    """The CPU (verity.hardware), the platform, the versions, the commit."""
    from importlib import metadata

    import torch
    from verity.hardware import cpu_matmul_isa, make_backend

    versions = {}
    for dist in ("verity", "torch", "ray", "transformers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    versions["torch"] = torch.__version__
    return {
        "cpu_model": make_backend("cpu").device_name(),
        "cpu_isa": cpu_matmul_isa(),
        "logical_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        **git_commit(),
    }


# ---------------------------------------------------------------- one configuration (child process)


class DriverWaitProbe:
    """Per step: the wall time of ``RLTrainer.step`` and the main thread's time blocked in ``ray.wait``."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self._wait_s = 0.0
        self._waits = 0

    @contextmanager
    def installed(self) -> Iterator[DriverWaitProbe]:
        import ray
        from verity.trainer.loop import RLTrainer

        main = threading.main_thread().ident
        real_wait, real_step = ray.wait, RLTrainer.step
        probe = self

        @functools.wraps(real_wait)
        def timed_wait(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != main:
                return real_wait(*args, **kwargs)
            started = time.perf_counter()
            try:
                return real_wait(*args, **kwargs)
            finally:
                probe._wait_s += time.perf_counter() - started
                probe._waits += 1

        @functools.wraps(real_step)
        def timed_step(trainer: Any, step: int, prompts: Any) -> dict[str, float]:
            probe._wait_s, probe._waits = 0.0, 0
            started = time.perf_counter()
            metrics = real_step(trainer, step, prompts)
            window = time.perf_counter() - started
            probe.steps[step] = {"window_s": window, "wait_s": probe._wait_s, "waits": float(probe._waits)}
            return metrics

        ray.wait, RLTrainer.step = timed_wait, timed_step
        try:
            yield self
        finally:
            ray.wait, RLTrainer.step = real_wait, real_step


def run_one(workers: int, nodes: int, steps: int, cpus: float, out_dir: Path) -> dict[str, Any]:
    """Train one configuration in this process; its per-step figures."""
    from verity.config import load_config
    from verity.launch.run import run_training
    from verity_harness.simulated_cluster import SimulatedShape, simulated_cluster

    shape = None
    if nodes > 1:
        per_node = (workers // nodes) * cpus_per_worker(workers, cpus)
        shape = SimulatedShape(nodes=nodes, cpus_per_node=max(1, math.ceil(per_node - 1e-9)))
    probe = DriverWaitProbe()
    load_before = os.getloadavg()
    started = time.perf_counter()
    with simulated_cluster(shape) as address:
        cfg = load_config(run_overrides(workers, nodes, steps, cpus, out_dir, address))
        with probe.installed():
            summary = run_training(cfg)
    wall = time.perf_counter() - started
    ran = summary.get("ran") or {}
    if nodes > 1 and str(ran.get("nodes")) != str(nodes):
        raise RuntimeError(f"asked for {nodes} nodes, the run reports {ran.get('nodes')!r} ({ran})")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if "timing/step_s" in r), key=lambda r: r["train/step"])
    if len(rows) != steps or set(probe.steps) != {int(r["train/step"]) for r in rows}:
        raise RuntimeError(
            f"expected {steps} steps; metrics.jsonl has {len(rows)}, the probe saw {sorted(probe.steps)}"
        )
    per_step = [
        {
            "step": int(r["train/step"]),
            "step_s": float(r["timing/step_s"]),
            **probe.steps[int(r["train/step"])],
            "bytes_sent": float(r.get("perf/driver_bytes_sent", 0.0)),
            "bytes_received": float(r.get("perf/driver_bytes_received", 0.0)),
            "weight_sync_s": float(r.get("timing/weight_sync_s", 0.0)),
        }
        for r in rows
    ]
    return {
        "workers": workers,
        "nodes": nodes,
        "cpus_per_worker": cpus_per_worker(workers, cpus),
        "steps": per_step,
        "wall_s": wall,
        "load_average": [list(load_before), list(os.getloadavg())],
        "placement": ran.get("placement.actor"),
    }


def run_child(workers: int, nodes: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Run one configuration in a fresh ``python -m ci.bench_scaling --one WxK`` process."""
    out_file = folder / "figures.json"
    cmd = [
        sys.executable,
        "-m",
        "ci.bench_scaling",
        "--one",
        f"{workers}x{nodes}",
        "--one-out",
        str(out_file),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--cpus",
        f"{args.cpus:g}",
    ]
    print(f"--- {workers} worker(s) on {nodes} node(s), {args.steps} steps", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # never join someone's cluster
    code = subprocess.call(cmd, cwd=ROOT, env={**env, "PYTHONHASHSEED": "0"})
    if code != 0 or not out_file.is_file():
        raise RuntimeError(f"{workers} worker(s) on {nodes} node(s) exited {code} (command: {' '.join(cmd)})")
    return json.loads(out_file.read_text())


# ---------------------------------------------------------------- main


def build_result(
    runs: Sequence[Mapping[str, Any]], args: argparse.Namespace, machine: Mapping[str, Any]
) -> dict[str, Any]:
    """The JSON document: settings, machine, one row per configuration, the goal."""
    rows = [summarise_run(run, args.warmup) for run in runs]
    passed = goal_check(rows, args.max_ms_per_worker, args.tolerance)
    return {
        "settings": {
            "prompts": PROMPTS,
            "samples": SAMPLES,
            "steps": args.steps,
            "warmup": args.warmup,
            "cpus": args.cpus,
            "model": "embedded",
            "driver_overhead": "RLTrainer.step wall time minus the main thread's time blocked in ray.wait (ms/step)",
        },
        "machine": dict(machine),
        "rows": rows,
        "goal": {
            "rule": RULE.format(max_ms=args.max_ms_per_worker, factor=1 + args.tolerance),
            "max_ms_per_worker": args.max_ms_per_worker,
            "tolerance": args.tolerance,
            "passed": passed,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        workers, nodes = (int(n) for n in args.one.split("x"))
        out_dir = args.one_out.parent / "run"
        figures = run_one(workers, nodes, args.steps, args.cpus, out_dir)
        args.one_out.write_text(json.dumps(figures, indent=1) + "\n")
        return 0
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="verity-bench-scaling-") as tmp:
        workdir = args.workdir or Path(tmp)
        for workers, nodes in configurations(args.workers, args.nodes):
            folder = workdir / f"{workers}x{nodes}"
            folder.mkdir(parents=True, exist_ok=True)
            runs.append(run_child(workers, nodes, args, folder))
    result = build_result(runs, args, machine_info())
    result["settings"]["seconds"] = time.perf_counter() - started
    print()
    print(format_table(result["rows"], args.max_ms_per_worker, args.tolerance))
    m = result["machine"]
    print(
        f"machine: {m['cpu_model']} ({m['cpu_isa']}), {m['logical_cpus']} logical CPUs; commit {m['commit']}"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if args.fail_on_goal and not result["goal"]["passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
