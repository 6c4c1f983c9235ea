"""nox sessions for verity.

    nox -s quickstart     GRPO on the embedded tiny model, before/after table
    nox -s tests          the test suite CI runs (CPU, no downloads)
    nox -s lint           ruff

Every session installs torch first (its CPU wheel is local on these machines;
without it pip would pull the multi-GB CUDA build), then the runtime against
``constraints.txt``.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "constraints.txt")
TORCH = "torch==2.13.0"

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]


def install_runtime(session: nox.Session, *extras: str) -> None:
    """Install torch first, then the runtime (editable) pinned by the constraints file."""
    session.install(TORCH)
    spec = "packages/verity"
    if extras:
        spec += "[" + ",".join(extras) + "]"
    session.install("-c", CONSTRAINTS, "-e", spec)


@nox.session
def tests(session: nox.Session) -> None:
    """The full CPU test suite (what CI runs)."""
    install_runtime(session, "test")
    env = {"PYTHONHASHSEED": "0", "MLFLOW_ALLOW_FILE_STORE": "true"}
    session.run("pytest", "-q", "-m", "not gpu", *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("-c", CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")


@nox.session
def quickstart(session: nox.Session) -> None:
    """GRPO on the embedded default: warm-start, evaluate, train, evaluate again."""
    install_runtime(session)
    out = session.posargs[0] if session.posargs else "outputs/quickstart"
    session.run("verity", "quickstart", f"output_dir={out}", env={"PYTHONHASHSEED": "0"})


@nox.session
def diagnose(session: nox.Session) -> None:
    """Print versions, hardware and Ray status (paste into bug reports)."""
    install_runtime(session)
    session.run("verity", "diagnose")
