"""The loss head's Triton kernels, checked on a CPU: their arithmetic through Triton's interpreter, and their compilation for sm_90 / sm_80.

The checks run in two child processes (``tests/helpers/triton_head_checks.py``): Triton must
be importable there, and ``TRITON_INTERPRET=1`` must be set before the kernels are defined;
this process, where vLLM's CPU build runs without Triton, never imports it. ``nox -s tests``
installs Triton into a folder of its own and names it in ``VERITY_TRITON_SITE``; then a
missing or broken install fails these tests instead of skipping them. Elsewhere they run when
Triton is importable and skip otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "packages" / "verity" / "src"
INTERPRET_CHECKS = [
    *(
        f"forward-{dtype}-t{t}-b{b}"
        for dtype in ("float32", "bfloat16")
        for t in ("1.0", "0.7")
        for b in ("4096w4", "2048w8")
    ),
    *(f"backward-{dtype}-t{t}" for dtype in ("float32", "bfloat16") for t in ("1.0", "0.7")),
    "rows-independent",
    "bad-arguments",
]
COMPILE_CHECKS = [
    "compile-forward-sm90",
    "compile-forward-sm80",
    "compile-backward-sm90",
    "compile-backward-sm80",
]


def _triton_path() -> str:
    """The folder to put first on the children's path ("" when Triton is importable here); skips without Triton."""
    site = os.environ.get("VERITY_TRITON_SITE")
    if site:
        if not (Path(site) / "triton" / "__init__.py").is_file():
            pytest.fail(
                f"VERITY_TRITON_SITE={site} holds no triton package (nox -s tests installs one there)"
            )
        return site
    if importlib.util.find_spec("triton") is None:
        pytest.skip(
            "triton is not installed (nox -s tests installs it in a folder of its own for these tests)"
        )
    return ""


def _run_checks(mode: str, tmp: Path) -> dict:
    site = _triton_path()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (site, str(TESTS), str(SRC), env.get("PYTHONPATH", "")) if p
    )
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default Triton 3.9 runs with; it warns when unset
    env.pop("TRITON_INTERPRET", None)
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    out = tmp / f"{mode}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "helpers.triton_head_checks", mode, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 or not out.is_file():
        pytest.fail(f"the {mode} checks did not run (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run_checks("interpret", tmp_path_factory.mktemp("triton"))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run_checks("compile", tmp_path_factory.mktemp("triton"))


@pytest.mark.parametrize("name", INTERPRET_CHECKS)
def test_kernels_match_float64_under_the_interpreter(interpreted: dict, name: str) -> None:
    assert name in interpreted, f"check {name} did not run; ran {sorted(interpreted)}"
    assert interpreted[name] == "ok", interpreted[name]


@pytest.mark.parametrize("name", COMPILE_CHECKS)
def test_kernels_compile_for_cuda(compiled: dict, name: str) -> None:
    assert name in compiled, f"check {name} did not run; ran {sorted(compiled)}"
    assert compiled[name] == "ok", compiled[name]


def test_forward_takes_one_exponential_per_logit(compiled: dict) -> None:
    """The SASS of the forward's loop: one ``ex2`` per logit (plus the step's rescale), 128-bit loads."""
    isa = compiled["isa"]["forward_sm90"]
    assert isa["ex2_per_logit"] <= 1.05, isa
    assert isa["instructions_per_logit"] <= 16, isa
    assert isa["wide_loads"] >= 1, isa  # the logits read 16 bytes at a time, not one element per load
