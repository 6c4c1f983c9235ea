"""Embedded presets: a plug-in's own task, row format and warm-start teacher, chosen by model.embedded_preset."""

from __future__ import annotations

import pytest
from verity.config import ConfigError, load_config
from verity_toyworld.presets import (
    EMBEDDED_PRESETS,
    SFT_TEACHERS,
    EmbeddedSettings,
    format_rows,
    register_embedded_preset,
    register_sft_teacher,
)
from verity_toyworld.tasks.arithmetic import read_parquet_rows

SMALL_MODEL = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 64, "max_pos": 64}
TAUGHT: list[int] = []


def answer_line_teacher(rows, settings):
    """Answers ``<prefix>Answer: N`` (the prefix from the teacher's knobs); counts the rows it taught."""
    TAUGHT.append(len(rows))
    prefix = settings.teacher_config["prefix"]
    return [{**row, "response": f"{prefix}Answer: {row['reward_model']['ground_truth']}"} for row in rows]


PRESET = EmbeddedSettings(
    num_train=48,
    num_test=8,
    model=SMALL_MODEL,
    sft_steps=2,
    sft_batch_size=8,
    data_source="math_dapo",
    prompt_template="Q {prompt}",
    teacher="test_answer_line",
    teacher_config={"prefix": "ok "},
    eval_max_new_tokens=12,
)


@pytest.fixture(scope="module", autouse=True)
def registered():
    if "test_answer_line" not in SFT_TEACHERS.names():
        register_sft_teacher("test_answer_line", answer_line_teacher)
    if "test-preset" not in EMBEDDED_PRESETS.names():
        register_embedded_preset("test-preset", PRESET)


def test_the_default_preset_keeps_the_cache_key_it_had_before_presets_existed():
    assert EMBEDDED_PRESETS.get("default") == EmbeddedSettings()
    assert EmbeddedSettings().key() == "e8783976006bc067"  # entries built before stay valid
    # every new field enters the key once it leaves its default
    keys = {
        EmbeddedSettings(data_source="math_dapo").key(),
        EmbeddedSettings(prompt_template="> {prompt}").key(),
        EmbeddedSettings(teacher="other").key(),
        EmbeddedSettings(teacher_config={"a": 1}).key(),
        EmbeddedSettings(eval_max_new_tokens=17).key(),
    }
    assert len(keys) == 5 and EmbeddedSettings().key() not in keys


def test_format_rows_relabels_the_source_and_wraps_the_prompt():
    rows = [{"prompt": [{"role": "user", "content": "1+2="}], "data_source": "verity/arithmetic", "x": 1}]
    out = format_rows(rows, PRESET)
    assert (
        out[0]["prompt"] == [{"role": "user", "content": "Q 1+2="}] and out[0]["data_source"] == "math_dapo"
    )
    assert rows[0]["prompt"][0]["content"] == "1+2=" and out[0]["x"] == 1  # the input is not changed
    assert format_rows(rows, EmbeddedSettings()) is rows
    with pytest.raises(ValueError, match="prompt_template"):
        EmbeddedSettings(prompt_template="no field")


def test_a_run_builds_the_preset_it_names(tmp_path):
    from verity.launch.run import resolve_inputs

    cfg = load_config(
        [
            "model.embedded_preset=test-preset",
            f"model.embedded_cache_dir={tmp_path}",
            "model.embedded_sft_steps=3",
        ]
    )
    TAUGHT.clear()
    inputs = resolve_inputs(cfg)
    assert TAUGHT == [48]  # the preset's teacher wrote the warm-start's responses
    key = EmbeddedSettings(**{**PRESET.__dict__, "sft_steps": 3}).key()
    assert inputs.model_path == str(tmp_path / key / "model")
    rows = read_parquet_rows(inputs.train_files[0])
    assert {r["data_source"] for r in rows} == {"math_dapo"}
    assert all(r["prompt"][0]["content"].startswith("Q ") for r in rows)
    manifest = __import__("json").loads((tmp_path / key / "manifest.json").read_text())
    assert manifest["settings"]["teacher"] == "test_answer_line" and "sft_slipped_rows" not in manifest
    assert 0.0 <= manifest["test_greedy_accuracy"] <= 1.0  # scored by the math_dapo reward


def test_unknown_or_misplaced_presets_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.embedded_preset: unknown embedded preset 'nope'.*default"):
        load_config(["model.embedded_preset=nope"])
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="applies only to model.path=embedded"):
        load_config([f"model.path={model}", "model.embedded_preset=test-preset"])
    with pytest.raises(ConfigError, match="model.embedded_sft_steps must be >= 0"):
        load_config(["model.embedded_sft_steps=-1"])
