"""Logging a run to MLflow: an embedded SQLite store by default, or a tracking server.

Embedded default (no server, nothing to start):

    <run_dir>/mlflow.db       the tracking store (sqlite:///<run_dir>/mlflow.db)
    <run_dir>/mlartifacts/    artifacts (set as the experiment's artifact location)

Browse it with ``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db``
(:attr:`Tracker.ui_command`). A server URI (``http://host:5000``) given as
``tracking_uri`` or in ``MLFLOW_TRACKING_URI`` is used instead; its artifact
location is the server's business.

Each ``log_params`` call is one ``MlflowClient.log_batch`` request (split only
where MLflow's per-request limits demand). ``log_metrics`` does the same, unless
the tracker buffers metrics (``buffer_seconds > 0``, what a training run uses):
then values are written together once that many seconds have passed since the
last write, or on :meth:`Tracker.flush` / :meth:`Tracker.finish` — one SQLite
transaction per few steps instead of per step, which costs a step less time
(``ci/reports/2026-12-06-docstring-figures.md``). MLflow's own chatter while creating the
store is silenced, and a new embedded store is copied from a pre-migrated
empty one cached in ``~/.cache/verity`` (``VERITY_MLFLOW_TEMPLATE=0`` turns
that off) instead of running MLflow's schema migrations for every run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from verity.tracking.names import check_name
from verity.tracking.params import param_key_string, to_mlflow_params

EMBEDDED_DB = "mlflow.db"
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
_NOISY_LOGGERS = ("mlflow.store.db.utils", "mlflow.store", "alembic", "alembic.runtime.migration")


@contextlib.contextmanager
def _quiet_mlflow() -> Iterator[None]:
    """Silence MLflow's and alembic's INFO messages (store creation, migrations)."""
    saved = {name: logging.getLogger(name).level for name in _NOISY_LOGGERS}
    try:
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def embedded_tracking_uri(run_dir: str | os.PathLike[str]) -> str:
    """``sqlite:///<absolute run_dir>/mlflow.db``."""
    return "sqlite:///" + str(Path(run_dir).resolve() / EMBEDDED_DB)


def release_embedded_store(run_dir: str | os.PathLike[str]) -> None:
    """Close this process's cached connections to ``<run_dir>/mlflow.db`` before the file is moved.

    MLflow keeps one SQLAlchemy engine per database URI for the life of the process
    (``SqlAlchemyStore._engine_map``); a store file moved or replaced under an open
    engine leaves later writes failing ("readonly database") or landing in the moved
    file. A fresh start that moves an old run aside calls this first.
    """
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    except ImportError:  # pragma: no cover - mlflow is a dependency
        return
    engines = getattr(SqlAlchemyStore, "_engine_map", None)
    if not isinstance(engines, dict):
        return
    engine = engines.pop(embedded_tracking_uri(run_dir), None)
    if engine is not None:
        engine.dispose()


def _template_store_path() -> Path:
    import mlflow

    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_root / "verity" / f"mlflow-{mlflow.__version__}-empty.db"


def _seed_embedded_store(db_path: Path) -> None:
    """Put a pre-migrated empty MLflow store at ``db_path`` if there is none yet.

    Creating a SQLite store runs MLflow's schema migrations (seconds on a
    small machine). The first store is built once per MLflow version and kept
    in ``~/.cache/verity``; later runs copy it. Any failure falls back to
    letting MLflow create the store itself.
    """
    if db_path.exists() or os.environ.get("VERITY_MLFLOW_TEMPLATE", "1") == "0":
        return
    try:
        template = _template_store_path()
        if not template.exists():
            from mlflow import MlflowClient

            template.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="verity-mlflow-", dir=template.parent) as tmp:
                built = Path(tmp) / EMBEDDED_DB
                MlflowClient(tracking_uri="sqlite:///" + str(built)).search_experiments(max_results=1)
                staged = Path(tmp) / "staged.db"
                shutil.copyfile(built, staged)
                os.replace(staged, template)
        staged = db_path.with_name(f".{db_path.name}.{os.getpid()}.tmp")
        shutil.copyfile(template, staged)
        os.replace(staged, db_path)
    except Exception as error:  # cache not writable, disk full, ...: MLflow builds the store itself
        logging.getLogger(__name__).debug("no template MLflow store (%s); creating one in place", error)


class Tracker:
    """One MLflow run: params, per-step metrics, artifacts.

    Args:
        run_dir: the run directory; holds the embedded store and artifacts.
        experiment: MLflow experiment name (created if missing).
        tracking_uri: an MLflow tracking URI; None reads ``MLFLOW_TRACKING_URI``
            and otherwise uses the embedded store in ``run_dir``.
        run_name: display name of a new run.
        run_id: continue this existing run (its status is set back to RUNNING);
            ``experiment`` and ``run_name`` are then ignored.
        tags: extra run tags (values stringified).
        buffer_seconds: 0 writes each ``log_metrics`` call at once; > 0 keeps values in
            memory until that many seconds have passed since the last write (or until
            :meth:`flush` / :meth:`finish`), so a run killed outright loses at most that
            much of its MLflow history (``metrics.jsonl`` is written separately).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        experiment: str = "verity",
        tracking_uri: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        buffer_seconds: float = 0.0,
    ) -> None:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        if not experiment or not isinstance(experiment, str):
            raise ValueError(f"experiment must be a non-empty str, got {experiment!r}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = (
            tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or embedded_tracking_uri(run_dir)
        )
        self._finished = False
        if not buffer_seconds >= 0:
            raise ValueError(f"buffer_seconds must be >= 0, got {buffer_seconds!r}")
        self.buffer_seconds = float(buffer_seconds)
        self._pending: list[Any] = []  # mlflow Metric values not written yet
        self._last_write = time.monotonic()
        with _quiet_mlflow():
            if self.tracking_uri == embedded_tracking_uri(run_dir):
                _seed_embedded_store(self.run_dir.resolve() / EMBEDDED_DB)
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            if run_id is not None:
                try:
                    run = self._client.get_run(run_id)
                except MlflowException as error:
                    raise ValueError(
                        f"run_id {run_id!r} not found in the tracking store {self.tracking_uri}: {error.message}"
                    ) from None
                if run.info.status != "RUNNING":
                    self._client.update_run(run_id, status="RUNNING")
                if tags:
                    self._client.log_batch(run_id, tags=self._run_tags(tags), synchronous=True)
            else:
                experiment_id = self._experiment_id(experiment)
                run = self._client.create_run(
                    experiment_id,
                    run_name=run_name,
                    tags={key: str(value) for key, value in self._base_tags(tags).items()},
                )
        self.run_id: str = run.info.run_id
        self.experiment_id: str = run.info.experiment_id
        self._logged_params: dict[str, str] = dict(run.data.params)

    # ---- setup ------------------------------------------------------------
    def _experiment_id(self, name: str) -> str:
        existing = self._client.get_experiment_by_name(name)
        if existing is not None:
            return existing.experiment_id
        artifact_location = None
        if self.tracking_uri.startswith("sqlite:") or self.tracking_uri.startswith("file:"):
            artifact_location = (self.run_dir.resolve() / "mlartifacts").as_uri()
        return self._client.create_experiment(name, artifact_location=artifact_location)

    @staticmethod
    def _base_tags(tags: Mapping[str, Any] | None) -> dict[str, Any]:
        import verity

        return {"verity.version": verity.__version__, **(tags or {})}

    @staticmethod
    def _run_tags(tags: Mapping[str, Any]) -> list[Any]:
        from mlflow.entities import RunTag

        return [RunTag(str(key), str(value)) for key, value in tags.items()]

    # ---- logging ------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log config values as params; nested mappings are flattened to dotted keys.

        Values are stringified and cut to MLflow's 6000-character limit. A key
        already logged with the same value is skipped; with a different value
        (MLflow forbids changing a param, e.g. a continued run whose config
        changed) the new value is kept as the tag ``param_changed.<key>`` and a
        warning is logged.
        """
        from mlflow.entities import Param, RunTag

        self._check_open()
        fresh: list[Param] = []
        changed: list[RunTag] = []
        for key, value in to_mlflow_params(params).items():
            previous = self._logged_params.get(key)
            if previous == value:
                continue
            if previous is not None:
                logging.getLogger(__name__).warning(
                    "param %r was logged as %r; keeping the new value %r as tag param_changed.%s",
                    key,
                    previous,
                    value,
                    key,
                )
                changed.append(RunTag(param_key_string(f"param_changed.{key}"), value))
                continue
            fresh.append(Param(key, value))
        for start in range(0, max(len(fresh), len(changed)), MAX_PARAMS_PER_BATCH):
            self._client.log_batch(
                self.run_id,
                params=fresh[start : start + MAX_PARAMS_PER_BATCH],
                tags=changed[start : start + MAX_PARAMS_PER_BATCH],
                synchronous=True,
            )
        self._logged_params.update({param.key: param.value for param in fresh})

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one value per metric at ``step`` (an int >= 0) in one batch.

        Values may be Python/numpy/torch scalars; None values are skipped. NaN
        and infinities are logged as MLflow stores them.
        """
        from mlflow.entities import Metric

        self._check_open()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        timestamp_ms = int(time.time() * 1000)
        batch: list[Metric] = []
        for key, value in metrics.items():
            if value is None:
                continue
            check_name(key)
            try:
                number = float(value.item() if hasattr(value, "item") else value)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"metric {key!r} must be a real scalar, got {value!r}") from None
            batch.append(Metric(key, number, timestamp_ms, step))
        self._pending.extend(batch)
        if (
            time.monotonic() - self._last_write >= self.buffer_seconds
            or len(self._pending) >= MAX_METRICS_PER_BATCH
        ):
            self.flush()

    def flush(self) -> None:
        """Write every buffered metric value now (a no-op when nothing is buffered)."""
        pending, self._pending = self._pending, []
        self._last_write = time.monotonic()
        for start in range(0, len(pending), MAX_METRICS_PER_BATCH):
            self._client.log_batch(
                self.run_id, metrics=pending[start : start + MAX_METRICS_PER_BATCH], synchronous=True
            )

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Copy a file or directory into the run's artifacts (under ``artifact_path`` if given)."""
        self._check_open()
        local = Path(path)
        if not local.exists():
            raise FileNotFoundError(f"artifact path {str(local)!r} does not exist")
        if local.is_dir():
            self._client.log_artifacts(self.run_id, str(local), artifact_path)
        else:
            self._client.log_artifact(self.run_id, str(local), artifact_path)

    def log_dict(self, obj: Mapping[str, Any], artifact_file: str) -> None:
        """Write ``obj`` as JSON to the run's artifacts under the name ``artifact_file``."""
        with tempfile.TemporaryDirectory(prefix="verity-artifact-") as tmp:
            local = Path(tmp) / Path(artifact_file).name
            local.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str), encoding="utf-8")
            parent = str(Path(artifact_file).parent)
            self.log_artifact(local, None if parent in ("", ".") else parent)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (values stringified)."""
        self._check_open()
        self._client.log_batch(self.run_id, tags=self._run_tags(tags), synchronous=True)

    def finish(self, status: str = "FINISHED") -> None:
        """Write buffered metrics, then mark the run FINISHED, FAILED or KILLED. Calling it again does nothing."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
        if self._finished:
            return
        try:
            self.flush()
        finally:
            self._client.set_terminated(self.run_id, status=status)
            self._finished = True

    # ---- conveniences -------------------------------------------------------
    @property
    def ui_command(self) -> str:
        """The shell command that opens this store in the MLflow UI."""
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish(
            "FINISHED" if exc_type is None else ("KILLED" if exc_type is KeyboardInterrupt else "FAILED")
        )

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError(
                f"run {self.run_id} is finished; open a new Tracker(run_id=...) to continue it"
            )
