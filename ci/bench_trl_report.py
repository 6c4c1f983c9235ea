"""The side names and the result document of ``ci/bench_trl.py``: which side is compared with which, ratios, the table.

Pure functions over the sides' figures (no training here), so the bench's arithmetic is
tested on fake timings. A side's name says what it runs: ``trl`` / ``verity`` (float32, the
reference pair), ``trl-bf16`` / ``verity-bf16`` (the bf16 reference pair), and variants of
either (``trl-mb32``, ``verity-all-rows``, ``verity-1x2``, ``...-compiled``), each compared
with its precision's reference side of the other framework.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

SIDES = (
    "trl",
    "verity",
)  # the float32 reference pair; "verity-WxT", "verity-all-rows", "trl-mbN" are variants
ALL_ROWS_SIDE = "verity-all-rows"  # verity with actor.skip_zero_advantage=off
BF16_SIDES = ("trl-bf16", "verity-bf16")  # --bf16: the pair compared with each other
BF16_ALL_ROWS_SIDE = "verity-bf16-all-rows"  # --bf16 --verity-all-rows
TRL_BF16_EAGER_SIDE = "trl-bf16-eager"  # --bf16 --trl-eager: TRL's model on eager attention
COMPILED = "-compiled"  # --bf16 --compile: a compiled twin of each bf16 side (torch.compile, inductor)


def is_bf16_side(side: str) -> bool:
    """Whether ``side`` trains in bf16 (``trl-bf16``, ``verity-bf16``, ``verity-bf16-all-rows``)."""
    return "-bf16" in side


def reference_sides(side: str) -> tuple[str, str]:
    """``(trl side, verity side)`` that ``side`` is compared with: the pair of its own precision."""
    return BF16_SIDES if is_bf16_side(side) else SIDES


def parse_layout(text: str) -> tuple[int, int]:
    """``"WxT"`` -> ``(W workers, T torch threads per worker)``, both >= 1."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"verity layout {text!r}: expected WORKERSxTHREADS with both >= 1, e.g. '1x2'")
    return int(parts[0]), int(parts[1])


def layout_side(layout: str) -> str:
    """The side name of a verity layout run (``"verity-1x2"``)."""
    workers, threads = parse_layout(layout)
    return f"verity-{workers}x{threads}"


def ratio_name(shape: str, trl_side: str = "trl") -> str:
    """The key of a shape's ratio in ``ratios`` (the nightly's ``bench.<key>``); ``trl_side`` names a TRL variant."""
    variant = trl_side.removeprefix("trl").replace("-", "_")
    return f"grpo_step_vs_trl{variant}_{shape}"


def trl_side_name(micro_batch: int, bf16: bool = False) -> str:
    """The side name of a TRL run with ``micro_batch``-row passes (``"trl-mb32"``, ``"trl-bf16-mb32"``)."""
    return f"trl{'-bf16' if bf16 else ''}-mb{micro_batch}"


def steady_median(step_seconds: Sequence[float]) -> float:
    """Median seconds of the steps after the first (the first pays warm-up); needs >= 2 steps."""
    if len(step_seconds) < 2:
        raise ValueError(
            f"step_seconds: expected at least 2 steps (the first is dropped), got {len(step_seconds)}"
        )
    return statistics.median(step_seconds[1:])


def side_figure(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One side's figures over its rounds: median s/step of the runs' steady medians, accuracies of the first run.

    Each run: ``{"step_seconds": [...], "accuracy_before": float|None, "accuracy_after": float|None, ...}``.
    """
    if not runs:
        raise ValueError("runs: expected at least one run")
    per_run = [steady_median(run["step_seconds"]) for run in runs]
    first = runs[0]
    return {
        "s_per_step": statistics.median(per_run),
        "s_per_step_per_round": per_run,
        "step_seconds_per_round": [
            list(run["step_seconds"]) for run in runs
        ],  # step 1 (warm-up, compile) too
        "steps": len(first["step_seconds"]),
        "accuracy_before": first.get("accuracy_before"),
        "accuracy_after": first.get("accuracy_after"),
        "stage_seconds": first.get("stage_seconds", {}),
        "n_params": first.get("n_params"),
        "wall_seconds": [run.get("wall_seconds") for run in runs],
        "load_average": [run.get("load_average") for run in runs],  # (1, 5, 15 min) before and after each run
        "torch_threads": first.get("torch_threads"),
        "skipped_row_fraction": first.get("skipped_row_fraction"),
        "ran": first.get("ran"),  # what the side reported running (dtypes, engines)
    }


def _seconds_of(shape: str, figures: Mapping[str, Mapping[str, Any]]) -> Callable[[str], float]:
    """``seconds(side)``: the side's s/step, or ``ValueError`` naming the side the shape did not run."""

    def seconds(side: str) -> float:
        if side not in figures:
            raise ValueError(
                f"runs[{shape!r}]: no {side!r} side to compare with; sides run: {sorted(figures)}"
            )
        return figures[side]["s_per_step"]

    return seconds


def build_result(
    runs: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], settings: Mapping[str, Any]
) -> dict[str, Any]:
    """The bench document: per shape each side's figures and its ratio against its counterpart.

    ``runs[shape][side]`` is the list of that side's runs (one per round). The reference pair
    of each precision (``trl`` / ``verity``, ``trl-bf16`` / ``verity-bf16``) gives the shape's
    ``ratio`` (float32) and ``grpo_step_vs_trl[_bf16]_<shape>`` = TRL s/step / verity s/step.
    Every other verity side is compared with its precision's reference TRL side
    (``ratio_<side>`` in the shape, ``<ratio name>_<side with "-" as "_">`` in ``ratios``),
    every other TRL side with its precision's reference verity side (``ratio_vs_<side>``,
    its s/step over verity's). ``ratio_rounds`` holds each ratio's per-round values (round
    r of one side over round r of the other, run next to each other). A run restricted to some sides (``--sides``) must still give
    each side its counterpart: ``ValueError`` names a side that has none, or a shape without
    a single ratio.
    """
    shapes: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    ratio_rounds: dict[str, list[float]] = {}

    def per_round(name: str, num: str, den: str) -> None:
        # round r of each side ran next to each other (the sides alternate), so their quotient is one round's ratio
        pairs = zip(figures[num]["s_per_step_per_round"], figures[den]["s_per_step_per_round"], strict=False)
        ratio_rounds[name] = [a / b for a, b in pairs]

    for shape, sides in runs.items():
        empty = sorted(s for s, side_runs in sides.items() if not side_runs)
        if empty:
            raise ValueError(f"runs[{shape!r}]: no runs for {empty}")
        figures = {side: side_figure(runs_) for side, runs_ in sides.items()}
        shapes[shape] = dict(figures)
        seconds = _seconds_of(shape, figures)
        compared = {reference_sides(s) for s in figures if not s.startswith("trl")}  # pairs verity sides use
        for trl_side, verity_side in (SIDES, BF16_SIDES):
            if trl_side in figures and (trl_side, verity_side) not in compared:
                raise ValueError(
                    f"runs[{shape!r}]: {trl_side!r} has no verity side of its precision to compare with"
                )
            if verity_side in figures:
                ratio = seconds(trl_side) / seconds(verity_side)
                ratios[ratio_name(shape, trl_side)] = ratio
                per_round(ratio_name(shape, trl_side), trl_side, verity_side)
                shapes[shape]["ratio" if trl_side == "trl" else f"ratio_vs_{trl_side}"] = ratio
        for side in sorted(s for s in figures if s.startswith("trl") and s not in (SIDES[0], BF16_SIDES[0])):
            extra = seconds(side) / seconds(reference_sides(side)[1])
            shapes[shape][f"ratio_vs_{side}"] = extra
            ratios[ratio_name(shape, side)] = extra
            per_round(ratio_name(shape, side), side, reference_sides(side)[1])
        for side in sorted(
            s for s in figures if not s.startswith("trl") and s not in (SIDES[1], BF16_SIDES[1])
        ):
            trl_side = reference_sides(side)[0]
            extra = seconds(trl_side) / seconds(side)
            shapes[shape][f"ratio_{side}"] = extra
            ratios[f"{ratio_name(shape, trl_side)}_{side.replace('-', '_')}"] = extra
            per_round(f"{ratio_name(shape, trl_side)}_{side.replace('-', '_')}", trl_side, side)
        if not any(k.startswith("ratio") for k in shapes[shape]):
            raise ValueError(
                f"runs[{shape!r}]: no TRL side with its verity counterpart among {sorted(figures)}"
            )
    return {"ratios": ratios, "ratio_rounds": ratio_rounds, "shapes": shapes, "settings": dict(settings)}


def check_sides(shapes: Sequence[str], sides: Sequence[str]) -> None:
    """Raise the ``ValueError`` :func:`build_result` would raise for these sides, before any of them runs.

    A run restricted with ``--sides`` to sides that cannot be compared would otherwise spend
    its whole time training and then stop without a result.
    """
    placeholder = {"step_seconds": [1.0, 1.0]}
    build_result({shape: {side: [placeholder] for side in sides} for shape in shapes}, {})


def format_table(result: Mapping[str, Any]) -> str:
    """A Markdown table: per shape and side, s/step and held-out accuracy; then the ratios."""

    def acc(fig: Mapping[str, Any]) -> str:
        before, after = fig.get("accuracy_before"), fig.get("accuracy_after")
        return "—" if before is None or after is None else f"{before:.3f} → {after:.3f}"

    lines = [
        "| shape | framework | steps | s/step (median) | held-out greedy acc. |",
        "|---|---|---|---|---|",
    ]
    for shape, figures in result["shapes"].items():
        labels = {"trl": "TRL GRPOTrainer", "verity": "verity (quickstart preset)"}
        for side in [s for s in figures if isinstance(figures[s], dict) and "s_per_step" in figures[s]]:
            fig = figures[side]
            if side.startswith("trl-mb"):
                label = f"TRL GRPOTrainer, {side.removeprefix('trl-mb')}-row passes"
            elif side.startswith("trl-bf16-mb"):
                rows_per_pass = side.removeprefix("trl-bf16-mb").removesuffix(COMPILED)
                label = f"TRL GRPOTrainer, bf16=True, {rows_per_pass}-row passes"
                label += ", torch_compile=True" if side.endswith(COMPILED) else ""
            elif side == ALL_ROWS_SIDE:
                label = "verity, every row trained (actor.skip_zero_advantage=off)"
            elif side == "trl-bf16":
                label = "TRL GRPOTrainer, bf16=True"
            elif side == TRL_BF16_EAGER_SIDE:
                label = "TRL GRPOTrainer, bf16=True, eager attention"
            elif side == "verity-bf16":
                label = "verity, bf16 (mixed precision + bf16 rollout)"
            elif side == BF16_ALL_ROWS_SIDE:
                label = "verity, bf16, every row trained"
            elif side == "trl-bf16" + COMPILED:
                label = "TRL GRPOTrainer, bf16=True, torch_compile=True"
            elif side == "verity-bf16" + COMPILED:
                label = "verity, bf16, compiled layers (actor.fsdp2.compile=true)"
            elif side == BF16_ALL_ROWS_SIDE + COMPILED:
                label = "verity, bf16, compiled layers, every row trained"
            else:
                label = labels.get(side, f"verity, {side.removeprefix('verity-')} (workers x threads)")
            lines.append(f"| {shape} | {label} | {fig['steps']} | {fig['s_per_step']:.3f} | {acc(fig)} |")
    lines.append("")
    for shape, figures in result["shapes"].items():
        if "ratio" in figures:  # the float32 reference pair ran
            r = figures["ratio"]
            verdict = "faster" if r > 1 else "slower"
            lines.append(
                f"{ratio_name(shape)} = TRL s/step / verity s/step = {r:.3f} (verity {r:.2f}x TRL's speed: {verdict})"
            )
        else:
            lines.append(f"{shape}: TRL s/step / verity s/step, side by side:")
        for key in sorted(k for k in figures if k.startswith("ratio_")):
            if key.startswith("ratio_vs_"):
                side = key.removeprefix("ratio_vs_")
                mine = reference_sides(side)[1]
                lines.append(f"  vs {side}: its s/step / {mine} s/step = {figures[key]:.3f}")
            else:
                side = key.removeprefix("ratio_")
                trl_side = reference_sides(side)[0]
                trl_label = "TRL" if trl_side == "trl" else trl_side
                lines.append(f"  {side}: {trl_label} s/step / its s/step = {figures[key]:.3f}")
    return "\n".join(lines)
