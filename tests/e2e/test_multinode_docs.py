"""docs/multi-node.md's "Try it on one machine" block runs as written on a simulated cluster.

The one change: the embedded default is warm-started for 20 SFT steps in a private cache
folder instead of the preset's 3200 in ~/.cache (the layout and the run's path are the same;
the warm-start's length only changes what the model knows).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[2] / "docs" / "multi-node.md"


def _block() -> str:
    section = DOC.read_text().split("## Try it on one machine", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section has one Python block"
    return blocks[0]


def test_the_one_machine_block_runs_and_spans_two_nodes(tmp_path):
    import shutil
    import tempfile

    script = _block()
    short = f'"model.embedded_sft_steps=20", "model.embedded_cache_dir={tmp_path / "embedded"}", '
    assert script.count('"trainer.device=cpu", ') == 1
    script = script.replace('"trainer.device=cpu", ', '"trainer.device=cpu", ' + short)
    ray_tmp = tempfile.mkdtemp(prefix="vr-doc-", dir="/tmp")  # short: Ray's socket paths live under it
    os.makedirs(os.path.join(ray_tmp, "ray"))  # Cluster records its address under $RAY_TMPDIR/ray
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    bin_dir = str(Path(sys.executable).parent)  # the block calls `verity` from the PATH
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "fits        True" in done.stdout  # the diagnose half: the GPU layout fits the declared GPUs
    assert "verity: placement on 2 node(s):" in done.stdout
    ran = json.loads((tmp_path / "outputs" / "two-nodes" / "summary.json").read_text())["ran"]
    assert ran["nodes"] == "2" and ran["device"] == "cpu"
