"""``verity eval MODEL [--data FILE ...] [-k K --temperature T] [reward.KEY=VALUE ...]``: held-out accuracy, avg@k, pass@k, maj@k.

    verity eval outputs/run/hf --data test.parquet                   # greedy accuracy
    verity eval outputs/run --data aime2024.parquet -k 32 --temperature 1.0 --max-new-tokens 4096
    verity eval outputs/run --data test.parquet                      # scored with the run's reward settings
    verity eval outputs/run                                          # on what the run validated on
    verity eval hf_folder --data test.parquet reward.custom_path=myreward.py   # a reward function of your own
    verity eval embedded                                             # the embedded default on its held-out split
    verity eval embedded --preset NAME -k 8 --temperature 1.0        # another embedded preset (a plug-in's)

MODEL is an HF model folder, a checkpoint (a ``step_N`` folder, a checkpoint folder
or a run output folder: its newest complete checkpoint is exported to a temporary
folder first), or ``embedded``. Without ``--data``, a checkpoint (or run folder) is evaluated on the
held-out data its run validated on -- the run's ``data.val_files``, or for the embedded
model its preset's held-out split -- with the run's response budget
(``data.max_response_length``); the data used is printed. Data files are in the verl schema; each row is scored
by the reward function of its ``data_source``. Prints a table and, with ``--json``,
writes the metrics, under the names ``verity train`` logs (:mod:`verity.evaluation.validation`):
``val/acc`` for ``-k 1``; ``val/avg_at_k``, ``val/pass_at_k``, ``val/maj_at_k`` and ``val/k``
for ``-k K > 1``; per data source ``val/<data_source>/...``. One process, no Ray.

Rewards: a checkpoint (or run folder) is scored with the ``reward`` settings of the run
that saved it (its ``trainer_state.json``): the run's ``reward.custom_path``,
``reward.overrides``, timeouts, ... A relative file path there is read as the run read
it: against the folder ``verity train`` ran in, which the checkpoint records (a
checkpoint saved before verity recorded it: against the current folder).
``reward.KEY=VALUE`` arguments, anywhere on the command line and in ``verity train``'s
grammar (``'+reward.overrides={my/set: gsm8k}'``), change those settings (an HF folder
or ``embedded`` starts from the defaults); their relative paths are read against the
current folder.

Exit codes: 0 evaluated; 2 bad input (no such model, checkpoint or file; bad settings).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

# a reward setting given on the command line: reward.custom_path=r.py, '+reward.overrides={a: b}'
_REWARD_ARG = re.compile(r"^\+{0,2}reward\.[A-Za-z_][\w.]*=")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="verity eval",
        description="Evaluate a model or checkpoint on held-out data.",
        epilog="reward.KEY=VALUE arguments (anywhere, as in verity train) change the reward settings: "
        "a checkpoint's are its run's (relative paths read against the folder verity train ran in), "
        "others start from the defaults. Example: reward.custom_path=myreward.py reward.custom_name=score",
    )
    p.add_argument("model", help="an HF model folder, a checkpoint or run folder, or 'embedded'")
    p.add_argument(
        "--data",
        nargs="+",
        default=[],
        help="verl-schema parquet/JSONL files (default: for a checkpoint or run folder, the held-out "
        "files its run validated on, data.val_files or the embedded test split; for embedded, its test split)",
    )
    p.add_argument("-k", type=int, default=1, help="responses per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0 needed for k > 1")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="response budget (default: a run's data.max_response_length without --data; 16 embedded; 1024)",
    )
    p.add_argument(
        "--max-prompt-length", type=int, default=1024, help="longer prompts are an error naming the row"
    )
    p.add_argument("--batch-size", type=int, default=64, help="prompts per generate call")
    p.add_argument("--max-samples", type=int, default=None, help="evaluate only the first N prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--role", default="actor", help="the role to evaluate from a checkpoint (default actor)")
    p.add_argument(
        "--preset", default="default", help="with MODEL=embedded: the embedded preset (default: default)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default cpu)")
    p.add_argument("--json", dest="json_path", help="also write the report as JSON here")
    return p


def _is_hf_model_folder(path: Path) -> bool:
    """An HF model folder: a ``config.json`` naming a ``model_type`` (a run folder's config.json is the run's)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config


def _resolve_model(
    model: str, role: str, scratch: Path, preset: str = "default"
) -> tuple[str, list[str], int]:
    """``(HF folder, default data files, default max_new_tokens)`` for the MODEL argument."""
    if model == "embedded":
        from verity.config.schema import ModelConfig
        from verity.data.embedded import embedded_preset

        chosen = embedded_preset(preset)
        paths = chosen.build(Path(ModelConfig().embedded_cache_dir).expanduser())
        return str(paths.model_dir), [str(paths.test_file)], chosen.eval_max_new_tokens
    if preset != "default":
        raise ValueError(f"--preset {preset!r} applies only to MODEL=embedded")
    path = Path(model).expanduser()
    if _is_hf_model_folder(path):
        return str(path), [], 1024
    if not path.exists():
        raise FileNotFoundError(f"{model!r}: no such model folder or checkpoint")
    from verity.checkpoint.export import export_hf, find_checkpoint

    checkpoint = find_checkpoint(path)
    out = export_hf(checkpoint, scratch / "hf", role=role)
    print(f"verity eval: exported {checkpoint} ({role}) to a temporary HF folder", file=sys.stderr)
    return str(out), [], 1024


def _default_data(model: str):
    """The held-out data MODEL is evaluated on without ``--data``: a checkpoint's or run folder's
    :class:`~verity.evaluation.held_out.HeldOutData` (what ``verity train`` validated on), None for
    ``embedded`` (its preset's test split); ValueError for an HF folder (it records no data),
    FileNotFoundError for a folder that is no model, checkpoint or run folder."""
    if model == "embedded":
        return None
    path = Path(model).expanduser()
    if _is_hf_model_folder(path):
        raise ValueError(
            f"--data: {model} is an HF model folder, which names no held-out data; give at least one "
            "verl-schema parquet/JSONL file to evaluate on"
        )
    from verity.checkpoint.export import find_checkpoint
    from verity.checkpoint.state import TrainerState
    from verity.evaluation.held_out import run_held_out_files

    state = TrainerState.read(find_checkpoint(path))
    return run_held_out_files(state.config, state.working_dir or None)


def _is_relative_file(target: str) -> bool:
    """A reward spec's file part that is a relative path (a module name, ``pkg.mod``, is not a path)."""
    return (target.endswith(".py") or "/" in target) and not Path(target).expanduser().is_absolute()


def _with_base(reward: dict[str, Any], base: Path) -> dict[str, Any]:
    """``reward`` with its relative file paths (``custom_path``, ``file.py:function`` overrides) under ``base``."""
    out = dict(reward)
    path = out.get("custom_path")
    if isinstance(path, str) and path and _is_relative_file(path):
        out["custom_path"] = str(base / path)
    specs = {}
    for source, spec in (out.get("overrides") or {}).items():
        target, sep, name = str(spec).rpartition(":")
        specs[source] = f"{base / target}{sep}{name}" if sep and _is_relative_file(target) else spec
    if specs:
        out["overrides"] = specs
    return out


def _overrides_dict(texts: list[str]) -> dict[str, Any]:
    """``reward.KEY=VALUE`` arguments (Hydra's grammar) as the nested ``reward`` dict they set."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out: dict[str, Any] = {}
    for text in texts:
        try:
            parsed = parser.parse_overrides([text])[0]
        except HydraException as err:
            raise ValueError(f"{text!r}: not a KEY=VALUE setting ({str(err).splitlines()[0]})") from None
        *parents, leaf = parsed.key_or_group.split(".")[1:]
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = parsed.value()
    return out


def reward_settings(model: str, texts: list[str]) -> tuple[Any, str | None]:
    """``(the reward settings to score with, where they came from or None)`` for MODEL and the
    ``reward.KEY=VALUE`` arguments (see the module docstring); ValueError names a bad setting."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from verity.config.schema import RewardConfig

    saved: dict[str, Any] = {}
    origin = None
    path = Path(model).expanduser()
    if model != "embedded" and not _is_hf_model_folder(path):
        from verity.checkpoint.export import find_checkpoint
        from verity.checkpoint.state import STATE_FILE, TrainerState

        checkpoint = find_checkpoint(path)
        state = TrainerState.read(checkpoint)
        base = Path(state.working_dir) if state.working_dir else Path.cwd()
        known = set(RewardConfig.__dataclass_fields__)
        saved = _with_base({k: v for k, v in (state.config.get("reward") or {}).items() if k in known}, base)
        origin = f"{checkpoint / STATE_FILE} (relative paths read against {base})"
    given = _with_base(_overrides_dict(texts), Path.cwd())
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RewardConfig), saved, given)
        reward = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise ValueError(f"reward settings {' '.join(texts)}: {lines[0] if lines else err}") from None
    if reward.custom_path and not Path(reward.custom_path).expanduser().is_file():
        where = f"the run's, from {origin}" if origin and "custom_path" not in given else "given here"
        raise ValueError(
            f"reward.custom_path={reward.custom_path!r} ({where}): no such file; give the reward "
            "function file with reward.custom_path=FILE.py (and reward.custom_name=FUNCTION)"
        )
    return reward, origin


def format_report(report) -> str:
    """The metrics table printed by ``verity eval``."""
    lines = [
        f"{report.prompts} prompts x {report.settings['k']} responses, temperature {report.settings['temperature']}",
        f"{'metric':34} {'value':>8}",
    ]
    for name, value in sorted(report.metrics.items()):
        lines.append(f"{name:34} {value:>8.4f}")
    lines.append(f"{'mean score':34} {report.mean_score:>8.4f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    reward_args = [a for a in argv if _REWARD_ARG.match(a)]
    args = _parser().parse_args([a for a in argv if not _REWARD_ARG.match(a)])
    from verity.data.verl_dataset import MalformedDatasetError, PromptTooLongError
    from verity.evaluation.held_out import evaluate_files

    with tempfile.TemporaryDirectory(prefix="verity-eval-") as scratch:
        try:
            if args.model != "embedded" and not Path(args.model).expanduser().exists():
                raise FileNotFoundError(f"{args.model!r}: no such model folder or checkpoint")
            missing = [f for f in args.data or [] if not Path(f).expanduser().is_file()]
            if missing:
                raise FileNotFoundError(f"--data: no such file(s): {', '.join(missing)}")
            # before exporting a checkpoint for nothing: a folder that is no checkpoint or run is named
            held_out = None if args.data else _default_data(args.model)
            reward, origin = reward_settings(args.model, reward_args)
            if origin is not None:
                print(f"verity eval: reward settings of the run, from {origin}", file=sys.stderr)
            model_path, default_files, default_tokens = _resolve_model(
                args.model, args.role, Path(scratch), args.preset
            )
            if held_out is not None:
                default_files, default_tokens = held_out.files, held_out.max_new_tokens or default_tokens
                print(f"verity eval: data: {held_out.source}: {', '.join(held_out.files)}", file=sys.stderr)
            files = args.data or default_files
            report = evaluate_files(
                model_path,
                files,
                k=args.k,
                temperature=args.temperature,
                top_p=args.top_p,
                max_new_tokens=args.max_new_tokens or default_tokens,
                max_prompt_length=args.max_prompt_length,
                batch_size=args.batch_size,
                max_samples=args.max_samples,
                seed=args.seed,
                device=args.device,
                reward=reward,
            )
        except (FileNotFoundError, ValueError, MalformedDatasetError, PromptTooLongError) as err:
            print(f"verity eval: {err}", file=sys.stderr)
            return 2
    print(format_report(report))
    if args.json_path:
        payload = {"metrics": report.metrics, "prompts": report.prompts, "responses": report.responses,
                   "mean_score": report.mean_score, "settings": report.settings}  # fmt: skip
        Path(args.json_path).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"report: {args.json_path}")
    return 0
