"""ci/bench_gpu.py: the model's parameter and FLOP counts, the sides on the tiny shape (CPU), the options.

No timed assertion: the run checks that every side ran, counted what it trained and wrote its JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.ci_scripts import load_ci_script

pytestmark = pytest.mark.slow  # the benchmark sides run for real on the tiny shape

bench = load_ci_script("bench_gpu")


def _tiny_argv(out: Path, extra: str) -> list[str]:
    """The tiny model on the CPU, generation sized down, plus ``extra`` options."""
    generation = "--gen-rows 2 --gen-prompt-len 4 --gen-new-tokens 4 --gen-repeats 1"
    return ["--model", "tiny", "--device", "cpu", "--out", str(out), *generation.split(), *extra.split()]


def test_parameter_count_is_qwen25_05b_and_matches_a_built_model():
    counts = bench.param_counts(bench.QWEN25_05B)
    assert counts["body"] + counts["embedding"] == 494_032_768  # Qwen2.5-0.5B's published count
    model = bench.build_model(bench.TINY, torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) == sum(bench.param_counts(bench.TINY).values())


def test_training_flops_of_a_row_by_hand():
    shape = bench.TINY
    counts = bench.param_counts(shape)
    p, r = 16, 8
    by_hand = (
        6 * counts["body"] * (p + r)
        + 6 * shape["vocab_size"] * shape["hidden_size"] * (r + 1)
        + 6 * shape["num_hidden_layers"] * shape["hidden_size"] * (p + r) ** 2
    )
    assert bench.training_flops_per_row(shape, p, r) == pytest.approx(by_hand)


def test_every_side_runs_on_the_tiny_shape_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "result.json"
    code = bench.main(
        _tiny_argv(out, "--rows 4 --micro-rows 2 --prompt-len 8 --response-len 8 --warmup 1 --steps 1")
        + ["--sides", "update-verity,update-verity-autograd-head,update-torch,generate-verity,generate-hf"]
    )
    assert code == 0
    result = json.loads(out.read_text())
    sides = result["sides"]
    assert set(sides) == {
        "update-verity",
        "update-verity-autograd-head",
        "update-torch",
        "generate-verity",
        "generate-hf",
    }
    assert sides["update-verity"]["engine_tokens"] == 4 * 16
    assert sides["generate-verity"]["response_tokens"] == sides["generate-hf"]["response_tokens"] == 2 * 4
    assert result["environment"]["device"] == "cpu" and result["datasheet_peak_flops"] is None
    assert sides["update-verity"]["mfu_vs_datasheet"] is None  # no peak known for a CPU
    for key in ("update_verity_vs_torch", "update_verity_vs_autograd_head", "generate_verity_vs_hf"):
        assert result["summary"][key] > 0
    assert "update_verity_vs_torch" in capsys.readouterr().out


def test_a_failing_side_is_recorded_and_the_run_exits_nonzero(tmp_path, monkeypatch):
    def boom(args, device):
        raise RuntimeError("planted")

    monkeypatch.setattr(bench, "generate_hf", boom)
    out = tmp_path / "r.json"
    code = bench.main(_tiny_argv(out, "--sides generate-hf"))
    assert code == 1
    assert "RuntimeError: planted" in json.loads(out.read_text())["sides"]["generate-hf"]["error"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sides", "update-nothing", "--device", "cpu"], "--sides: unknown ['update-nothing']"),
        (["--rows", "0", "--device", "cpu"], "--rows: expected an int >= 1"),
    ],
)
def test_bad_options_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_device_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([])
    assert "no CUDA device here" in capsys.readouterr().err


def test_the_compiled_sides_run_and_profile_on_the_tiny_shape(tmp_path):
    from verity.engines.compiled_layers import compile_unavailable_reason

    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"inductor cannot compile here: {reason}")
    out, prof = tmp_path / "result.json", tmp_path / "prof"
    sides = "update-verity-compiled,update-verity-compiled-eager-head,update-torch-compiled"
    argv = _tiny_argv(out, "--rows 4 --micro-rows 2 --prompt-len 8 --response-len 8 --warmup 1 --steps 1")
    assert bench.main(argv + ["--sides", sides, "--profile", str(prof)]) == 0
    result = json.loads(out.read_text())["sides"]
    assert result["update-verity-compiled"]["compiled_head"] is True
    assert result["update-verity-compiled-eager-head"]["compiled_head"] is False
    assert result["update-verity-compiled"]["compiled_layers"] is True
    assert {p.name for p in prof.iterdir()} == {f"{s}.txt" for s in sides.split(",")}  # no device: no gaps


def test_device_gaps_are_the_holes_between_the_kernels():
    bench_gpu_profile = load_ci_script("bench_gpu_profile")

    kernels = [(100.0, 110.0, "a"), (105.0, 112.0, "b"), (120.0, 130.0, "c"), (131.0, 140.0, "d")]
    gaps = bench_gpu_profile.device_gaps(kernels)
    assert gaps["span_ms"] == pytest.approx(0.040) and gaps["busy_ms"] == pytest.approx(0.031)
    assert gaps["idle_ms"] == pytest.approx(0.009)
    assert gaps["gaps"][0] == (pytest.approx(0.012), pytest.approx(0.008), "b", "c")
    assert bench_gpu_profile.device_gaps([])["idle_ms"] == 0.0


@pytest.mark.parametrize(("backend", "runs"), [("math", True), ("cudnn", False)])
def test_the_sdpa_backend_is_pinned_not_a_preference(tmp_path, backend, runs):
    """``math`` runs on a CPU; ``cudnn`` cannot, and the side fails rather than falling back to another kernel."""
    out = tmp_path / "result.json"
    argv = _tiny_argv(out, "--rows 2 --micro-rows 2 --prompt-len 4 --response-len 4 --warmup 1 --steps 1")
    code = bench.main(argv + ["--sides", "update-verity", "--sdpa-backend", backend])
    result = json.loads(out.read_text())
    assert result["config"]["sdpa_backend"] == backend
    assert code == (0 if runs else 1)
    if not runs:
        assert "No viable backend for scaled_dot_product_attention" in result["sides"]["update-verity"]["error"]


def test_process_per_side_runs_each_side_in_its_own_process_and_keeps_the_ratios(tmp_path, capsys):
    import os

    out = tmp_path / "result.json"
    argv = _tiny_argv(out, "--rows 2 --micro-rows 2 --prompt-len 4 --response-len 4 --warmup 1 --steps 1")
    code = bench.main(argv + ["--sides", "update-verity,update-torch", "--process-per-side"])
    assert code == 0
    result = json.loads(out.read_text())
    sides = result["sides"]
    assert list(sides) == ["update-verity", "update-torch"]
    pids = {sides["update-verity"]["pid"], sides["update-torch"]["pid"]}
    assert len(pids) == 2 and os.getpid() not in pids
    assert sides["update-verity"]["engine_tokens"] == 2 * 8
    assert result["summary"]["update_verity_vs_torch"] == pytest.approx(
        sides["update-verity"]["tokens_per_s"] / sides["update-torch"]["tokens_per_s"]
    )
    assert result["config"]["process_per_side"] is True and result["environment"]["device"] == "cpu"
    assert set(result["measured_matmul_flops_per_side"]) == {"update-verity", "update-torch"}
    assert "update_verity_vs_torch" in capsys.readouterr().out


def test_process_per_side_records_a_side_whose_process_died_and_exits_nonzero(tmp_path, monkeypatch):
    import subprocess

    calls = []

    def killed(cmd, check):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, -9)

    monkeypatch.setattr(subprocess, "run", killed)  # the module bench_gpu_processes calls
    out = tmp_path / "r.json"
    code = bench.main(_tiny_argv(out, "--sides update-torch,generate-hf --process-per-side"))
    assert code == 1
    sides = json.loads(out.read_text())["sides"]
    assert "exited with -9 before writing its result" in sides["update-torch"]["error"]
    assert "exited with -9" in sides["generate-hf"]["error"]
    assert [c[len(c) - 1 - c[::-1].index("--sides") + 1] for c in calls] == ["update-torch", "generate-hf"]
    assert all("--process-per-side" not in c for c in calls)
