"""Nothing of vLLM outlives its owner: kill a process that owns a VLLMRollout and count what is left.

The owner (tests/helpers/vllm_owner.py) starts an engine, generates once and reports its
descendant processes and the /dev/shm files it and they map; the test SIGKILLs it (no
shutdown runs) and checks that those processes and files are gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.tiny_models import save_char_qwen2
from helpers.vllm_required import require_vllm

require_vllm()

OWNER = Path(__file__).resolve().parents[1] / "helpers" / "vllm_owner.py"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _start_owner(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, dict]:
    save_char_qwen2(tmp_path / "model", seed=0)
    env = dict(os.environ, PYTHONPATH=str(OWNER.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    owner = subprocess.Popen(
        [sys.executable, str(OWNER), str(tmp_path / "model"), str(tmp_path / "cache"), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert owner.stdout is not None
    for line in owner.stdout:
        if line.startswith("READY "):
            return owner, json.loads(line[len("READY ") :])
    owner.wait()
    raise AssertionError(f"the owner exited ({owner.returncode}) before its engine was ready")


def _kill_and_wait(owner: subprocess.Popen, info: dict, timeout_s: float = 60) -> tuple[list[int], list[str]]:
    """SIGKILL the owner; return the descendants and segments still there after ``timeout_s`` at most."""
    os.kill(info["pid"], signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in info["descendants"] if _alive(pid)]
        left = [name for name in info["segments"] if (Path("/dev/shm") / name).exists()]
        if (not alive and not left) or time.monotonic() > deadline:
            return alive, left
        time.sleep(0.2)


def _cleanup(owner: subprocess.Popen, info: dict) -> None:
    """If the test failed, do not leave its processes behind."""
    if owner.poll() is None:
        owner.kill()
        owner.wait()
    for pid in info["descendants"]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_in_process_engine_has_nothing_to_leak(tmp_path):
    owner, info = _start_owner(tmp_path, "in_process")
    try:
        assert info["descendants"] == []  # no EngineCore, no workers
        assert info["segments"] == []  # no shared memory
        assert _kill_and_wait(owner, info) == ([], [])
        assert not _alive(info["pid"])
    finally:
        _cleanup(owner, info)


@pytest.mark.slow
def test_multi_process_engine_is_reaped_when_its_owner_dies(tmp_path):
    owner, info = _start_owner(tmp_path, "multi_process")
    try:
        assert len(info["descendants"]) >= 2  # EngineCore (+ its worker) and the reaper
        alive, left = _kill_and_wait(owner, info)
        assert alive == [], f"processes outlived their owner: {alive}"
        assert left == [], f"shared-memory segments outlived their owner: {left}"
    finally:
        _cleanup(owner, info)
