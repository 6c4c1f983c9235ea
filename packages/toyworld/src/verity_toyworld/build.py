"""The embedded default: tiny model + character tokenizer + arithmetic task, warm-started and cached.

``ensure_embedded_default(cache_dir)`` returns local paths a run can use as if a
user had pointed at a real checkpoint and real verl parquet files::

    <cache_dir>/<key>/
        manifest.json        settings, SFT seconds and losses, held-out greedy accuracy, versions
        data/train.parquet   arithmetic train split (verl schema)
        data/test.parquet    held-out split (no expression shared with train)
        base/                the untrained model and tokenizer (HF format; + preprocessor_config.json
                             for a vision-language preset)
        model/               the SFT warm-started model and tokenizer (HF format, likewise)

``settings`` is an :class:`~verity_toyworld.presets.EmbeddedSettings`; a run picks
one by name with ``model.embedded_preset`` (``default``, the one described below, or one a
plug-in registered: :mod:`verity_toyworld.presets`). ``<key>`` is a hash of every
setting that changes the result (task knobs, row format, teacher, split sizes, seeds,
model shape, SFT steps/lr/batch) and of ``EMBEDDED_FORMAT``, so a change of settings
builds a new entry and an unchanged one is reused. Building
happens in a temporary folder renamed into place at the end, under a file lock,
so concurrent callers neither duplicate the work nor see a half-written entry.

The warm-start imitates an imperfect teacher. Its answers are always right,
but on ``sft_slip_rate`` (70%) of the *subtraction* problems it ends the answer
with a full stop (``"37."``), which the strict verifier rejects (a response
must be exactly the integer, then EOS). The warm-started model therefore
answers additions cleanly and, greedily, closes most subtractions with a full
stop, while samples still hold clean subtraction answers about 30% of the
time. That is the situation RL with a verifier is good at: the reward
separates the samples, GRPO has a signal in most subtraction groups, and the
fix (drop the full stop) generalises across prompts. Without the slip
(``sft_slip_rate=0``) what is left to learn is arithmetic itself — for this
model mostly the units digit, a 200-entry table — which GRPO improves only
slowly. Build times and held-out accuracies for several SFT step counts, with
and without the slip, and a GRPO probe from the default checkpoint are in
``ci/reports/2026-12-06-docstring-figures.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from verity_toyworld.presets import (  # noqa: F401  (EmbeddedSettings and teacher_rows are re-exported)
    EMBEDDED_FORMAT,
    SFT_TEACHERS,
    EmbeddedSettings,
    format_rows,
    teacher_rows,
)


@dataclass(frozen=True)
class EmbeddedPaths:
    """Where a built embedded default lives (see the module docstring)."""

    root: Path
    model_dir: Path
    base_model_dir: Path
    train_file: Path
    test_file: Path
    manifest_file: Path

    @property
    def tokenizer_dir(self) -> Path:
        """The tokenizer is saved beside the model weights."""
        return self.model_dir

    def manifest(self) -> dict[str, Any]:
        """The build record: settings, SFT seconds/losses, held-out greedy accuracy, versions."""
        return json.loads(self.manifest_file.read_text())


def embedded_paths(root: str | os.PathLike) -> EmbeddedPaths:
    """The paths of an entry rooted at ``root`` (whether or not it is built)."""
    root = Path(root)
    return EmbeddedPaths(
        root=root,
        model_dir=root / "model",
        base_model_dir=root / "base",
        train_file=root / "data" / "train.parquet",
        test_file=root / "data" / "test.parquet",
        manifest_file=root / "manifest.json",
    )


def ensure_embedded_default(
    cache_dir: str | os.PathLike,
    sft_steps: int | None = None,
    *,
    settings: EmbeddedSettings | None = None,
    rebuild: bool = False,
    log: Callable[[str], None] | None = print,
) -> EmbeddedPaths:
    """Return the cached embedded default for ``settings``, building it first if needed.

    ``sft_steps`` overrides ``settings.sft_steps`` (0: no warm-start; ``model/``
    is then the untrained model). ``rebuild=True`` discards a cached entry.
    ``log`` receives progress lines (None: silent).
    """
    settings = settings or EmbeddedSettings()
    if sft_steps is not None:
        settings = replace(settings, sft_steps=int(sft_steps))
    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths = embedded_paths(cache_dir / settings.key())
    say = log or (lambda _line: None)
    with _file_lock(cache_dir / f"{settings.key()}.lock"):
        if paths.manifest_file.exists() and not rebuild:
            return paths
        if paths.root.exists():
            shutil.rmtree(paths.root)
        # a build killed outright (SIGKILL, SIGTERM before Python unwinds) leaves its staging
        # folder behind; under this settings' lock no other build of it is running, so they go
        for stale in cache_dir.glob(f".{settings.key()}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        say(f"verity: building the embedded default in {paths.root} (runs once per settings)")
        staging = Path(tempfile.mkdtemp(prefix=f".{settings.key()}-", dir=cache_dir))
        try:
            with _torch_threads(1):
                _build(embedded_paths(staging), settings, say)
            os.replace(staging, paths.root)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return paths


def _build(paths: EmbeddedPaths, settings: EmbeddedSettings, say: Callable[[str], None]) -> None:
    """Write data, base model, warm-started model and manifest under ``paths.root``."""
    import tokenizers
    import torch
    import transformers
    from verity.data.task_registry import synthetic_tasks, task_config_class
    from verity.evaluation.greedy import evaluate
    from verity.rollout.sampling import SamplingParams
    from verity.sft import run_sft

    from verity_toyworld.tasks.arithmetic import extract_answer

    tasks = synthetic_tasks()
    if settings.task not in tasks:
        raise ValueError(f"task: expected one of {tasks.names()}, got {settings.task!r}")
    task = tasks.get(settings.task)
    config = task_config_class(task)(**settings.task_config)
    train_rows, test_rows = task.generate_splits(
        settings.num_train, settings.num_test, settings.data_seed, config
    )
    train_rows, test_rows = format_rows(train_rows, settings), format_rows(test_rows, settings)
    teacher = SFT_TEACHERS.get(settings.teacher)  # an unknown teacher fails before any training
    _write_rows(train_rows, paths.train_file)
    _write_rows(test_rows, paths.test_file)

    tokenizer, model, image_processor = _build_model(settings)
    _save(paths.base_model_dir, model, tokenizer, image_processor)

    record: dict[str, Any] = {
        "format": EMBEDDED_FORMAT,
        "key": settings.key(),
        "settings": asdict(settings),
        "parameters": sum(p.numel() for p in model.parameters()),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    started = time.perf_counter()
    if settings.sft_steps > 0:
        say(f"verity: SFT warm-start, {settings.sft_steps} steps of {settings.sft_batch_size} rows")
        sft_rows = teacher(train_rows, settings)
        if settings.teacher in ("answer", "shape_count"):  # the teachers with the full-stop slip
            record["sft_slipped_rows"] = sum(row["response"].endswith(".") for row in sft_rows)
        result = run_sft(
            model,
            tokenizer,
            sft_rows,
            settings.sft_steps,
            lr=settings.sft_lr,
            batch_size=settings.sft_batch_size,
            seed=settings.sft_seed,
            image_processor=image_processor,
            # a line every tenth of the way: the warm-start takes minutes on a small CPU
            log_every=max(1, settings.sft_steps // 10),
            on_log=lambda step, loss: say(f"verity: SFT warm-start step {step}/{settings.sft_steps}, loss {loss:.3f}"),
        )
        tail = result.losses[-min(50, len(result.losses)) :]
        record["sft"] = {
            "seconds": round(result.seconds, 2),
            "first_loss": result.losses[0],
            "final_loss_mean_last_50": sum(tail) / len(tail),
            "tokens": result.tokens,
        }
    sampling = SamplingParams(do_sample=False, max_new_tokens=settings.eval_max_new_tokens)
    if settings.data_source is None:  # the task's own verifier; clean = the bare integer
        evaluation = evaluate(model, tokenizer, test_rows, sampling=sampling, image_processor=image_processor)
        clean = [extract_answer(text) is not None for text in evaluation.responses]
    else:  # the relabelled source's reward function; clean = it found an answer
        found: list[bool] = []
        evaluation = evaluate(
            model,
            tokenizer,
            test_rows,
            sampling=sampling,
            score_fn=_reward_scorer(found),
            image_processor=image_processor,
        )
        clean = found
    accuracy = evaluation.accuracy
    record["test_greedy_accuracy"] = accuracy
    record["test_greedy_clean_rate"] = sum(clean) / len(clean)
    record["build_seconds"] = round(time.perf_counter() - started, 2)
    say(
        f"verity: warm-start done in {record['build_seconds']:.0f} s, held-out greedy accuracy {accuracy:.1%}"
    )
    _save(paths.model_dir, model, tokenizer, image_processor)
    paths.manifest_file.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _build_model(settings: EmbeddedSettings) -> tuple[Any, Any, Any]:
    """``(tokenizer, untrained model, image processor or None)`` of ``settings.model_family``."""
    if settings.model_family == "qwen2_5_vl":
        from verity_toyworld.tiny_vlm import (
            build_tiny_qwen2_5_vl,
            build_vlm_image_processor,
            build_vlm_tokenizer,
        )

        tokenizer = build_vlm_tokenizer()
        model = build_tiny_qwen2_5_vl(tokenizer, seed=settings.model_seed, **settings.model)
        return tokenizer, model, build_vlm_image_processor()
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    tokenizer = CharTokenizer()
    if settings.model_family in ("qwen3_moe", "qwen2_moe"):
        from verity_toyworld.tiny_moe import build_tiny_moe_for

        model = build_tiny_moe_for(tokenizer, family=settings.model_family, seed=settings.model_seed, **settings.model)
        return tokenizer, model, None
    return tokenizer, build_tiny_qwen2_for(tokenizer, seed=settings.model_seed, **settings.model), None


def _save(folder: Path, model: Any, tokenizer: Any, image_processor: Any) -> None:
    """Model, tokenizer and (for a vision-language model) image processor, in HF format."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if image_processor is not None:
        image_processor.save_pretrained(folder)


def _reward_scorer(found: list[bool]) -> Callable[[str, str, str], float]:
    """A ``score_fn`` for :func:`verity.evaluation.greedy.evaluate` using the reward of each row's
    ``data_source``: 1.0 when the verifier says correct (its ``acc``, else ``score >= 1``).

    Appends to ``found`` whether the verifier extracted an answer (its ``pred``, when it reports one).
    """
    from verity.rewards.registry import call_reward, resolve_spec

    def score(data_source: str, text: str, truth: str) -> float:
        value, extra = call_reward(resolve_spec(data_source), data_source, text, truth)
        found.append(extra["pred"] is not None if "pred" in extra else value >= 1.0)
        acc = extra.get("acc")
        return float(acc) if acc is not None else float(value >= 1.0)

    return score


def _write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    from verity_toyworld.tasks.arithmetic import write_parquet

    write_parquet(rows, path)


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """Run torch's CPU ops on ``count`` threads inside the block, then restore the previous count.

    The build uses one thread: its matrices are tiny, so a second thread gains
    little when the machine is idle and loses several times over when other
    processes compete for the cores (``ci/reports/2026-12-06-docstring-figures.md``),
    and a fixed count keeps the floating-point reduction order, hence the
    warm-started weights, the same on any machine.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (POSIX ``flock``; no locking where unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
