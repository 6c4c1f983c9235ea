"""One process, no Ray: save an engine through the CheckpointManager, restore it exactly, export to HF."""

from __future__ import annotations

import pytest
import torch
from verity.checkpoint.export import export_hf, find_checkpoint, read_model_state
from verity.checkpoint.manager import CheckpointManager
from verity.checkpoint.sharded import load_engine, save_engine
from verity.checkpoint.state import TrainerState
from verity.engines import FSDP2Engine, OptimConfig

P, R = 4, 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)
    folder = tmp_path_factory.mktemp("model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_batch(vocab: int, rows: int = 6, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, vocab, (rows, P), generator=g)
    responses = torch.randint(4, vocab, (rows, R), generator=g)
    response_mask = torch.ones(rows, R)
    attention_mask = torch.ones(rows, P + R, dtype=torch.long)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": attention_mask.cumsum(-1) - 1,
        "responses": responses,
        "response_mask": response_mask,
        "advantages": torch.randn(rows, R, generator=g),
    }


def loss_fn(mb, logprobs, entropy, agg):
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


class OneRankGroup:
    """Stands in for a worker group of one rank (the group methods the manager calls)."""

    def __init__(self, engine: FSDP2Engine) -> None:
        self.engine = engine

    def save_checkpoint(self, path: str) -> list[dict]:
        return [save_engine(path, self.engine, rank=0, world_size=1)]

    def load_checkpoint(self, path: str) -> list[dict]:
        return [load_engine(path, self.engine, rank=0, world_size=1)]


def new_engine(model_dir) -> FSDP2Engine:
    from verity.engines.hf_loading import load_causal_lm

    return FSDP2Engine(load_causal_lm(model_dir), OptimConfig(lr=1e-2, warmup_steps=3, weight_decay=0.1))


def state_at(step: int) -> TrainerState:
    return TrainerState(
        step=step,
        total_steps=10,
        dataloader={},
        kl_coef=None,
        run_id=None,
        tracking_uri=None,
        config_hash="h",
        config={},
    )


def test_restore_continues_training_exactly(model_dir, tmp_path):
    engine = new_engine(model_dir)
    vocab = engine.model.config.vocab_size
    for seed in (1, 2):
        engine.train_step(make_batch(vocab, seed=seed), loss_fn, 4)
    manager = CheckpointManager(tmp_path / "ckpt", 2, {"actor": OneRankGroup(engine)}, str(model_dir))
    path = manager.save(2, state_at(2))
    assert path == tmp_path / "ckpt" / "step_2" and (path / "hf" / "config.json").is_file()
    assert TrainerState.read(path).roles == {"actor": 1}

    fresh = new_engine(model_dir)  # starts from the initial weights, optimizer empty
    restored = CheckpointManager(tmp_path / "ckpt", 2, {"actor": OneRankGroup(fresh)}).restore(path)
    assert restored.step == 2 and fresh.global_step == 2
    batch = make_batch(vocab, seed=3)
    a = engine.train_step(batch, loss_fn, 4)
    b = fresh.train_step(batch, loss_fn, 4)
    assert a["lr"] == b["lr"] == pytest.approx(1e-2)  # the warm-up schedule resumed at step 3 of 3
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for (name, pa), (_, pb) in zip(
        engine.model.named_parameters(), fresh.model.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name


def test_export_gives_an_hf_folder_that_generates_like_the_engine(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = new_engine(model_dir)
    vocab = engine.model.config.vocab_size
    engine.train_step(make_batch(vocab), loss_fn, 4)
    manager = CheckpointManager(tmp_path / "ckpt", 1, {"actor": OneRankGroup(engine)}, str(model_dir))
    manager.save(1, state_at(1))
    weights = read_model_state(tmp_path / "ckpt" / "step_1" / "actor")
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(weights[name], tensor), name

    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")  # the folder's newest checkpoint
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    from verity.tracking.summary import umask

    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o666 & ~umask())}  # not 0600
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    initial = AutoModelForCausalLM.from_pretrained(model_dir)
    changed = [n for n, t in exported.state_dict().items() if not torch.equal(t, initial.state_dict()[n])]
    assert changed  # trained weights, not the initial ones
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name

    prompt = tokenizer(["12+3="], return_tensors="pt")
    engine.model.eval()
    with torch.no_grad():
        ref = engine.model.generate(**prompt, do_sample=False, max_new_tokens=6, use_cache=True)
        got = exported.generate(**prompt, do_sample=False, max_new_tokens=6)
    assert torch.equal(ref, got)

    bf16 = export_hf(tmp_path / "ckpt" / "step_1", tmp_path / "hf16", dtype="bfloat16")
    assert AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16


def test_export_streams_bounded_shards_that_load_as_one_model(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    from verity.checkpoint.export_stream import plan_buckets, saved_model_tensors

    engine = new_engine(model_dir)
    CheckpointManager(tmp_path / "ckpt", 1, {"actor": OneRankGroup(engine)}, str(model_dir)).save(1, state_at(1))
    limit = 64 * 1024
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=limit)
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 2 and (out / "model.safetensors.index.json").is_file()
    saved = saved_model_tensors(tmp_path / "ckpt" / "step_1" / "actor" / "dcp", "model.")
    for bucket in plan_buckets(saved, list(saved), None, limit):
        sizes = [torch.Size(saved[n][0]).numel() * 4 for n in bucket]
        assert sum(sizes) <= limit or len(bucket) == 1  # one bucket in memory at a time
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.config.architectures == ["Qwen2ForCausalLM"]
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name


def test_export_names_what_is_missing(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        find_checkpoint(tmp_path)
    engine = new_engine(model_dir)
    CheckpointManager(tmp_path / "c", 1, {"actor": OneRankGroup(engine)}, str(model_dir)).save(0, state_at(0))
    with pytest.raises(FileNotFoundError, match=r"no role 'critic' \(roles here: \['actor'\]\)"):
        export_hf(tmp_path / "c", tmp_path / "out", role="critic")
    with pytest.raises(ValueError, match="dtype"):
        export_hf(tmp_path / "c", tmp_path / "out", dtype="int8")


def test_a_critic_exports_as_the_value_model_it_trained_as(model_dir, tmp_path):
    from transformers import AutoModelForTokenClassification
    from verity.workers.critic import load_value_model

    critic = FSDP2Engine(load_value_model(str(model_dir)), OptimConfig(lr=1e-2))
    with torch.no_grad():
        critic.model.score.weight.normal_()  # a head that is not the zero it starts as
        critic.model.score.bias.fill_(0.5)
    actor = new_engine(model_dir)
    groups = {"actor": OneRankGroup(actor), "critic": OneRankGroup(critic)}
    CheckpointManager(tmp_path / "ckpt", 1, groups, str(model_dir)).save(1, state_at(1))
    out = export_hf(tmp_path / "ckpt", tmp_path / "critic", role="critic")
    exported = AutoModelForTokenClassification.from_pretrained(out).eval()
    assert exported.config.num_labels == 1
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, critic.model.eval()(input_ids=ids).logits)
