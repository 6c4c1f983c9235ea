"""ci/bench_trl.py: s/step medians, the TRL/verity ratios, the table, the overrides, and the nightly's use of them.

Fake timings only: no training runs and no timed assertion here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.ci_scripts import load_ci_script

bench_trl = load_ci_script("bench_trl")
sides = load_ci_script("bench_trl_sides")
nightly = load_ci_script("nightly")


def _run(seconds: list[float], before: float | None = None, after: float | None = None) -> dict:
    return {
        "step_seconds": seconds,
        "accuracy_before": before,
        "accuracy_after": after,
        "wall_seconds": sum(seconds),
    }


def test_steady_median_drops_the_first_step() -> None:
    # the 9.0 s warm-up step would move the median of all four; without it the median is 1.0
    assert bench_trl.steady_median([9.0, 1.0, 0.5, 3.0]) == 1.0
    with pytest.raises(ValueError, match="at least 2 steps"):
        bench_trl.steady_median([1.0])


def test_ratio_is_trl_seconds_over_verity_seconds_per_shape() -> None:
    runs = {
        "quickstart": {
            "trl": [_run([5.0, 0.30, 0.30, 0.30], 0.5, 0.9)],
            "verity": [_run([7.0, 0.10, 0.20, 0.15], 0.5, 0.95)],
        },
        "512x8": {"trl": [_run([1.0, 2.0, 2.0])], "verity": [_run([1.0, 4.0, 4.0])]},
    }
    result = bench_trl.build_result(runs, {"rounds": 1})
    assert result["ratios"] == {
        "grpo_step_vs_trl_quickstart": pytest.approx(0.30 / 0.15),
        "grpo_step_vs_trl_512x8": pytest.approx(0.5),
    }
    quick = result["shapes"]["quickstart"]
    assert quick["trl"]["s_per_step"] == pytest.approx(0.30)
    assert quick["verity"]["accuracy_after"] == 0.95
    assert quick["verity"]["steps"] == 4
    json.dumps(result)  # the document is plain JSON


def test_rounds_take_the_median_of_each_runs_steady_median() -> None:
    runs = {
        "quickstart": {
            "trl": [_run([9.0, 1.0, 1.0]), _run([9.0, 3.0, 3.0]), _run([9.0, 2.0, 2.0])],
            "verity": [_run([9.0, 1.0, 1.0]), _run([9.0, 1.0, 1.0]), _run([9.0, 8.0, 8.0])],
        }
    }
    result = bench_trl.build_result(runs, {})
    assert result["shapes"]["quickstart"]["trl"]["s_per_step_per_round"] == [1.0, 3.0, 2.0]
    assert result["ratios"]["grpo_step_vs_trl_quickstart"] == pytest.approx(2.0)
    # each round's ratio: that round's TRL run over the verity run beside it (the nightly's spread)
    assert result["ratio_rounds"]["grpo_step_vs_trl_quickstart"] == pytest.approx([1.0, 3.0, 0.25])


def test_a_shape_missing_a_side_is_an_error() -> None:
    with pytest.raises(ValueError, match="no runs for \\['verity'\\]"):
        bench_trl.build_result({"quickstart": {"trl": [_run([1.0, 1.0])], "verity": []}}, {})


def test_table_shows_both_sides_accuracy_and_verdict() -> None:
    runs = {
        "quickstart": {
            "trl": [_run([1.0, 0.149], 0.516, 0.94)],
            "verity": [_run([1.0, 0.278], 0.516, 0.932)],
        },
        "512x8": {"trl": [_run([1.0, 2.0])], "verity": [_run([1.0, 1.0])]},
    }
    table = bench_trl.format_table(bench_trl.build_result(runs, {}))
    assert "| quickstart | TRL GRPOTrainer | 2 | 0.149 | 0.516 → 0.940 |" in table
    assert "| 512x8 | verity (quickstart preset) | 2 | 1.000 | — |" in table
    assert "grpo_step_vs_trl_quickstart = TRL s/step / verity s/step = 0.536" in table
    assert "slower" in table and "faster" in table


def test_run_bench_rejects_bad_arguments_before_running(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown \\['nope'\\]"):
        bench_trl.run_bench(["nope"], {}, 1, tmp_path, str(tmp_path))
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        bench_trl.run_bench(["quickstart"], {}, 0, tmp_path, str(tmp_path))
    with pytest.raises(ValueError, match="expected >= 2"):
        bench_trl.run_bench(["quickstart"], {"quickstart": 1}, 1, tmp_path, str(tmp_path))
    with pytest.raises(ValueError, match="trl_threads must be >= 1"):
        bench_trl.run_bench(["quickstart"], {}, 1, tmp_path, str(tmp_path), trl_threads=0)


@pytest.mark.parametrize("shape", list(bench_trl.SHAPES))
def test_verity_overrides_are_keys_the_quickstart_preset_accepts(shape: str, tmp_path: Path) -> None:
    from verity.cli.quickstart import preset_path
    from verity.config import load_config

    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_bytes(b"")
    model_dir = tmp_path / "cache" / "key" / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(
        json.dumps({"model_type": "qwen2"})
    )  # the validation looks for it; nothing is loaded
    job = bench_trl.SideJob(
        "verity",
        shape,
        7,
        str(tmp_path / "w"),
        str(model_dir),
        str(tmp_path / "train.parquet"),
        str(tmp_path / "test.parquet"),
    )
    spec = bench_trl.SHAPES[shape]
    cfg = load_config(sides.verity_overrides(job, spec, tmp_path / "out"), config_file=preset_path())
    assert cfg.trainer.total_steps == 7
    assert cfg.data.train_batch_size * cfg.rollout.n == spec.prompts * spec.samples
    assert cfg.data.max_response_length == spec.response_len
    assert cfg.actor.optim.lr == spec.lr
    assert cfg.trainer.val_before_train is spec.held_out
    if spec.model is None:
        assert cfg.model.path == "embedded"
        assert Path(cfg.model.embedded_cache_dir) == tmp_path / "cache"
    else:
        assert cfg.model.path == str(model_dir)


def test_nightly_compares_the_trl_ratios_and_names_a_regression() -> None:
    accepted = {"figures": {"bench.grpo_step_vs_trl_quickstart": {"value": 2.0}}}
    bench = nightly.merge_trl(
        {
            "ratios": {"train_vs_plain_torch": 1.0},
            "ratio_rounds": {"train_vs_plain_torch": [1.0] * 3},
            "exit_code": 0,
        },
        {
            "ratios": {"grpo_step_vs_trl_quickstart": 1.2},
            "ratio_rounds": {"grpo_step_vs_trl_quickstart": [1.1, 1.2, 1.3]},
            "exit_code": 0,
        },
    )
    assert bench["ratios"] == {"train_vs_plain_torch": 1.0, "grpo_step_vs_trl_quickstart": 1.2}
    assert bench["ratio_rounds"]["grpo_step_vs_trl_quickstart"] == [1.1, 1.2, 1.3]
    findings = {f.metric: f for f in nightly.compare_with_baseline({}, bench, accepted)}
    failed = findings["bench.grpo_step_vs_trl_quickstart"]
    assert not failed.ok and failed.ratio == pytest.approx(0.6)

    ok = nightly.merge_trl(
        {"ratios": {}},
        {
            "ratios": {"grpo_step_vs_trl_quickstart": 1.9},
            "ratio_rounds": {"grpo_step_vs_trl_quickstart": [1.8, 1.9, 2.0]},
            "exit_code": 0,
        },
    )
    assert all(f.ok for f in nightly.compare_with_baseline({}, ok, accepted))  # 5% down, MAD 5%: allowed 15%


def test_nightly_fails_when_the_trl_bench_fails() -> None:
    bench = nightly.merge_trl({"ratios": {}, "exit_code": 0}, {"exit_code": 1})
    findings = {f.metric: f for f in nightly.compare_with_baseline({}, bench, None)}
    assert not findings["bench_trl.run"].ok
    assert "exited 1" in findings["bench_trl.run"].note


def test_new_tokens_override_replaces_only_the_response_length() -> None:
    shape = bench_trl.SHAPES["512x8"]
    assert bench_trl._with_response_len(shape, None) is shape
    changed = bench_trl._with_response_len(shape, 8)
    assert changed.response_len == 8 and changed.model == shape.model and shape.response_len == 64


def test_extra_verity_layouts_get_their_own_ratio_and_row() -> None:
    runs = {
        "quickstart": {
            "trl": [_run([1.0, 0.30])],
            "verity": [_run([1.0, 0.40])],
            "verity-1x2": [_run([1.0, 0.15], 0.5, 0.9)],
        }
    }
    result = bench_trl.build_result(runs, {})
    assert result["ratios"]["grpo_step_vs_trl_quickstart"] == pytest.approx(0.75)
    assert result["ratios"]["grpo_step_vs_trl_quickstart_verity_1x2"] == pytest.approx(2.0)
    assert result["shapes"]["quickstart"]["ratio_verity-1x2"] == pytest.approx(2.0)
    table = bench_trl.format_table(result)
    assert "| quickstart | verity, 1x2 (workers x threads) | 2 | 0.150 | 0.500 → 0.900 |" in table
    assert "verity-1x2: TRL s/step / its s/step = 2.000" in table


@pytest.mark.parametrize("bad", ["2", "0x2", "1x", "ax2", "1x2x3"])
def test_a_bad_layout_is_refused_before_anything_runs(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"verity layout '{bad}'"):
        bench_trl.run_bench(["quickstart"], {}, 1, tmp_path, str(tmp_path), verity_layouts=[bad])
    assert not any(tmp_path.iterdir())  # nothing prepared


def test_a_layout_becomes_worker_and_thread_overrides(tmp_path: Path) -> None:
    from verity.cli.quickstart import preset_path
    from verity.config import load_config

    job = bench_trl.SideJob(
        "verity", "quickstart", 3, str(tmp_path / "w"), str(tmp_path / "c" / "k" / "m"), "", "", layout="1x2"
    )
    cfg = load_config(
        sides.verity_overrides(job, bench_trl.SHAPES["quickstart"], tmp_path / "out"),
        config_file=preset_path(),
    )
    assert (cfg.trainer.n_workers, cfg.trainer.cpus_per_worker) == (1, 2)


def test_a_trl_micro_batch_side_is_compared_with_verity() -> None:
    runs = {
        "512x8": {
            "trl": [_run([9.0, 50.0])],
            "verity": [_run([9.0, 25.0])],
            "trl-mb32": [_run([9.0, 40.0])],
        }
    }
    result = bench_trl.build_result(runs, {})
    assert result["ratios"]["grpo_step_vs_trl_512x8"] == pytest.approx(2.0)
    assert result["ratios"]["grpo_step_vs_trl_mb32_512x8"] == pytest.approx(1.6)
    assert result["shapes"]["512x8"]["ratio_vs_trl-mb32"] == pytest.approx(1.6)
    table = bench_trl.format_table(result)
    assert "| 512x8 | TRL GRPOTrainer, 32-row passes | 2 | 40.000 |" in table
    assert "vs trl-mb32: its s/step / verity s/step = 1.600" in table


@pytest.mark.parametrize("bad", [0, 12, 100])
def test_a_trl_micro_batch_that_does_not_divide_the_batch_is_refused(bad: int, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"trl micro-batch {bad}"):
        bench_trl.run_bench(["512x8"], {}, 1, tmp_path, str(tmp_path), trl_micro_batches=[bad])
    assert not any(tmp_path.iterdir())


def test_the_all_rows_side_trains_every_row_and_gets_its_own_ratio(tmp_path: Path) -> None:
    from verity.cli.quickstart import preset_path
    from verity.config import load_config

    runs = {
        "512x8": {
            "trl": [_run([9.0, 50.0])],
            "verity": [_run([9.0, 10.0])],
            "verity-all-rows": [_run([9.0, 25.0])],
        }
    }
    result = bench_trl.build_result(runs, {})
    assert result["ratios"]["grpo_step_vs_trl_512x8"] == pytest.approx(5.0)
    assert result["ratios"]["grpo_step_vs_trl_512x8_verity_all_rows"] == pytest.approx(2.0)
    table = bench_trl.format_table(result)
    assert "| 512x8 | verity, every row trained (actor.skip_zero_advantage=off) | 2 | 25.000 |" in table
    job = bench_trl.SideJob(
        "verity", "512x8", 3, str(tmp_path / "w"), str(tmp_path / "m"), "", "", all_rows=True
    )
    overrides = sides.verity_overrides(job, bench_trl.SHAPES["512x8"], tmp_path / "out")
    assert "actor.skip_zero_advantage=off" in overrides
    preset = [o for o in overrides if not o.startswith(("model.path", "data.train_files", "data.val_files"))]
    assert load_config(preset, config_file=preset_path()).actor.skip_zero_advantage == "off"


def test_bf16_sides_are_compared_with_each_other_only(tmp_path: Path) -> None:
    from verity.cli.quickstart import preset_path
    from verity.config import load_config

    runs = {
        "512x8": {
            "trl": [_run([9.0, 30.0])],
            "verity": [_run([9.0, 20.0])],
            "verity-all-rows": [_run([9.0, 24.0])],
            "trl-mb32": [_run([9.0, 19.0])],
            "trl-bf16": [_run([9.0, 18.0])],
            "verity-bf16": [_run([9.0, 6.0])],
            "verity-bf16-all-rows": [_run([9.0, 9.0])],
            "trl-bf16-eager": [_run([9.0, 15.0])],
            "trl-bf16-mb32": [_run([9.0, 12.0])],
        }
    }
    result = bench_trl.build_result(runs, {})
    ratios = result["ratios"]
    assert ratios["grpo_step_vs_trl_512x8"] == pytest.approx(1.5)  # float32 pair untouched
    assert ratios["grpo_step_vs_trl_512x8_verity_all_rows"] == pytest.approx(30 / 24)
    assert ratios["grpo_step_vs_trl_mb32_512x8"] == pytest.approx(19 / 20)
    assert ratios["grpo_step_vs_trl_bf16_512x8"] == pytest.approx(3.0)  # trl-bf16 / verity-bf16
    assert ratios["grpo_step_vs_trl_bf16_512x8_verity_bf16_all_rows"] == pytest.approx(2.0)
    assert ratios["grpo_step_vs_trl_bf16_eager_512x8"] == pytest.approx(2.5)  # against verity-bf16
    assert ratios["grpo_step_vs_trl_bf16_mb32_512x8"] == pytest.approx(2.0)
    assert bench_trl.trl_side_name(32, bf16=True) == "trl-bf16-mb32"
    assert not any("verity_bf16" in k and "trl_bf16" not in k for k in ratios)  # never across precisions
    table = bench_trl.format_table(result)
    assert "| 512x8 | TRL GRPOTrainer, bf16=True | 2 | 18.000 |" in table
    assert "vs trl-bf16: its s/step / verity-bf16 s/step = 3.000" in table
    assert "verity-bf16-all-rows: trl-bf16 s/step / its s/step = 2.000" in table
    assert "| 512x8 | TRL GRPOTrainer, bf16=True, 32-row passes | 2 | 12.000 |" in table
    with pytest.raises(ValueError, match="no 'trl-bf16' side to compare with"):
        bench_trl.build_result({"512x8": {k: v for k, v in runs["512x8"].items() if k != "trl-bf16"}}, {})

    job = bench_trl.SideJob("verity", "512x8", 3, str(tmp_path / "w"), str(tmp_path / "m"), "", "", bf16=True)
    overrides = sides.verity_overrides(job, bench_trl.SHAPES["512x8"], tmp_path / "out")
    preset = [o for o in overrides if not o.startswith(("model.path", "data.train_files", "data.val_files"))]
    cfg = load_config(preset, config_file=preset_path())
    assert cfg.actor.fsdp2.mixed_precision is True and cfg.rollout.dtype == "bfloat16"
    assert cfg.actor.fsdp2.attn_implementation == "eager" and cfg.model.attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="trl_eager adds a bf16 TRL side"):
        bench_trl.run_bench(["512x8"], {}, 1, tmp_path, str(tmp_path), trl_eager=True)


def test_sides_that_cannot_be_compared_are_refused_before_any_side_runs(tmp_path, monkeypatch) -> None:
    def no_compute(*args, **kwargs):
        raise AssertionError("a side started although the run could never give a ratio")

    monkeypatch.setattr(bench_trl, "prepare_inputs", no_compute)
    monkeypatch.setattr(bench_trl, "run_side_process", no_compute)
    only = ["trl-bf16-compiled", "verity-bf16-all-rows-compiled"]  # neither reference side of bf16
    with pytest.raises(ValueError, match="no 'verity-bf16' side to compare with"):
        bench_trl.run_bench(
            ["512x8"],
            {},
            1,
            tmp_path,
            str(tmp_path),
            all_rows=True,
            bf16=True,
            compile_sides=True,
            only_sides=only,
        )
    bench_trl.check_sides(["512x8"], ["trl-bf16", "verity-bf16", *only])  # with them it can


def test_compile_adds_a_compiled_twin_of_each_bf16_side(tmp_path: Path, monkeypatch) -> None:
    from verity.cli.quickstart import preset_path
    from verity.config import load_config

    jobs: dict[str, object] = {}

    def fake_side(job, out_file):  # noqa: ANN001, ANN202
        side = Path(job.workdir).name.removeprefix("512x8-").removesuffix("-0")
        jobs[side] = job
        return _run([9.0, {"trl-bf16-compiled": 15.0, "verity-bf16-all-rows-compiled": 6.0}.get(side, 10.0)])

    monkeypatch.setattr(bench_trl, "run_side_process", fake_side)
    monkeypatch.setattr(
        bench_trl, "prepare_inputs", lambda *a: {"model_dir": "m", "train_file": "", "test_file": ""}
    )
    result = bench_trl.run_bench(
        ["512x8"],
        {"512x8": 2},
        1,
        tmp_path,
        str(tmp_path),
        trl_micro_batches=[32],
        all_rows=True,
        bf16=True,
        compile_sides=True,
    )
    compiled = {side for side, job in jobs.items() if job.compile}
    assert compiled == {
        "trl-bf16-compiled",
        "verity-bf16-compiled",
        "verity-bf16-all-rows-compiled",
        "trl-bf16-mb32-compiled",
    }
    assert all(jobs[s].bf16 for s in compiled)  # compiled sides are bf16 sides, compared with bf16 ones
    assert jobs["verity-bf16-all-rows-compiled"].all_rows and not jobs["verity-bf16-compiled"].all_rows
    assert jobs["trl-bf16-mb32-compiled"].trl_micro_batch == 32
    ratios = result["ratios"]
    assert ratios["grpo_step_vs_trl_bf16_512x8_verity_bf16_all_rows_compiled"] == pytest.approx(10 / 6)
    assert ratios["grpo_step_vs_trl_bf16_compiled_512x8"] == pytest.approx(15 / 10)  # against verity-bf16
    assert result["shapes"]["512x8"]["trl-bf16-compiled"]["step_seconds_per_round"] == [[9.0, 15.0]]
    table = bench_trl.format_table(result)
    assert "| 512x8 | TRL GRPOTrainer, bf16=True, torch_compile=True | 2 | 15.000 |" in table
    assert "| 512x8 | verity, bf16, compiled layers, every row trained | 2 | 6.000 |" in table
    assert "TRL GRPOTrainer, bf16=True, 32-row passes, torch_compile=True" in table
    with pytest.raises(ValueError, match="compile_sides adds compiled bf16 sides"):
        bench_trl.run_bench(["512x8"], {}, 1, tmp_path, str(tmp_path), compile_sides=True)

    overrides = sides.verity_overrides(
        jobs["verity-bf16-compiled"], bench_trl.SHAPES["512x8"], tmp_path / "o"
    )
    preset = [o for o in overrides if not o.startswith(("model.path", "data.train_files", "data.val_files"))]
    cfg = load_config(preset, config_file=preset_path())
    assert cfg.actor.fsdp2.compile is True and cfg.actor.fsdp2.mixed_precision is True


def test_a_run_of_some_sides_compares_each_with_its_counterpart(tmp_path: Path, monkeypatch) -> None:
    # the nightly's compute-bound pair: TRL's default bf16 beside verity's compiled bf16, every row
    runs = {"512x8": {"trl-bf16": [_run([9.0, 18.0])], "verity-bf16-all-rows-compiled": [_run([9.0, 6.0])]}}
    result = bench_trl.build_result(runs, {})
    assert result["ratios"] == {
        "grpo_step_vs_trl_bf16_512x8_verity_bf16_all_rows_compiled": pytest.approx(3.0)
    }
    assert "ratio" not in result["shapes"]["512x8"]  # no float32 pair ran
    table = bench_trl.format_table(result)
    assert "512x8: TRL s/step / verity s/step, side by side:" in table
    assert "verity-bf16-all-rows-compiled: trl-bf16 s/step / its s/step = 3.000" in table
    two = [_run([1.0, 2.0])]
    with pytest.raises(ValueError, match="no 'trl-bf16' side to compare with"):
        bench_trl.build_result({"512x8": {"trl": two, "verity": two, "verity-bf16": two}}, {})
    with pytest.raises(ValueError, match="'trl-bf16' has no verity side of its precision"):
        bench_trl.build_result({"512x8": {"trl": two, "verity": two, "trl-bf16": two}}, {})

    planned: list[str] = []
    monkeypatch.setattr(
        bench_trl, "run_side_process", lambda job, out: planned.append(job) or _run([9.0, 6.0])
    )
    monkeypatch.setattr(
        bench_trl, "prepare_inputs", lambda *a: {"model_dir": "m", "train_file": "", "test_file": ""}
    )
    only = ["trl-bf16", "verity-bf16-all-rows-compiled"]
    result = bench_trl.run_bench(
        ["512x8"],
        {"512x8": 2},
        1,
        tmp_path,
        str(tmp_path),
        all_rows=True,
        bf16=True,
        compile_sides=True,
        only_sides=only,
    )
    assert [(j.side, j.bf16, j.compile, j.all_rows) for j in planned] == [
        ("trl", True, False, False),
        ("verity", True, True, True),
    ]
    assert result["settings"]["sides"] == only
    with pytest.raises(ValueError, match=r"sides \['verity-bf16-compiled'\] are not planned"):
        bench_trl.run_bench(
            ["512x8"], {}, 1, tmp_path, str(tmp_path), bf16=True, only_sides=["verity-bf16-compiled"]
        )


def test_the_nightly_runs_the_compute_bound_pair_and_fails_when_it_fails(tmp_path: Path, monkeypatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(nightly.subprocess, "call", lambda cmd, cwd=None: calls.append(cmd) or 4)
    pair = nightly.run_bench_trl(
        tmp_path, args=nightly.NIGHTLY_COMPUTE_BOUND_ARGS, name="bench_trl_compute_bound"
    )
    assert pair == {"exit_code": 4}
    cmd = calls[-1]
    assert cmd[cmd.index("--out") + 1] == str(tmp_path / "bench_trl_compute_bound.json")
    # the pair's own --shapes comes last, so argparse keeps it
    assert [cmd[i + 1] for i, c in enumerate(cmd) if c == "--shapes"][-1] == "512x8"
    assert cmd[cmd.index("--sides") + 1] == "trl-bf16,verity-bf16-all-rows-compiled"
    bench = nightly.merge_trl({"ratios": {}, "exit_code": 0}, {"exit_code": 0, "ratios": {"a": 1.0}})
    bench = nightly.merge_trl(bench, pair, key="trl_compute_bound")
    findings = {f.metric: f for f in nightly.compare_with_baseline({}, bench, {})}
    assert findings["bench.a"].ok and not findings["bench_trl_compute_bound.run"].ok
    assert "bench_trl.run" not in findings

    # the sides the pair names are planned by its options, and give the ratio the baseline holds
    monkeypatch.setattr(
        bench_trl, "run_side_process", lambda job, out: _run([9.0, 6.0 if job.compile else 18.0])
    )
    monkeypatch.setattr(
        bench_trl, "prepare_inputs", lambda *a: {"model_dir": "m", "train_file": "", "test_file": ""}
    )
    out = tmp_path / "pair.json"
    argv = [*nightly.NIGHTLY_COMPUTE_BOUND_ARGS, "--out", str(out), "--workdir", str(tmp_path / "wd")]
    assert bench_trl.main(argv) == 0  # bench_trl.py's own parser plans the two sides from these options
    result = json.loads(out.read_text())
    assert result["settings"]["sides"] == ["trl-bf16", "verity-bf16-all-rows-compiled"]
    assert result["ratios"] == {
        "grpo_step_vs_trl_bf16_512x8_verity_bf16_all_rows_compiled": pytest.approx(3.0)
    }
