"""Fault injection (verity.testing.faults): read once at import, inert when unset."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import verity.testing.faults as faults


@pytest.fixture
def reloaded(monkeypatch):
    """The faults module re-imported under the environment a test sets; restored afterwards."""

    def load(**env: str):
        for name in (faults.CRASH_ENV, faults.STALL_ENV):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return importlib.reload(faults)

    yield load
    monkeypatch.delenv(faults.CRASH_ENV, raising=False)
    monkeypatch.delenv(faults.STALL_ENV, raising=False)
    importlib.reload(faults)


def test_unset_hooks_do_nothing(reloaded, monkeypatch) -> None:
    module = reloaded()
    assert module.CRASH is None and module.STALL is None
    monkeypatch.setattr(module.time, "sleep", lambda s: pytest.fail("slept"))
    monkeypatch.setattr(module.os, "kill", lambda *a: pytest.fail("killed"))
    for _ in range(3):
        module.maybe_stall("update_actor")
        module.maybe_crash("step_end", 1)
    assert module._stall_calls == 0  # nothing counted when no stall is asked for


def test_stall_fires_on_the_named_call_only(reloaded, monkeypatch) -> None:
    module = reloaded(VERITY_DEBUG_STALL="update_actor:2:7.5")
    slept: list[float] = []
    monkeypatch.setattr(module.time, "sleep", slept.append)
    module.maybe_stall("generate")  # another method: neither counted nor slept
    module.maybe_stall("update_actor")
    assert slept == []
    module.maybe_stall("update_actor")
    assert slept == [7.5]
    module.maybe_stall("update_actor")
    assert slept == [7.5]


def test_crash_fires_at_the_named_point_and_step(reloaded, monkeypatch) -> None:
    module = reloaded(VERITY_DEBUG_CRASH_AT="save:4")
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(module.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    module.maybe_crash("step_end", 4)
    module.maybe_crash("save", 3)
    assert kills == []
    module.maybe_crash("save", 4)
    assert kills == [(os.getpid(), module.signal.SIGKILL)]


@pytest.mark.parametrize(
    ("name", "value"), [("VERITY_DEBUG_CRASH_AT", "later:4"), ("VERITY_DEBUG_STALL", "update_actor:3")]
)
def test_a_malformed_value_stops_the_import_naming_the_variable(name, value) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERITY_DEBUG_")}
    env[name] = value
    done = subprocess.run(
        [sys.executable, "-c", "import verity.testing.faults"], env=env, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert f"ValueError: {name}={value!r}" in done.stderr
