"""The embedded model's settings: a named preset layer, shown by `verity config show`, under the user's keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import verity.config
from verity.config import load_config
from verity.config.model_presets import model_preset, preset_layer
from verity_toyworld.presets import CONFIG_PRESET

EMBEDDED_PRESET = CONFIG_PRESET.stem  # embedded-tiny
PRESETS_DIR = Path(verity.config.__file__).parent / "presets"  # the runtime's own: quickstart.yaml

# what model.path=embedded runs took for these keys before they became a named preset
BEFORE = {
    "data.max_prompt_length": 48,
    "data.max_response_length": 8,
    "actor.micro_batch_size": 128,
    "actor.fsdp2.sharding": "replicate",
    "actor.optim.lr": 3.0e-5,
    "trainer.total_steps": 100,
    "trainer.val_every": 50,
}


def value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_preset_file_holds_the_settings_embedded_runs_had_and_is_a_valid_config_file():
    assert model_preset(CONFIG_PRESET) == BEFORE
    cfg = load_config([], config_file=CONFIG_PRESET)  # its keys are schema keys
    assert {key: value(cfg, key) for key in BEFORE} == BEFORE


def test_the_layer_sets_unset_keys_records_them_and_a_user_key_wins():
    cfg = load_config([])
    layer = preset_layer(cfg)
    assert layer is not None and layer.name == EMBEDDED_PRESET and layer.applied == BEFORE
    assert {key: value(cfg, key) for key in BEFORE} == BEFORE
    mine = load_config(["actor.optim.lr=1e-6", "trainer.total_steps=7"])
    assert (mine.actor.optim.lr, mine.trainer.total_steps) == (1e-6, 7)
    assert set(preset_layer(mine).applied) == set(BEFORE) - {"actor.optim.lr", "trainer.total_steps"}
    assert "actor.optim.lr" not in preset_layer(mine).describe()
    assert preset_layer(load_config(["actor.engine=megatron"])).applied.keys() == BEFORE.keys() - {
        "actor.fsdp2.sharding"
    }  # an engine that does not read actor.fsdp2


def test_a_real_checkpoint_has_no_preset(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    cfg = load_config([f"model.path={tmp_path}"])
    assert preset_layer(cfg) is None and cfg.actor.optim.lr == 1e-6


def test_the_quickstart_sets_every_key_itself():
    """So the preset layer changes nothing in `verity quickstart`'s runs."""
    cfg = load_config([], config_file=PRESETS_DIR / "quickstart.yaml", preset=True)
    layer = preset_layer(cfg)
    assert layer is not None and layer.applied == {} and "sets nothing" in layer.describe()


def test_config_show_names_the_preset_and_marks_each_key_it_set(capsys):
    from verity.cli.main import main as verity

    assert verity(["config", "show", "actor.optim.lr=1e-6"]) == 0
    shown = capsys.readouterr().out
    first = shown.splitlines()[0]
    assert first.startswith(
        f"# preset {EMBEDDED_PRESET} (model.path=embedded) sets data.max_prompt_length=48"
    )
    lines = {line.strip().split(":")[0]: line for line in shown.splitlines() if ": " in line}
    assert f"[preset {EMBEDDED_PRESET}]" in lines["total_steps"]
    assert "preset" not in lines["lr"]  # the user's key
    assert verity(["config", "show", "trainer.val_every"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"trainer.val_every: 50  # [preset {EMBEDDED_PRESET}]"


@pytest.mark.parametrize("section", ["actor.optim", "data"])
def test_a_section_keeps_its_dotted_prefix_for_the_marks(section, capsys):
    from verity.cli.main import main as verity

    assert verity(["config", "show", section]) == 0
    marked = [line for line in capsys.readouterr().out.splitlines() if f"[preset {EMBEDDED_PRESET}]" in line]
    wanted = [key for key in BEFORE if key.startswith(section + ".")]
    assert len(marked) == len(wanted) > 0
