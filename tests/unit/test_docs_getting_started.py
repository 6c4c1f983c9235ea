"""Every ``bash`` and ``python`` block of docs/getting-started.md runs as written.

A block whose first line is ``# not run: <why>`` is left out (installs, training-sized runs);
every other block runs from the repository root, bash with ``-euo pipefail`` and this Python's
``bin`` first on the PATH (where ``verity`` is), Python in a fresh interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "getting-started.md"
NOT_RUN = re.compile(r"^# not run: \S")


def blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(bash|python)\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def runnable() -> list[tuple[str, str]]:
    return [(lang, code) for lang, code in blocks() if not code.startswith("# not run")]


def test_blocks_left_out_say_why_and_some_run() -> None:
    skipped = [code.splitlines()[0] for _, code in blocks() if code.startswith("# not run")]
    assert all(NOT_RUN.match(line) for line in skipped), skipped
    assert {lang for lang, _ in runnable()} == {"bash", "python"}


@pytest.mark.parametrize("lang,code", runnable(), ids=lambda v: v if v in ("bash", "python") else "")
def test_the_block_runs(lang: str, code: str) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{lang} block failed:\n{code}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    assert done.stdout.strip(), "the block printed nothing"
