"""ci/gpu_checks.sh, dry-run on a CPU with the tiny model: its steps, their summary lines and the one archive that comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",  # python3: this interpreter's
        OUT=str(tmp_path / "out"),
        BENCH_ARGS="--model tiny --device cpu --rows 2 --prompt-len 4 --response-len 4",
        SIDES="update-verity",
        ONE_SIDE="update-verity",
        SKIP="pytest,head,profile",
        SDPA_BACKENDS="math",
        MICRO_ROWS="2",
        **extra,
    )
    return env


def _run(env: dict[str, str]) -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "ci" / "gpu_checks.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_dry_run_packs_each_steps_output_into_one_archive(tmp_path):
    _run(_env(tmp_path))
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu-checks.tar.gz", "summary.txt"]
    steps = [line.split()[:2] for line in (out / "summary.txt").read_text().splitlines()]
    assert steps == [["bench-micro2", "rc=0"], ["sdpa-math-micro2", "rc=0"]]
    with tarfile.open(out / "gpu-checks.tar.gz") as tar:
        names = set(tar.getnames())
        sdpa = json.load(tar.extractfile("gpu-checks/sdpa-math-micro2.json"))
        bench = json.load(tar.extractfile("gpu-checks/bench-micro2.json"))
    assert bench["config"]["process_per_side"] is True  # each bench side in a fresh process
    assert {"gpu-checks/machine.txt", "gpu-checks/bench-micro2.json", "gpu-checks/bench-micro2.log"} <= names
    assert sdpa["config"]["sdpa_backend"] == "math" and "median_seconds" in sdpa["sides"]["update-verity"]


def test_steps_past_the_calls_time_are_skipped_and_say_so(tmp_path):
    """TOTAL_S too short for any step: each is skipped with a line, and the archive still comes back."""
    _run(_env(tmp_path, TOTAL_S="10"))
    out = tmp_path / "out"
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == ["bench-micro2 skipped", "sdpa-math-micro2 skipped"]
    with tarfile.open(out / "gpu-checks.tar.gz") as tar:
        assert {"gpu-checks/machine.txt", "gpu-checks/summary.txt"} <= set(tar.getnames())


@pytest.mark.parametrize(("mib", "rows"), [("81559", 32), ("143771", 64), ("[N/A]", 32)])
def test_the_micro_batch_follows_the_gpus_memory(tmp_path, mib, rows):
    """Unset MICRO_ROWS: 64-row micro-batches (~100 GiB) on an H200's 141 GB, 32 on an H100's 80 or unknown."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho {mib}\n")
    fake.chmod(0o755)
    env = _env(tmp_path, TOTAL_S="10")
    del env["MICRO_ROWS"]
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    _run(env)
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == [f"bench-micro{rows} skipped", f"sdpa-math-micro{rows} skipped"]


def test_the_default_sides_are_the_benchs():
    """A misspelt default side would cost a GPU session its one call: each must be one bench_gpu runs."""
    import re

    from helpers.ci_scripts import load_ci_script

    sides = load_ci_script("bench_gpu").SIDES
    script = (ROOT / "ci" / "gpu_checks.sh").read_text()
    defaults = re.findall(r'\$\{(?:SIDES|ONE_SIDE):-([^}]+)\}', script)
    assert len(defaults) == 2
    named = [side for default in defaults for side in default.split(",")]
    assert "update-verity-cudagraphs" in named and set(named) <= set(sides)
