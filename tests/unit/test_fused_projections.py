"""``fsdp2.fuse_projections``: linears that read one input run as one product, with the same values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.tiny_models import make_padded_batch, tiny_qwen2
from torch import nn
from verity.config import ConfigError, load_config
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.compiled_layers import compile_unavailable_reason
from verity.engines.fused_projections import FuseSharedInputLinears, fuse_shared_input_linears

_UNAVAILABLE = compile_unavailable_reason(torch.device("cpu"))
needs_inductor = pytest.mark.skipif(
    _UNAVAILABLE is not None, reason=f"inductor cannot compile here: {_UNAVAILABLE}"
)


class Projections(nn.Module):
    """One input read by q/k/v (with biases) and gate/up (without), a frozen adapter base, and one other input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.gate, self.up = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
        self.frozen = nn.Linear(16, 8, bias=False).requires_grad_(False)
        self.out = nn.Linear(24, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.q(x) * torch.cat([self.k(x), self.v(x), self.k(x), self.v(x)], dim=-1)
        mlp = self.out(F.silu(self.gate(x)) * self.up(x))
        return attn + mlp + self.frozen(x).repeat(1, 1, 2) + F.linear(x * 2, self.q.weight)


def _capture(sizes: list[list[int]]):
    """A dynamo backend that runs the pass on the captured graph and then the graph as it is (no inductor)."""

    def backend(gm: torch.fx.GraphModule, example_inputs):
        sizes.append(fuse_shared_input_linears(gm.graph))
        gm.graph.lint()
        gm.recompile()
        return gm.forward

    return backend


def test_the_pass_stacks_linears_of_one_input_and_keeps_values_and_gradients():
    torch._dynamo.reset()
    torch.manual_seed(0)
    plain, fused = Projections(), Projections()
    fused.load_state_dict(plain.state_dict())
    sizes: list[list[int]] = []
    compiled = torch.compile(fused, backend=_capture(sizes), fullgraph=True)
    x = torch.randn(2, 5, 16, dtype=torch.float64).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    plain.double(), fused.double()
    want, got = plain(x), compiled(x2)
    # q, k, v (k and v read twice: dynamo dedups nothing, so 5 calls) with biases; gate, up without.
    # The frozen base and the linear of another input (x * 2) stay apart
    assert sizes == [[5, 2]]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-12, atol=1e-12)
    for (name, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters(), strict=True):
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)
        else:
            assert b.grad is None, name


def test_linears_that_cannot_be_stacked_are_left_alone():
    class Apart(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)  # a bias
            self.b = nn.Linear(8, 8, bias=False)  # none
            self.c = nn.Linear(8, 8, bias=False).half()  # another dtype

        def forward(self, x):
            computed = self.b.weight * 2  # a weight the graph computes: not a parameter
            return self.a(x) + self.b(x) + self.c(x.half()).float() + F.linear(x, computed)

    torch._dynamo.reset()
    sizes: list[list[int]] = []
    model = Apart()
    x = torch.randn(3, 8)
    want = model(x)
    got = torch.compile(model, backend=_capture(sizes), fullgraph=True)(x)
    assert sizes == [[]]
    torch.testing.assert_close(got, want)


def test_outputs_changed_in_place_are_not_stacked():
    """Autograd refuses in-place changes to one of several views: such a linear stays on its own."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x):
            a = self.a(x)
            a.mul_(2)
            return a.sum(-1, keepdim=True) + self.b(x) * self.c(x)

    torch._dynamo.reset()
    sizes: list[list[int]] = []
    model = InPlace()
    x = torch.randn(3, 8, requires_grad=True)
    want = model(x)
    got = torch.compile(model, backend=_capture(sizes), fullgraph=True)(x)
    assert sizes == [[2]]  # b and c; a is changed in place
    torch.testing.assert_close(got, want)
    got.sum().backward()


def test_weights_read_late_in_the_graph_move_up_to_the_stacked_product():
    """A traced graph reads each parameter (``get_attr``) just before its use: the pass moves them up."""

    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.randn(5, 8)), nn.Parameter(torch.randn(3, 8))

        def forward(self, x):
            y1 = F.linear(x, self.w1)
            return torch.cat([y1, F.linear(x, self.w2)], dim=-1)

    model = Late()
    traced = torch.fx.symbolic_trace(model)
    for node in traced.graph.nodes:  # a symbolic trace has no example values: give the parameters theirs
        if node.op == "get_attr":
            node.meta["example_value"] = getattr(model, node.target)
    assert fuse_shared_input_linears(traced.graph) == [2]
    traced.graph.lint()
    traced.recompile()
    x = torch.randn(4, 8)
    torch.testing.assert_close(traced(x), model(x))


def loss(mb, logprobs, entropy, agg):
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


@needs_inductor
def test_an_engine_with_stacked_projections_trains_like_one_without():
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=True):  # the pass runs only where inductor compiles
        plain = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu", compile_layers=True)
        fused = FSDP2Engine(
            tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu", compile_layers=True, fuse_projections=True
        )
        assert isinstance(fused.fused_projections, FuseSharedInputLinears) and plain.fused_projections is None
        assert list(fused.model.state_dict()) == list(plain.model.state_dict())  # checkpoints, weight sync
        results = []
        for engine in (plain, fused):
            got = engine.forward_backward(make_padded_batch(), loss, 4)["loss"]
            results.append((got, engine.full_gradients()))
            engine.optimizer.zero_grad(set_to_none=True)
        lp_plain, _ = plain.compute_logprobs(make_padded_batch(), micro_batch_size=4)
        lp_fused, _ = fused.compute_logprobs(make_padded_batch(), micro_batch_size=4)
    # one training graph and one no-grad graph, each with q/k/v and gate/up stacked
    assert fused.fused_projections.fused_groups == [3, 2, 3, 2]
    (want_loss, want_grads), (got_loss, got_grads) = results
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for key, value in want_grads.items():
        torch.testing.assert_close(got_grads[key], value, rtol=1e-4, atol=1e-6, msg=key)
    torch.testing.assert_close(lp_fused, lp_plain, rtol=1e-5, atol=1e-5)


@needs_inductor
def test_the_graphed_wrapper_runs_the_pass_in_both_its_graphs():
    from verity.engines.compiled_layers import _graphed_when_training

    torch._dynamo.reset()
    model = tiny_qwen2(seed=3)
    model.config.use_cache = False
    fuse = FuseSharedInputLinears()
    import torch._inductor.config as inductor_config

    with inductor_config.patch(force_disable_caches=True):
        for layer in model.model.layers:
            layer.forward = _graphed_when_training(layer.forward, {"pre_grad_custom_pass": fuse})
        ids = torch.randint(1, 64, (2, 6))
        model(input_ids=ids).logits.sum().backward()
        with torch.no_grad():
            model(input_ids=ids)
    # every graph it saw (the training one, which inductor may hand it more than once, and
    # the no-grad one) had q/k/v and gate/up stacked
    assert fuse.graphs >= 2 and fuse.fused_groups == [3, 2] * fuse.graphs


def test_fuse_projections_needs_the_compiled_layers():
    with pytest.raises(
        ConfigError, match=r"actor\.fsdp2\.fuse_projections=true is a pass of the compiled layers"
    ):
        load_config(["actor.fsdp2.fuse_projections=true"])
    with pytest.raises(ConfigError, match=r"actor\.fsdp2\.fuse_projections must be true or false"):
        load_config(["actor.fsdp2.fuse_projections=2", "actor.fsdp2.compile=true"])
    with pytest.raises(ValueError, match="fuse_projections=True is a pass of the compiled layers"):
        FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu", fuse_projections=True)


def test_fuse_projections_reaches_the_engine():
    from verity.engines.registry import _build_fsdp2

    cfg = load_config(["actor.fsdp2.compile=true", "actor.fsdp2.fuse_projections=true"])
    seen = {}

    class Ctx:
        options, adapters, total_steps, device, gradient_checkpointing = (
            cfg.actor.fsdp2,
            False,
            1,
            "cpu",
            False,
        )
        optim = OptimConfig(lr=1e-3)

        @staticmethod
        def load_model():
            return tiny_qwen2()

    import verity.engines.fsdp2 as fsdp2

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fsdp2.FSDP2Engine, "__init__", lambda self, model, optim, **kw: seen.update(kw))
        _build_fsdp2(Ctx())
    assert seen["fuse_projections"] is True and seen["compile_layers"] is True
