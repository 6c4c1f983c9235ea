"""bf16 on CPU: mixed-precision training in the FSDP2 engine and a bf16 rollout, and what a run records."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_padded_batch, tiny_qwen2
from verity.config import ConfigError, load_config
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.options import FSDP2Options
from verity.hardware import cpu_has_native_bf16, cpu_matmul_isa
from verity.workers.role_training import rollout_dtype


def token_mean_loss(mb, logprobs, entropy, agg):
    mask = mb["response_mask"]
    return -(logprobs * mb["advantages"] * mask).sum() / agg.global_tokens, {}


def gradients(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    engine.forward_backward(make_padded_batch(), token_mean_loss, 4)
    grads = engine.full_gradients()
    engine.optimizer.zero_grad(set_to_none=True)
    return grads


def linear_output_dtypes(engine: FSDP2Engine) -> set[torch.dtype]:
    """The dtypes the model's ``nn.Linear`` layers produced during one log-prob pass."""
    seen: set[torch.dtype] = set()
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
        for m in engine.model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        engine.compute_logprobs(make_padded_batch(), micro_batch_size=4)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.filterwarnings("ignore:mixed_precision=True on a CPU without native bf16")
def test_cpu_mixed_precision_computes_in_bf16_and_keeps_float32_state():
    fp32 = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu")
    mixed = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu", mixed_precision=True)
    assert fp32.compute_dtype == torch.float32 and mixed.compute_dtype == torch.bfloat16
    assert linear_output_dtypes(fp32) == {torch.float32}
    assert linear_output_dtypes(mixed) == {torch.bfloat16}

    want, got = gradients(fp32), gradients(mixed)
    assert set(got) == set(want)
    flat_want = torch.cat([want[k].flatten() for k in sorted(want)])
    flat_got = torch.cat([got[k].flatten() for k in sorted(want)])
    assert flat_got.dtype == torch.float32
    # bf16 rounding: close to the float32 gradient, not equal to it (so the bf16 path really ran)
    relative = float((flat_got - flat_want).norm() / flat_want.norm())
    assert 0 < relative < 0.05, relative
    assert float(torch.nn.functional.cosine_similarity(flat_got, flat_want, dim=0)) > 0.998

    mixed.train_step(make_padded_batch(), token_mean_loss, 4)
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    moments = [v for state in mixed.optimizer.state.values() for v in state.values() if v.dim() > 0]
    assert moments and all(v.dtype == torch.float32 for v in moments)


def test_mixed_precision_warns_on_a_cpu_without_native_bf16(monkeypatch):
    import verity.engines.fsdp2 as fsdp2

    monkeypatch.setattr(fsdp2, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(UserWarning, match="without native bf16 multiplies"):
        FSDP2Engine(tiny_qwen2(), None, device="cpu", mixed_precision=True)
    monkeypatch.setattr(fsdp2, "cpu_has_native_bf16", lambda: True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FSDP2Engine(tiny_qwen2(), None, device="cpu", mixed_precision=True)


@pytest.mark.parametrize(
    ("flags", "native", "isa"),
    [
        ("fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile", True, "amx_bf16"),
        ("fpu sse2 avx2 avx512f avx512_bf16", True, "avx512_bf16"),
        ("fpu sse2 avx2 avx512f avx512_vnni", False, "avx512f"),
        ("fpu sse2 avx avx2 fma", False, "avx2"),
        ("fp asimd evtstrm", False, None),
    ],
)
def test_native_bf16_and_matmul_isa_are_read_from_the_cpu_flags(tmp_path, flags, native, isa):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n")
    assert cpu_has_native_bf16(cpuinfo) is native
    assert cpu_matmul_isa(cpuinfo) == isa
    assert cpu_has_native_bf16(tmp_path / "missing") is False
    assert cpu_matmul_isa(tmp_path / "missing") is None


def test_rollout_dtype_follows_the_model_on_cpu_is_bf16_on_accelerators_unless_given():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device only names where: nothing is allocated
    assert rollout_dtype(load_config(), cpu) == torch.float32
    assert rollout_dtype(load_config(), gpu) == torch.bfloat16  # what a GPU user expects by default
    assert rollout_dtype(load_config(["rollout.dtype=bfloat16"]), cpu) == torch.bfloat16
    assert rollout_dtype(load_config(["model.dtype=bfloat16"]), cpu) == torch.bfloat16
    assert rollout_dtype(load_config(["model.dtype=bfloat16", "rollout.dtype=float32"]), cpu) == torch.float32
    assert rollout_dtype(load_config(["rollout.dtype=float32"]), gpu) == torch.float32
    with pytest.raises(ConfigError, match=r"rollout.dtype must be one of float32\|bfloat16 or null, got 'float16'"):
        load_config(["rollout.dtype=float16"])


def test_a_bf16_hf_rollout_serves_a_cast_copy_and_takes_float32_weights():
    from verity.rollout import RolloutBuildContext, SamplingParams, build_rollout_engine, encode_prompts
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    tokenizer = CharTokenizer()
    rollout = build_rollout_engine(
        "hf",
        RolloutBuildContext(
            model_path="unused",
            tokenizer=tokenizer,
            device=torch.device("cpu"),
            dtype=torch.bfloat16,
            load_policy=lambda: build_tiny_qwen2_for(tokenizer, seed=3),
        ),
    )
    assert rollout.serving_dtype == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in rollout.model.parameters())
    trained = build_tiny_qwen2_for(tokenizer, seed=5)
    assert rollout.load_weights((n, p.detach()) for n, p in trained.named_parameters()) > 0
    for name, want in trained.named_parameters():
        got = dict(rollout.model.named_parameters())[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.detach().to(torch.bfloat16)), name
    prompts = encode_prompts(tokenizer, [[{"role": "user", "content": p}] for p in ["1+2=", "30+4="]])
    out = rollout.generate(prompts, SamplingParams(max_new_tokens=3, n=2))
    assert out["responses"].shape == (4, 3) and out["rollout_logprobs"].dtype == torch.float32


def test_the_engine_can_train_with_its_own_attention_kernel():
    sdpa = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu", packed=False)
    eager = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu", attn_implementation="eager")
    assert sdpa.model.config._attn_implementation == "sdpa"
    assert eager.model.config._attn_implementation == "eager" and not eager.packed  # the kernel asked for wins
    with pytest.raises(ValueError, match="packed=True attends through its own kernel"):
        FSDP2Engine(tiny_qwen2(), device="cpu", attn_implementation="eager", packed=True)
    with pytest.raises(ValueError, match="fsdp2.packed=true attends through its own kernel"):
        FSDP2Options(packed=True, attn_implementation="eager").validate()  # refused before any worker starts
    want, got = gradients(sdpa), gradients(eager)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    cfg = load_config(["actor.fsdp2.attn_implementation=eager"])
    assert cfg.actor.fsdp2.attn_implementation == "eager" and cfg.model.attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match=r"actor.fsdp2.attn_implementation must be null or one of .*'fast'"):
        load_config(["actor.fsdp2.attn_implementation=fast"])
    with pytest.raises(TypeError, match="not an HF model"):
        FSDP2Engine(torch.nn.Linear(2, 2), None, device="cpu", attn_implementation="eager")
