"""``actor.fsdp2.compile``: decoder layers compiled with inductor train exactly like the eager ones."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_padded_batch, tiny_qwen2
from verity.config import ConfigError, load_config
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.compiled_layers import compile_decoder_layers, compile_unavailable_reason

_UNAVAILABLE = compile_unavailable_reason(torch.device("cpu"))
needs_inductor = pytest.mark.skipif(
    _UNAVAILABLE is not None,
    reason=f"inductor cannot compile here: {_UNAVAILABLE}",
)


def token_mean_loss(mb, logprobs, entropy, agg):
    mask = mb["response_mask"]
    return -(logprobs * mb["advantages"] * mask).sum() / agg.global_tokens, {}


def loss_and_gradients(engine: FSDP2Engine) -> tuple[float, dict[str, torch.Tensor]]:
    """Forward + backward of the padded batch: the loss and every parameter's gradient."""
    loss = engine.forward_backward(make_padded_batch(), token_mean_loss, 4)["loss"]
    grads = engine.full_gradients()
    engine.optimizer.zero_grad(set_to_none=True)
    return loss, grads


@needs_inductor
def test_compiled_layers_train_like_eager_ones_and_keep_the_names():
    torch.manual_seed(0)
    eager = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu")
    torch.manual_seed(0)
    compiled = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu", compile_layers=True)
    assert (eager.compiled_layers, compiled.compiled_layers) == (0, 2)  # tiny_qwen2 has 2 layers
    # the compiled engine really runs inductor's code for its layers
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in compiled.model.model.layers)

    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())  # checkpoints, weight sync
    want_loss, want_grads = loss_and_gradients(eager)
    from torch._dynamo.utils import counters

    frames_before = counters["frames"]["ok"]
    got_loss, got_grads = loss_and_gradients(compiled)
    assert counters["frames"]["ok"] > frames_before  # dynamo compiled a frame during training
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert list(got_grads) == list(want_grads)
    for key, value in want_grads.items():  # fused kernels round differently: close, not bitwise
        torch.testing.assert_close(got_grads[key], value, rtol=1e-4, atol=1e-6, msg=key)
    # an optimizer step on the compiled layers updates the same parameters as the eager step
    compiled.train_step(make_padded_batch(), token_mean_loss, 4)
    eager.train_step(make_padded_batch(), token_mean_loss, 4)
    for key, value in eager.model.state_dict().items():
        torch.testing.assert_close(compiled.model.state_dict()[key], value, rtol=1e-3, atol=1e-4, msg=key)
    # the no-grad pass (old / reference log-probs) runs its own graph and agrees as well
    lp_eager, _ = eager.compute_logprobs(make_padded_batch(), micro_batch_size=4)
    lp_compiled, _ = compiled.compute_logprobs(make_padded_batch(), micro_batch_size=4)
    torch.testing.assert_close(lp_compiled, lp_eager, rtol=1e-4, atol=1e-5)


def test_compile_without_a_cxx_compiler_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-compiler-xyz",))
    reason = compile_unavailable_reason(torch.device("cpu"))
    assert reason is not None and "C++ compiler" in reason
    with pytest.raises(RuntimeError, match="compile=true: .*C\\+\\+ compiler"):
        compile_decoder_layers([torch.nn.Linear(2, 2)], torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"actor\.fsdp2\.compile=true: .*C\+\+ compiler"):
        load_config(["actor.fsdp2.compile=true", "trainer.device=cpu"])


def test_compile_option_is_a_bool():
    from verity.engines.options import FSDP2Options

    with pytest.raises(ConfigError, match=r"actor\.fsdp2\.compile must be true or false, got 'maybe'"):
        load_config(["actor.fsdp2.compile=maybe"])
    with pytest.raises(ValueError, match="fsdp2.compile must be true or false, got 'yes'"):
        FSDP2Options(compile="yes").validate()
    assert load_config(["actor.fsdp2.compile=true"]).actor.fsdp2.compile is True


_GRAPHS = ["actor.fsdp2.cuda_graphs=true", "actor.fsdp2.compile=true"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.fsdp2.cuda_graphs=true"], r"actor\.fsdp2\.cuda_graphs=true replays the compiled layers: set"),
        (["actor.fsdp2.cuda_graphs=1"], r"actor\.fsdp2\.cuda_graphs must be true or false"),
        ([*_GRAPHS, "trainer.device=cpu"], r"needs a CUDA device, and this run's device is the CPU \(trainer"),
        ([*_GRAPHS, "trainer.device=npu"], r"needs a CUDA or ROCm device, and trainer\.device=npu"),
        (
            [*_GRAPHS, "trainer.device=cuda", "actor.fsdp2.sharding=full"],
            r"needs unsharded layers, and actor\.fsdp2\.sharding=full over 2 workers .*sharding=replicate",
        ),
        (
            [*_GRAPHS, "trainer.device=cuda", "model.gradient_checkpointing=true"],
            r"does not combine with model\.gradient_checkpointing=true",
        ),
    ],
)
def test_cuda_graphs_config_says_what_rules_them_out(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_cuda_graphs_config_reaches_the_engine():
    from verity.engines.registry import _build_fsdp2

    cfg = load_config([*_GRAPHS, "trainer.device=cuda"])  # replicate over 2 workers: accepted
    assert cfg.actor.fsdp2.cuda_graphs is True
    seen = {}

    class Ctx:
        options, adapters, total_steps, device, gradient_checkpointing = cfg.actor.fsdp2, False, 1, "cpu", False
        source = None
        optim = OptimConfig(lr=1e-3)

        @staticmethod
        def load_model():
            return tiny_qwen2()

    import verity.engines.fsdp2 as fsdp2

    def record(self, model, optim, **kwargs):
        seen.update(kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fsdp2.FSDP2Engine, "__init__", record)
        _build_fsdp2(Ctx())
    assert seen["cuda_graphs"] is True and seen["compile_layers"] is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs compile_layers=True"),
        ({"compile_layers": True, "gradient_checkpointing": True}, "does not combine with gradient_checkpointing"),
        ({"compile_layers": True}, "needs a CUDA device; this engine runs on 'cpu'"),
    ],
)
def test_cuda_graphs_say_what_rules_them_out(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu", cuda_graphs=True, **kwargs)


@needs_inductor
def test_graphed_layers_share_one_graph_and_keep_no_grad_passes_apart():
    """The CUDA-graph wrapper's plumbing, on a CPU (where inductor runs it without graphs).

    The layers share one training graph and one no-grad graph (no per-layer recompile
    that would hit dynamo's cache limit on a 24-layer model), and both give the eager
    model's values and gradients.
    """
    from torch._dynamo.utils import counters
    from verity.engines.compiled_layers import _graphed_when_training

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = tiny_qwen2(seed=3)
    graphed = tiny_qwen2(seed=3)
    eager.config.use_cache = graphed.config.use_cache = False
    for layer in graphed.model.layers:
        layer.forward = _graphed_when_training(layer.forward)
        assert layer.forward.cuda_graphs
    assert list(graphed.state_dict()) == list(eager.state_dict())
    ids = torch.randint(1, 64, (3, 12))
    counters.clear()
    for model in (eager, graphed):
        model(input_ids=ids).logits.float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(graphed(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2  # one training graph, one no-grad graph, for both layers
