"""Check, before any worker starts, that the reward configuration can score the run's data.

:func:`check_rewards` is called by the trainer right after the datasets are read, and
raises :class:`RewardSetupError` (``verity train`` exits 2) when

1. a ``reward.*`` value is out of range (e.g. ``reward.max_failure_rate=2``);
2. a ``data_source`` of the training or validation files has no reward function
   (the message lists every such source with its row count, and the ways to map it),
   or ``reward.overrides`` / ``timeout_overrides`` name a source the data does not have;
3. the user reward function (``reward.custom_path``/``custom_name``) or a reward named
   in ``reward.overrides`` cannot be imported, does not exist, raises, hangs, or
   returns something other than a number (or a dict with ``score``) when called once on
   a real row: the first row it would score, with that row's ground truth as the
   response. The call runs in a child process under the sample timeout, so a hanging
   or crashing function cannot take the driver with it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from verity.rewards.manager import RewardManagerConfig
from verity.rewards.process_pool import TaskOutcome, TimeoutPool
from verity.rewards.registry import (
    BUILTIN_NAMES,
    PREFIX_RULES,
    UnknownDataSourceError,
    call_reward,
    check_loads,
    custom_spec_from,
    resolve_spec,
)

STARTUP_TIMEOUT_S = 120.0
_IMPORT_ERRORS = (
    "ModuleNotFoundError",
    "ImportError",
    "SyntaxError",
    "IndentationError",
    "FileNotFoundError",
)


class RewardSetupError(ValueError):
    """The reward configuration cannot score this run's data; the message names the key and the input."""


def _what_failed(outcome: TaskOutcome, stage: str, timeout_s: float, spec: str) -> str:
    if outcome.status == "timeout":
        return f"did not return within {timeout_s:g} s (reward.timeout_s / reward.timeout_overrides)"
    text = (outcome.error or "").strip()
    head = text.splitlines()[0] if text else "unknown error"
    kind = head.split(":", 1)[0]
    tail = "\n".join(text.splitlines()[-6:])
    if stage == "load":
        if kind in _IMPORT_ERRORS:
            return f"cannot be imported: {head}\n{tail}"
        if kind == "AttributeError":
            return head.split(":", 1)[1].strip()
        return f"failed while loading: {head}\n{tail}"
    if kind == "RewardResultError":
        return head.split(":", 1)[1].strip().removeprefix(f"{spec}: ")
    return f"raised {head}\n{tail}"


def _name(spec: str, config: RewardManagerConfig, sources: Sequence[str]) -> str:
    """How the configuration names ``spec`` (for messages)."""
    if config.custom_path and spec == custom_spec_from(config.custom_path, config.custom_name):
        return f"the reward function reward.custom_path={config.custom_path!r} reward.custom_name={config.custom_name!r}"
    return f"the reward {spec!r} of reward.overrides[{sources[0]!r}]"


def check_data_sources(
    config: RewardManagerConfig, sources: Mapping[str, Counter], files: Mapping[str, Sequence[str]]
) -> dict[str, str]:
    """``{data_source: spec}`` for every source of ``sources`` (split -> counts of rows per source).

    Raises RewardSetupError listing every source without a reward function, per split, and
    every ``reward.overrides`` / ``reward.timeout_overrides`` entry naming a source no split has
    (it would change nothing).
    """
    present = set().union(*(set(counts) for counts in sources.values())) if sources else set()
    for key, mapping in (("reward.overrides", config.overrides), ("reward.timeout_overrides", config.timeout_overrides)):
        idle = sorted(set(mapping) - present)
        if idle:
            raise RewardSetupError(
                f"{key}: no row of the data has data_source {', '.join(repr(s) for s in idle)}, so "
                f"{'this entry' if len(idle) == 1 else 'these entries'} would change nothing; the data's "
                f"sources: {sorted(present)} ({', '.join(f'data.{split}_files' for split in sources)})"
            )
    custom = custom_spec_from(config.custom_path, config.custom_name)
    specs: dict[str, str] = {}
    unknown: list[str] = []
    for split, counts in sources.items():
        for source, rows in sorted(counts.items()):
            try:
                specs[source] = resolve_spec(source, config.overrides, custom)
            except UnknownDataSourceError:
                unknown.append(
                    f"  {source!r}: {rows} rows of data.{split}_files {list(files.get(split, []))}"
                )
    if unknown:
        example = sorted({line.split("'")[1] for line in unknown})[0]
        raise RewardSetupError(
            "no reward function for these data_source values:\n"
            + "\n".join(unknown)
            + f"\nBuilt-in reward names: {list(BUILTIN_NAMES)}; data_source prefixes recognised: "
            + f"{[p for p, _ in PREFIX_RULES]}; synthetic tasks: verity/<task>.\n"
            + f"Map a source to a reward on the command line with '+reward.overrides={{{example}: gsm8k_strict}}', "
            + f"in a --config file with 'reward: {{overrides: {{{example}: gsm8k_strict}}}}', or score every "
            + "source with your own function: reward.custom_path=FILE.py reward.custom_name=FUNCTION."
        )
    return specs


def probe_reward_functions(config: RewardManagerConfig, first_rows: Mapping[str, Mapping[str, Any]]) -> None:
    """Load and call once, in a child process, every user-supplied reward function the data uses.

    ``first_rows``: spec -> the first row it scores (``data_source``, ``ground_truth``,
    ``extra_info``). Built-in rewards are not probed. Raises RewardSetupError.
    """
    custom = custom_spec_from(config.custom_path, config.custom_name)
    user_specs = {custom} | set(config.overrides.values())
    wanted = {
        spec: row for spec, row in first_rows.items() if spec in user_specs and spec not in BUILTIN_NAMES
    }
    if not wanted:
        return
    kwargs = dict(config.custom_kwargs) if custom else {}
    with TimeoutPool(1, start_method=config.start_method, max_workers=1) as pool:
        pool.startup_timeout_s = STARTUP_TIMEOUT_S
        for spec, row in wanted.items():
            sources = [s for s, v in config.overrides.items() if v == spec] or [row["data_source"]]
            timeout = config.timeout_overrides.get(row["data_source"], config.timeout_s)
            loaded = pool.map(check_loads, [(spec,)], STARTUP_TIMEOUT_S)[0]
            if loaded.status != "ok":
                raise RewardSetupError(
                    f"{_name(spec, config, sources)}: {_what_failed(loaded, 'load', timeout, spec)}"
                )
            task = (
                spec,
                row["data_source"],
                str(row["ground_truth"]),
                row["ground_truth"],
                row["extra_info"],
                kwargs,
            )
            called = pool.map(call_reward, [task], timeout)[0]
            if called.status != "ok":
                raise RewardSetupError(
                    f"{_name(spec, config, sources)}: called once on the first row it scores "
                    f"(data_source={row['data_source']!r}, its ground truth {row['ground_truth']!r} as the "
                    f"response), it {_what_failed(called, 'call', timeout, spec)}"
                )


def check_rewards(reward_cfg: Any, datasets: Mapping[str, tuple[Sequence[str], Any]]) -> None:
    """All the checks of the module docstring, before any worker starts.

    Args:
        reward_cfg: the run config's ``reward`` section (or anything
            :meth:`RewardManagerConfig.from_any` takes).
        datasets: split name (``"train"``, ``"val"``) -> ``(files, dataset)``, where the
            dataset's ``records`` carry ``data_source``, ``ground_truth`` and ``extra_info``.
    """
    try:
        config = RewardManagerConfig.from_any(reward_cfg)
    except (TypeError, ValueError) as err:
        raise RewardSetupError(str(err).replace("reward ", "reward.", 1)) from None
    sources = {split: Counter(r.data_source for r in data.records) for split, (_, data) in datasets.items()}
    specs = check_data_sources(config, sources, {split: files for split, (files, _) in datasets.items()})
    first_rows: dict[str, dict[str, Any]] = {}
    for _, data in datasets.values():
        for record in data.records:
            spec = specs[record.data_source]
            if spec not in first_rows:
                first_rows[spec] = {
                    "data_source": record.data_source,
                    "ground_truth": record.ground_truth,
                    "extra_info": record.extra_info,
                }
    probe_reward_functions(config, first_rows)
