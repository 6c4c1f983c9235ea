"""ci/bench_gpu_head.py on a CPU: the sides that run there, the JSON, the options (no timed assertion)."""

from __future__ import annotations

import json

import pytest
from helpers.ci_scripts import load_ci_script

bench = load_ci_script("bench_gpu_head")


def test_a_cpu_dry_run_compares_inductor_and_torch_on_the_same_logits(tmp_path, capsys):
    out = tmp_path / "head.json"
    argv = ["--device", "cpu", "--rows", "16", "--vocab", "1000", "--warmup", "1", "--repeats", "1"]
    assert bench.main(argv + ["--temperature", "0.7", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    sides = result["sides"]
    assert set(sides) == {"inductor", "torch"}  # the Triton sides need CUDA
    assert sides["inductor"]["max_abs_diff_logprobs"] == 0.0  # the first side is the reference
    assert sides["torch"]["max_abs_diff_logprobs"] < 1e-4
    assert sides["inductor"]["backward_ms"] > 0 and sides["torch"]["forward_and_backward_ms"] > 0
    assert result["logits"] == {"rows": 16, "vocab": 1000, "dtype": "bfloat16", "bytes": 16 * 1000 * 2}
    assert "inductor" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--forward-configs", "4096"], "'4096' is not BLOCKxWARPS"),
        (["--backward-configs", "3000x4"], "block and warps must be powers of two"),
        (["--rows", "0"], "--rows: expected an int >= 1"),
        (["--temperature", "0"], "--temperature: expected > 0"),
    ],
)
def test_bad_options_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err
