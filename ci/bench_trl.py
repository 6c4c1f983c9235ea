"""verity's GRPO step beside TRL's ``GRPOTrainer`` on the same work, in one run.

    python -m ci.bench_trl [--out outputs/bench/bench_trl.json] [--shapes quickstart,512x8]
                           [--steps-quickstart 40] [--steps-512x8 10] [--rounds 1] [--trl-threads 2]
                           [--verity-layouts 1x2] [--trl-micro-batches 32] [--verity-all-rows] [--bf16]

Needs TRL (``pip install -c constraints.txt -e 'packages/verity[bench-trl]'``; ``nox -s bench``
and ``nox -s nightly`` install it). Two shapes, each trained by both frameworks from the same
model folder, on the same prompts rendered by the same chat template, with the same batch
(32 prompts x 8 samples), learning rate (3e-5, constant, AdamW, grad clip 1.0), no KL and one
optimizer step per step, rewarded by the same exact-match verifier of the arithmetic task:

| shape | model | new tokens | figures |
|---|---|---|---|
| ``quickstart`` | the embedded default (warm-started tiny Qwen2, character tokenizer) | 8 | s/step, held-out greedy accuracy before -> after |
| ``512x8`` | a random-init Qwen2, hidden 512 x 8 layers, same tokenizer | 64 | s/step |

verity runs through its public API (:func:`verity.config.load_config` with the quickstart
preset, then :func:`verity.launch.run.run_training`: 2 Ray workers, one torch thread each);
its s/step is the median of ``timing/step_s`` in ``metrics.jsonl`` over every step after the
first. TRL runs ``GRPOTrainer`` on 2 torch threads (gradient checkpointing off, float32, no
vLLM); its s/step is the median, over every step after the first, of the time between a
callback's ``on_step_begin`` and ``on_step_end`` (generation, reward, loss and optimizer step).
``--verity-layouts 1x2`` adds verity runs in other worker layouts (``WxT``: ``W`` Ray
workers with ``T`` torch threads each) beside the preset, with their own ratio
(``grpo_step_vs_trl_<shape>_verity_<layout>``, in the JSON, not compared by the nightly).
``--trl-micro-batches 32`` adds TRL runs that train the same 256 rows in 32-row
forward/backward passes (``per_device_train_batch_size=32``, ``gradient_accumulation_steps=8``:
still one generation of the whole batch and one optimizer step per step), as a TRL user
would to bound activation memory; each gets ``grpo_step_vs_trl_mb<N>_<shape>`` = its s/step
over verity's preset (JSON only, not compared by the nightly).
``--verity-all-rows`` adds a verity run with ``actor.skip_zero_advantage=off`` (forward +
backward over every row, as TRL does, instead of leaving out rows whose advantage is
exactly 0): side ``verity-all-rows``, ratio ``grpo_step_vs_trl_<shape>_verity_all_rows``.
Every verity side records ``skipped_row_fraction``, the mean share of rows its updates left out.
``--bf16`` adds the same comparison in bfloat16: side ``trl-bf16`` is ``GRPOTrainer`` with
``bf16=True`` (TRL's own default: float32 weights, bf16 autocast), side ``verity-bf16`` the preset
with ``bench_trl_sides.VERITY_BF16_OVERRIDES``: ``actor.fsdp2.mixed_precision=true`` (float32 weights, gradients
and AdamW state, bf16 autocast), ``rollout.dtype=bfloat16`` (the rollout serves a bf16 copy) and
``actor.fsdp2.attn_implementation=eager`` (the trainer's attention kernel; the rollout keeps
sdpa), plus ``verity-bf16-all-rows`` with ``--verity-all-rows``; ``--trl-eager`` adds
``trl-bf16-eager``, TRL's model loaded with eager attention (TRL generates and trains with one
model, so it takes one kernel for both); with ``--trl-micro-batches N`` a ``trl-bf16-mbN`` side
joins each ``trl-mbN``. Their ratios are taken against each other
only: ``grpo_step_vs_trl_bf16_<shape>`` = ``trl-bf16`` s/step / ``verity-bf16`` s/step. bf16
pays off on CPUs that multiply it in hardware (AMX, AVX-512 BF16); the JSON records whether this
one does (``settings.cpu_native_bf16``).
Each side runs in its own process; with ``--rounds R`` the sides alternate (TRL, verity, verity,
TRL, ...) and each side's figure is the median over its rounds; ``ratio_rounds`` keeps each
ratio's per-round values (round r of one side over round r of the other), whose spread the
nightly's gate reads (``ci/nightly_gates.py``). Held-out accuracy of both is
scored by :func:`verity.evaluation.greedy.evaluate` rules (greedy, the task's verifier), on the
whole test split.

The ratio reported per shape is ``trl_s_per_step / verity_s_per_step`` (> 1: verity is
faster); the nightly compares it with ``ci/baseline.json`` as ``bench.grpo_step_vs_trl_<shape>``.
Absolute seconds on a shared machine swing with its load (recorded in the JSON); the ratio,
taken from runs made one after the other in the same invocation, is the figure to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ci.bench_trl_report import (  # noqa: F401 (also this module's names: the tests and the nightly use them)
    ALL_ROWS_SIDE,
    BF16_ALL_ROWS_SIDE,
    BF16_SIDES,
    COMPILED,
    SIDES,
    TRL_BF16_EAGER_SIDE,
    build_result,
    check_sides,
    format_table,
    is_bf16_side,
    layout_side,
    parse_layout,
    ratio_name,
    reference_sides,
    side_figure,
    steady_median,
    trl_side_name,
)

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    """One benchmarked workload: the model, the response length, the default step count."""

    name: str
    response_len: int  # new tokens per sample (max_response_length / max_completion_length)
    steps: int  # default RL steps per side
    model: dict[str, int] | None = None  # build_tiny_qwen2_for sizes; None: the embedded default
    held_out: bool = True  # measure held-out greedy accuracy before and after
    prompts: int = 32  # prompts per step
    samples: int = 8  # samples per prompt
    lr: float = 3e-5


SHAPES: dict[str, Shape] = {
    "quickstart": Shape("quickstart", response_len=8, steps=40),
    "512x8": Shape(
        "512x8",
        response_len=64,
        steps=10,
        model={"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "intermediate": 1536},
        held_out=False,
    ),
}


# --------------------------------------------------------------------------------------------
# the two sides (each in its own process: ``--side``)


@dataclass
class SideJob:
    """What one child process runs: a side, a shape, a step count, where to work and write."""

    side: str
    shape: str
    steps: int
    workdir: str
    model_dir: str
    train_file: str
    test_file: str
    seed: int = 0
    trl_threads: int = 2  # torch threads of the TRL process
    response_len: int | None = None  # new tokens per sample; None: the shape's own
    layout: str | None = None  # verity only: "WxT" workers x threads; None: the preset's
    trl_micro_batch: int | None = None  # TRL only: rows per forward/backward pass; None: the whole batch
    all_rows: bool = False  # verity only: actor.skip_zero_advantage=off
    bf16: bool = False  # TRL: bf16=True; verity: bench_trl_sides.VERITY_BF16_OVERRIDES
    compile: bool = False  # TRL: torch_compile=True (the whole model); verity: actor.fsdp2.compile=true
    attn_implementation: str | None = (
        None  # TRL only: the model's attention kernel; None: transformers' default
    )


def prepare_inputs(shape: Shape, workdir: Path, cache_dir: str) -> dict[str, str]:
    """The model folder and data files of ``shape`` (the embedded default's data for both shapes).

    First, ValueError when TRL is not installed (every run has a TRL side; named before any
    model is built or side runs, with the install command).
    """
    from verity.optional_packages import missing_package_sentence
    from verity_toyworld.build import ensure_embedded_default

    sentence = missing_package_sentence("the TRL side", "trl")
    if sentence is not None:
        raise ValueError(sentence)

    paths = ensure_embedded_default(Path(cache_dir).expanduser(), log=None)
    model_dir = str(paths.model_dir)
    if shape.model is not None:
        from verity_toyworld.char_tokenizer import CharTokenizer
        from verity_toyworld.tiny_model import build_tiny_qwen2_for

        folder = workdir / f"model_{shape.name}"
        if not (folder / "config.json").is_file():
            tokenizer = CharTokenizer()
            model = build_tiny_qwen2_for(tokenizer, seed=0, max_pos=256, **shape.model)
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        model_dir = str(folder)
    return {"model_dir": model_dir, "train_file": str(paths.train_file), "test_file": str(paths.test_file)}


def run_side_process(job: SideJob, out_file: Path) -> dict[str, Any]:
    """Run one side in a child ``python -m ci.bench_trl --side-job FILE``; its result document."""
    job_file = out_file.with_suffix(".job.json")
    job_file.write_text(json.dumps(asdict(job)))
    out_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "ci.bench_trl",
        "--side-job",
        str(job_file),
        "--side-out",
        str(out_file),
    ]
    notes = [
        f"{job.layout} workers x threads" if job.layout else "",
        "bf16" if job.bf16 else "",
        f"{job.trl_micro_batch}-row passes" if job.trl_micro_batch else "",
        "every row trained" if job.all_rows else "",
        f"{job.attn_implementation} attention" if job.attn_implementation else "",
        "torch.compile" if job.compile else "",
    ]
    layout = f" ({', '.join(n for n in notes if n)})" if any(notes) else ""
    print(f"--- {job.shape}: {job.side}{layout}, {job.steps} steps", flush=True)
    load_before = os.getloadavg()
    code = subprocess.call(cmd, cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "0"})
    if code != 0 or not out_file.is_file():
        raise RuntimeError(f"{job.side} on {job.shape} exited {code} (command: {' '.join(cmd)})")
    return {**json.loads(out_file.read_text()), "load_average": [load_before, os.getloadavg()]}


def run_bench(
    shapes: Sequence[str],
    steps: Mapping[str, int],
    rounds: int,
    workdir: Path,
    cache_dir: str,
    trl_threads: int = 2,
    response_lens: Mapping[str, int] | None = None,
    verity_layouts: Sequence[str] = (),
    trl_micro_batches: Sequence[int] = (),
    all_rows: bool = False,
    bf16: bool = False,
    trl_eager: bool = False,
    compile_sides: bool = False,
    only_sides: Sequence[str] = (),
) -> dict[str, Any]:
    """Every shape, both sides alternating over ``rounds``; the :func:`build_result` document.

    ``trl_threads``: torch threads of the TRL process (verity's workers take
    ``trainer.cpus_per_worker`` each, 1 in the preset). ``response_lens``: new tokens per
    sample for some shapes instead of their own. ``verity_layouts``: extra verity sides
    (``"WxT"``), each run in every round beside the preset. ``trl_micro_batches``: extra
    TRL sides training in passes of that many rows (each must divide every shape's batch).
    ``all_rows``: an extra verity side with ``actor.skip_zero_advantage=off``. ``bf16``: the
    ``trl-bf16`` / ``verity-bf16`` pair (and ``verity-bf16-all-rows`` with ``all_rows``);
    ``trl_eager`` (with ``bf16``): ``trl-bf16-eager`` too. ``compile_sides`` (with ``bf16``):
    ``trl-bf16-compiled`` (``torch_compile=True``) and a ``-compiled`` twin of each verity bf16 side.
    ``only_sides``: run just these of the sides the other arguments plan (each side still needs
    its counterpart, see :func:`build_result`); a name not planned is refused before anything runs.
    """
    if trl_eager and not bf16:
        raise ValueError("trl_eager adds a bf16 TRL side: it needs bf16=True")
    if compile_sides and not bf16:
        raise ValueError("compile_sides adds compiled bf16 sides: it needs bf16=True")
    response_lens = dict(response_lens or {})
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        raise ValueError(f"shapes: unknown {unknown}; expected names from {sorted(SHAPES)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if trl_threads < 1:
        raise ValueError(f"trl_threads must be >= 1, got {trl_threads}")
    layouts = {layout_side(layout): "{}x{}".format(*parse_layout(layout)) for layout in verity_layouts}
    for micro in trl_micro_batches:
        for name in shapes:
            rows = SHAPES[name].prompts * SHAPES[name].samples
            if micro < 1 or rows % micro or micro % SHAPES[name].samples:
                raise ValueError(
                    f"trl micro-batch {micro}: expected a multiple of the {SHAPES[name].samples} samples per "
                    f"prompt that divides the {rows} rows of shape {name!r}"
                )
    trl_sides = {
        trl_side_name(micro, half): micro
        for half in ((False, True) if bf16 else (False,))
        for micro in trl_micro_batches
    }
    bf16_sides = (
        (
            *BF16_SIDES,
            *((BF16_ALL_ROWS_SIDE,) if all_rows else ()),
            *((TRL_BF16_EAGER_SIDE,) if trl_eager else ()),
        )
        if bf16
        else ()
    )
    if compile_sides:  # a compiled twin of every bf16 side but the eager-attention TRL one
        bf16_sides += tuple(s + COMPILED for s in bf16_sides if s in (*BF16_SIDES, BF16_ALL_ROWS_SIDE))
        trl_sides.update({trl_side_name(micro, True) + COMPILED: micro for micro in trl_micro_batches})
    all_sides = (*SIDES, *layouts, *((ALL_ROWS_SIDE,) if all_rows else ()), *bf16_sides, *trl_sides)
    if only_sides:
        unplanned = sorted(set(only_sides) - set(all_sides))
        if unplanned:
            raise ValueError(
                f"sides {unplanned} are not planned by these options; planned: {list(all_sides)}"
            )
        all_sides = tuple(s for s in all_sides if s in only_sides)
    for name, count in steps.items():
        if count < 2:
            raise ValueError(f"steps for {name}: expected >= 2 (the first step is not counted), got {count}")
    check_sides(shapes, all_sides)
    started, load_before = time.perf_counter(), os.getloadavg()
    runs: dict[str, dict[str, list]] = {}
    for name in shapes:
        shape = SHAPES[name]
        inputs = prepare_inputs(shape, workdir, cache_dir)
        runs[name] = {side: [] for side in all_sides}
        for r in range(rounds):
            order = all_sides if r % 2 == 0 else all_sides[::-1]
            for side in order:
                job = SideJob(
                    "trl" if side.startswith("trl") else "verity",
                    name,
                    steps.get(name, shape.steps),
                    str(workdir / f"{name}-{side}-{r}"),
                    **inputs,
                    trl_threads=trl_threads,
                    response_len=response_lens.get(name),
                    layout=layouts.get(side),
                    trl_micro_batch=trl_sides.get(side),
                    all_rows=side.removesuffix(COMPILED) in (ALL_ROWS_SIDE, BF16_ALL_ROWS_SIDE),
                    bf16=is_bf16_side(side),
                    attn_implementation="eager" if side == TRL_BF16_EAGER_SIDE else None,
                    compile=side.endswith(COMPILED),
                )
                runs[name][side].append(run_side_process(job, workdir / f"{name}-{side}-{r}.json"))
    settings = {
        "shapes": {
            name: asdict(_with_response_len(SHAPES[name], response_lens.get(name))) for name in shapes
        },
        "steps": {name: steps.get(name, SHAPES[name].steps) for name in shapes},
        "rounds": rounds,
        "trl_threads": trl_threads,
        "verity_layouts": list(layouts.values()),
        "trl_micro_batches": list(trl_micro_batches),
        "verity_all_rows": all_rows,
        "bf16": bf16,
        "trl_eager": trl_eager,
        "compile": compile_sides,
        "sides": list(all_sides),
        "verity_bf16_overrides": _verity_bf16_overrides() if bf16 else [],
        "cpu_native_bf16": _cpu_native_bf16(),
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        **_versions(),
    }
    return build_result(runs, settings)


def _with_response_len(shape: Shape, response_len: int | None) -> Shape:
    return shape if response_len is None else replace(shape, response_len=response_len)


def _verity_bf16_overrides() -> list[str]:
    from ci.bench_trl_sides import VERITY_BF16_OVERRIDES

    return list(VERITY_BF16_OVERRIDES)


def _cpu_native_bf16() -> bool:
    from verity.hardware import cpu_has_native_bf16

    return cpu_has_native_bf16()


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for dist in ("torch", "transformers", "trl", "accelerate", "verity"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "bench_trl.json")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    for name, shape in SHAPES.items():
        parser.add_argument(f"--steps-{name}", type=int, default=shape.steps, dest=f"steps_{name}")
        parser.add_argument(
            f"--new-tokens-{name}",
            type=int,
            dest=f"new_tokens_{name}",
            help=f"new tokens per sample (default {shape.response_len})",
        )
    parser.add_argument("--rounds", type=int, default=1, help="runs per side, alternating (median over them)")
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    parser.add_argument(
        "--verity-layouts",
        default="",
        help="comma-separated extra verity runs, WORKERSxTHREADS each (e.g. 1x2), beside the preset",
    )
    parser.add_argument(
        "--trl-micro-batches",
        default="",
        help="comma-separated extra TRL runs training in passes of N rows each (e.g. 32), beside the default",
    )
    parser.add_argument(
        "--verity-all-rows",
        action="store_true",
        help="add a verity run training every row (actor.skip_zero_advantage=off) beside the preset",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="add TRL with bf16=True and verity with bf16 mixed precision and a bf16 rollout, compared pairwise",
    )
    parser.add_argument(
        "--trl-eager",
        action="store_true",
        help="with --bf16: add TRL with bf16=True on eager attention (compared with verity's bf16 side)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --bf16: add TRL with torch_compile=True and verity with actor.fsdp2.compile=true (bf16 sides)",
    )
    parser.add_argument(
        "--sides",
        default="",
        help="comma-separated: run only these of the sides the other options add (e.g. trl-bf16,verity-bf16-all-rows)",
    )
    parser.add_argument(
        "--cache-dir", default="~/.cache/verity/embedded", help="the embedded default's cache"
    )
    parser.add_argument("--workdir", type=Path, help="default: a temporary folder, removed afterwards")
    parser.add_argument("--side-job", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--side-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side_job is not None:
        from ci.bench_trl_sides import run_side

        job = SideJob(**json.loads(args.side_job.read_text()))
        args.side_out.write_text(
            json.dumps(run_side(job, _with_response_len(SHAPES[job.shape], job.response_len)), indent=1)
            + "\n"
        )
        return 0
    shapes = [s for s in args.shapes.split(",") if s]
    steps = {name: getattr(args, f"steps_{name}") for name in shapes if name in SHAPES}
    with tempfile.TemporaryDirectory(prefix="verity-bench-trl-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        lens = {n: getattr(args, f"new_tokens_{n}") for n in shapes if getattr(args, f"new_tokens_{n}", None)}
        layouts = [x for x in args.verity_layouts.split(",") if x]
        micros = [int(x) for x in args.trl_micro_batches.split(",") if x]
        try:
            result = run_bench(
                shapes,
                steps,
                args.rounds,
                workdir,
                args.cache_dir,
                args.trl_threads,
                lens,
                layouts,
                micros,
                all_rows=args.verity_all_rows,
                bf16=args.bf16,
                trl_eager=args.trl_eager,
                compile_sides=args.compile,
                only_sides=[x for x in args.sides.split(",") if x],
            )
        except ValueError as err:  # bad arguments or a missing package (TRL), named before any side runs
            print(f"ci/bench_trl.py: {err}", file=sys.stderr)
            return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    st = result["settings"]
    print(
        f"load average {st['load_average_before'][0]:.1f} before, {st['load_average_after'][0]:.1f} after, "
        f"{st['cpus']} CPUs; {st['seconds']:.0f} s; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
