"""`verity eval RUN` without --data: the held-out data the run validated on, or one sentence why not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from verity.cli.main import main as verity


@pytest.fixture(scope="module")
def model_and_test(tmp_path_factory) -> dict[str, Path]:
    """An untrained tiny model (HF folder) and a 6-row arithmetic test split."""
    import torch
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tasks.arithmetic import ArithmeticConfig, write_splits
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    root = tmp_path_factory.mktemp("heldout")
    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=16, layers=1, heads=2, kv_heads=1, intermediate=32)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    config = ArithmeticConfig(digits=1, operations="+", style="expr")
    files = write_splits(root / "data", num_train=4, num_test=6, seed=0, config=config)
    return {"model": root / "model", "test": Path(files["test"])}


def _run_folder(root: Path, workdir: Path, overrides: list[str], monkeypatch, model: Path) -> Path:
    """A run folder with one complete checkpoint whose saved config is ``overrides``; its export is ``model``."""
    from verity.checkpoint import layout
    from verity.checkpoint.state import TrainerState
    from verity.config import config_to_dict, load_config

    run = root / "run"
    saved = config_to_dict(load_config([*overrides, f"trainer.output_dir={run}"]))
    tmp = run / "checkpoints" / "step_2.tmp"
    tmp.mkdir(parents=True)
    TrainerState(step=2, total_steps=2, dataloader={}, kl_coef=None, run_id=None, tracking_uri=None,
                 config_hash="h", config=saved, working_dir=str(workdir)).write(tmp)  # fmt: skip
    layout.commit(tmp, run / "checkpoints" / "step_2")
    monkeypatch.setattr("verity.checkpoint.export.export_hf", lambda ckpt, out, role: str(model))
    return run


def test_a_run_is_evaluated_on_its_own_val_files(model_and_test, tmp_path, monkeypatch, capsys) -> None:
    """data.val_files (relative, read against the folder verity train ran in), from another folder."""
    workdir = tmp_path / "project"
    (workdir / "data").mkdir(parents=True)
    (workdir / "data" / "val.parquet").write_bytes(model_and_test["test"].read_bytes())
    monkeypatch.chdir(workdir)  # where verity train ran
    run = _run_folder(tmp_path, workdir, ["data.train_files=[data/val.parquet]", "data.val_files=[data/val.parquet]",
                      f"model.path={model_and_test['model']}", "data.max_response_length=3"], monkeypatch, model_and_test["model"])  # fmt: skip
    monkeypatch.chdir(tmp_path)
    report = tmp_path / "report.json"
    code = verity(["eval", str(run), "--json", str(report)])
    err = capsys.readouterr().err
    assert code == 0, err
    saved = json.loads(report.read_text())
    assert saved["settings"]["files"] == [str(workdir / "data" / "val.parquet")]
    assert saved["settings"]["max_new_tokens"] == 3 and saved["prompts"] == 6  # the run's budget, all rows
    assert f"data: the run's data.val_files: {workdir / 'data' / 'val.parquet'}" in err
    (workdir / "data" / "val.parquet").unlink()
    assert verity(["eval", str(run)]) == 2
    assert "the run's data.val_files: no such file(s) now: data/val.parquet" in capsys.readouterr().err


def test_an_embedded_run_is_evaluated_on_its_presets_held_out_split(
    model_and_test, tmp_path, monkeypatch, capsys
):
    from verity_toyworld import build as embedded

    built = []

    def fake_build(cache_dir, sft_steps=None, *, settings=None, **_):
        built.append((Path(cache_dir), sft_steps, settings))
        return embedded.EmbeddedPaths(tmp_path, tmp_path / "m", tmp_path / "b", tmp_path / "train.parquet",
                                      model_and_test["test"], tmp_path / "manifest.json")  # fmt: skip

    monkeypatch.setattr(embedded, "ensure_embedded_default", fake_build)
    run = _run_folder(tmp_path, tmp_path, ["model.path=embedded", f"model.embedded_cache_dir={tmp_path / 'cache'}",
                      "model.embedded_sft_steps=7"], monkeypatch, model_and_test["model"])  # fmt: skip
    report = tmp_path / "report.json"
    code = verity(["eval", str(run), "--max-new-tokens", "2", "--json", str(report)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert (
        built and built[0][:2] == (tmp_path / "cache", 7) and built[0][2].key()
    )  # the run's preset settings
    assert json.loads(report.read_text())["settings"]["files"] == [str(model_and_test["test"])]
    assert "data: the embedded 'default' preset's held-out split" in err


def test_an_empty_folder_or_hf_folder_without_data_is_one_sentence(model_and_test, tmp_path, capsys) -> None:
    assert verity(["eval", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a complete checkpoint" in err and "--data" not in err
    assert verity(["eval", str(model_and_test["model"])]) == 2
    assert "is an HF model folder, which names no held-out data" in capsys.readouterr().err
