"""Issue #49 finding 8: the engines' INFO lines go to the worker's log file, not the console."""

from __future__ import annotations

import logging
import warnings

import pytest
from verity.controller.worker_logs import ENGINE_LOGGERS, setup_worker_logging


@pytest.fixture
def restore_loggers(monkeypatch):
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "1")  # restored afterwards; the setup may set it
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING")
    saved = {}
    for name in ENGINE_LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = (logger.level, logger.propagate, list(logger.handlers))
    with warnings.catch_warnings():
        yield
    for name, (level, propagate, handlers) in saved.items():
        logger = logging.getLogger(name)
        for h in logger.handlers:
            if h not in handlers:
                h.close()
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


def test_vllm_info_goes_to_the_worker_log_file_not_to_stderr(tmp_path, capsys, restore_loggers) -> None:
    path = setup_worker_logging(tmp_path / "logs", "actor+rollout", 1, on_cpu=True)
    assert path == tmp_path / "logs" / "worker-actor+rollout-1.log"
    logging.getLogger("vllm.v1.engine").info("Successfully reset prefix cache")
    logging.getLogger("megatron.core.utils").info("megatron detail")
    logging.getLogger("vllm").warning("out of KV cache blocks")
    for h in logging.getLogger("vllm").handlers + logging.getLogger("megatron").handlers:
        h.flush()
    err = capsys.readouterr().err
    assert "Successfully reset prefix cache" not in err and "megatron detail" not in err
    assert "out of KV cache blocks" in err  # a warning still reaches the user
    text = path.read_text()
    assert "Successfully reset prefix cache" in text and "megatron detail" in text
    assert "out of KV cache blocks" in text


def test_an_engine_console_handler_is_raised_to_warning(tmp_path, restore_loggers) -> None:
    own = logging.StreamHandler()
    logging.getLogger("vllm").addHandler(own)
    setup_worker_logging(tmp_path, "rollout", 0, on_cpu=False)
    assert own.level == logging.WARNING


def test_the_cuda_connections_warning_is_filtered_on_cpu_only(tmp_path, restore_loggers) -> None:
    message = (
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
    )
    setup_worker_logging(None, "actor", 0, on_cpu=False)
    with pytest.warns(UserWarning, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        warnings.warn(message, stacklevel=1)
    setup_worker_logging(None, "actor", 0, on_cpu=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn(message, stacklevel=1)
    assert not [w for w in seen if "CUDA_DEVICE_MAX_CONNECTIONS" in str(w.message)]


def test_the_trainer_tells_workers_their_log_folder(tmp_path) -> None:
    from verity.config import VerityConfig
    from verity.launch.roles import worker_env

    cfg = VerityConfig()
    cfg.trainer.output_dir = str(tmp_path / "run")
    cfg.trainer.device = "cpu"
    env = worker_env(cfg)
    assert env["VERITY_WORKER_LOG_DIR"] == str(tmp_path / "run" / "logs")
    assert env["VERITY_WORKER_DEVICE"] == "cpu"


def test_a_worker_host_sets_up_its_log_file_from_the_env(tmp_path, capsys, restore_loggers) -> None:
    from verity.controller.host import WorkerHost

    env = {"VERITY_WORKER_LOG_DIR": str(tmp_path), "VERITY_WORKER_GROUP": "actor", "RANK": "0"}
    env["VERITY_WORKER_DEVICE"] = "cpu"
    assert WorkerHost().setup(env, {}) == {}
    logging.getLogger("vllm.v1.worker").info("Successfully reset prefix cache")
    assert "Successfully reset prefix cache" not in capsys.readouterr().err
    assert "Successfully reset prefix cache" in (tmp_path / "worker-actor-0.log").read_text()
