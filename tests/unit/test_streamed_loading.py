"""Streamed loading: the safetensors reader, the checkpoint checks, and FSDP2 ranks filled shard by shard."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.spawn import spawn_and_load
from helpers.tiny_models import make_padded_batch, tiny_qwen2, tiny_qwen2_config
from safetensors.torch import load_file
from verity.engines.model_source import ModelSource, parameters_on_meta
from verity.engines.safetensors_files import CheckpointError, CheckpointFiles
from verity.engines.streamed_loading import check_checkpoint


def _save(folder, *, shard: str | None = None, tie: bool = True, seed: int = 0):
    model = tiny_qwen2(seed=seed, tie_word_embeddings=tie)
    if shard:
        model.save_pretrained(folder, max_shard_size=shard)
    else:
        model.save_pretrained(folder)
    return model


def _stored(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_reader_gives_every_tensor_as_safetensors_does(tmp_path, shard):
    _save(tmp_path, shard=shard)
    files = CheckpointFiles(tmp_path)
    expected = _stored(tmp_path)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len({e.file for e in files.entries.values()}) > 1
    assert sorted(files.names()) == sorted(expected)
    for name, tensor in expected.items():
        got = files.read(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_bf16_tensors_round_trip(tmp_path):
    tiny_qwen2().to(torch.bfloat16).save_pretrained(tmp_path)
    files = CheckpointFiles(tmp_path)
    for name, tensor in _stored(tmp_path).items():
        assert files.read(name).dtype == torch.bfloat16
        assert torch.equal(files.read(name), tensor)


def test_a_missing_shard_is_named(tmp_path):
    _save(tmp_path, shard="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / gone).unlink()
    with pytest.raises(CheckpointError, match=f"does not have: {gone}"):
        CheckpointFiles(tmp_path)


def test_a_broken_index_is_named(tmp_path):
    _save(tmp_path, shard="40KB")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not a safetensors index"):
        CheckpointFiles(tmp_path)


def test_a_truncated_file_is_named(tmp_path):
    _save(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        CheckpointFiles(tmp_path)


def test_an_index_naming_a_tensor_its_shard_lacks_is_named(tmp_path):
    _save(tmp_path, shard="40KB")
    path = tmp_path / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["model.extra.weight"] = next(iter(index["weight_map"].values()))
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.extra.weight'"):
        CheckpointFiles(tmp_path)


def test_a_shape_that_does_not_match_the_config_is_named(tmp_path):
    _save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96  # the files hold 128-wide MLPs
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = ModelSource(str(tmp_path))
    with pytest.raises(
        CheckpointError, match=r"mlp\.\w+_proj\.weight' has shape \[\d+, \d+\].*config\.json makes it"
    ):
        check_checkpoint(source.build_empty(), CheckpointFiles(tmp_path), source)


def test_a_tensor_missing_from_the_files_is_named(tmp_path):
    _save(tmp_path)
    from safetensors.torch import save_file

    tensors = _stored(tmp_path)
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    source = ModelSource(str(tmp_path))
    with pytest.raises(
        CheckpointError, match="no tensor for 1 of the model's parameters.*'model.norm.weight'"
    ):
        check_checkpoint(source.build_empty(), CheckpointFiles(tmp_path), source)


def test_parameters_on_meta_keeps_buffers_real():
    from transformers import Qwen2ForCausalLM

    with parameters_on_meta():
        model = Qwen2ForCausalLM(tiny_qwen2_config())
    assert all(p.device.type == "meta" for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert buffers and all(b.device.type == "cpu" for b in buffers.values())
    reference = dict(tiny_qwen2().named_buffers())
    for name, buffer in buffers.items():
        assert torch.equal(buffer, reference[name]), name


def test_value_model_source_zeroes_its_fresh_head(tmp_path):
    _save(tmp_path)
    source = ModelSource(str(tmp_path), kind="value_model")
    whole = source.load_whole()
    assert torch.count_nonzero(whole.score.weight) == 0
    assert source.parameter_count() == sum(p.numel() for p in whole.parameters())


# ------------------------------------------------------------------ two ranks over gloo
def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from verity.engines import FSDP2Engine, OptimConfig
    from verity.resharding import iter_engine_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    folder = os.path.join(out_dir, "model")
    out = {}
    for kind in ("causal_lm", "value_model"):
        engine = FSDP2Engine(ModelSource(folder, kind=kind), OptimConfig(lr=1e-2))
        assert engine.streamed and engine.fsdp_modules
        local = sum(p.to_local().numel() for p in engine.model.parameters())
        full = {name: t.clone() for name, t in iter_engine_weights(engine, device="cpu")}
        out[kind] = {"local_numel": local, "weights": full}
        if kind == "causal_lm":
            batch = make_padded_batch()
            out["logprobs"] = engine.compute_logprobs(batch, micro_batch_size=4)[0]
            try:
                FSDP2Engine(ModelSource(os.path.join(out_dir, "broken")), None)
            except Exception as err:  # every rank must get the same sentence
                out["error"] = f"{type(err).__name__}: {err}"
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_ranks_each_receive_their_shard_and_match_whole_loading(tmp_path):
    _save(tmp_path / "model", tie=False, seed=3)
    _save(tmp_path / "broken", shard="40KB")
    index = json.loads((tmp_path / "broken" / "model.safetensors.index.json").read_text())
    (tmp_path / "broken" / sorted(set(index["weight_map"].values()))[0]).unlink()
    ranks = spawn_and_load(_two_rank_worker, 2, str(tmp_path))

    whole = ModelSource(str(tmp_path / "model")).load_whole()
    expected = dict(whole.state_dict())
    total = sum(p.numel() for p in whole.parameters())
    for rank in ranks:
        # each rank holds about half: dim-0 chunks, the odd rows to rank 0
        assert 0.4 * total < rank["causal_lm"]["local_numel"] < 0.6 * total
        for name, tensor in rank["causal_lm"]["weights"].items():
            assert torch.equal(tensor, expected[name]), name
        value = rank["value_model"]["weights"]
        assert torch.count_nonzero(value["score.weight"]) == 0
        assert torch.equal(value["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])
        assert "has no" in rank["error"] or "does not have" in rank["error"]
        assert rank["error"].startswith("CheckpointError")
    assert ranks[0]["error"] == ranks[1]["error"]

    from verity.engines import FSDP2Engine

    single = FSDP2Engine(whole, None).compute_logprobs(make_padded_batch(), micro_batch_size=4)[0]
    torch.testing.assert_close(ranks[0]["logprobs"], single, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ refused before any worker starts
def _broken(folder, how: str) -> None:
    from transformers import AutoTokenizer  # noqa: F401  (the folder needs no tokenizer for the check)

    _save(folder, shard="40KB")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    if how == "missing shard":
        (folder / sorted(set(index["weight_map"].values()))[0]).unlink()
    elif how == "broken index":
        index_path.write_text("{not json")
    elif how == "shape":
        config = json.loads((folder / "config.json").read_text())
        config["hidden_size"], config["num_attention_heads"] = 32, 2
        (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("how", "sentence"),
    [
        ("missing shard", "names shard file\\(s\\) the folder does not have"),
        ("broken index", "is not a safetensors index"),
        ("shape", "has shape \\[100, 64\\].*config.json makes it \\[100, 32\\]"),
    ],
)
def test_a_broken_checkpoint_stops_verity_train_in_one_sentence(tmp_path, how, sentence):
    import subprocess
    import sys

    _broken(tmp_path / "model", how)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "verity.cli.main",
            "train",
            f"model.path={tmp_path / 'model'}",
            "trainer.total_steps=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith("verity: ") or "model.path" in message, run.stderr[-2000:]
    assert "model.path" in message and "Traceback" not in run.stderr
    import re

    assert re.search(sentence, message), message


def test_a_broken_reward_model_folder_is_named_before_start(tmp_path):
    from verity.config import ConfigError, load_config

    _save(tmp_path / "rm", shard="40KB")
    index = json.loads((tmp_path / "rm" / "model.safetensors.index.json").read_text())
    (tmp_path / "rm" / sorted(set(index["weight_map"].values()))[-1]).unlink()
    overrides = ["reward_model.enabled=true", f"reward_model.model_path={tmp_path / 'rm'}"]
    with pytest.raises(ConfigError, match=r"reward_model\.model_path: .*names shard file"):
        load_config(overrides)  # the config's checks read the folder's headers before any worker
