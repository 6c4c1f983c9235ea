"""Linear layers that read the same input, computed as one matrix product in the compiled layers.

A decoder layer projects one normalised input three times for attention (``q_proj``,
``k_proj``, ``v_proj``) and twice for the MLP (``gate_proj``, ``up_proj``). As separate
products the narrow ones are hard to run near a GPU's peak: in a Qwen2.5-0.5B layer the key
and value projections are 896 -> 128 each (two key/value heads of 64), so their weight
gradients offer a few output tiles to 132 multiprocessors and their input gradients sum over
128 terms. One product against the stacked weights,

    [y_1 | y_2 | ... | y_k] = x [W_1; W_2; ...; W_k]^T + [b_1 | b_2 | ... | b_k]

then split along the last dimension, gives every ``y_i`` the same dot products over the same
input (each output column is still ``x . w_j + b_j``; only the kernel that computes it
changes, so the bits may differ by rounding), and its gradient is one wide product for the
input and one for the stacked weights, split back into each weight's gradient by autograd.

This is an inductor pre-grad graph pass (:class:`FuseSharedInputLinears`, given to
``torch.compile`` in the layer's options), so the model keeps its own modules: parameter
names, ``state_dict`` keys, checkpoints and the weight sync to the rollout are unchanged, and
the stacked weight is a temporary of the compiled graph (under autocast inductor fuses the
stacking into the bf16 cast it does anyway). A group is fused only when its linears share
the input node, have parameters (graph inputs) for weights, agree on whether they have a
bias, their weights share dtype, input width and ``requires_grad``, and no output is changed
in place (autograd refuses in-place changes to one of several views of a tensor).

Off by default (``fsdp2.fuse_projections``): slower where measured, 0.90-1.00x the speed of the
compiled layers without it on a CPU and 0.97x under CUDA graphs on an H200 (``docs/engines.md``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import operator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import fx

__all__ = ["FuseSharedInputLinears", "fuse_shared_input_linears"]

_LINEAR_TARGETS = (F.linear, torch._C._nn.linear)
_PARAMETER_OPS = ("placeholder", "get_attr")  # graph inputs: a stacked weight built from them can go first


def _linear_args(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(input, weight, bias) of an ``F.linear`` call with node arguments, or None."""
    if node.op != "call_function" or node.target not in _LINEAR_TARGETS:
        return None
    names = ("input", "weight", "bias")
    values = dict(zip(names, node.args, strict=False))
    for name in names:
        if name in node.kwargs:
            values[name] = node.kwargs[name]
    x, weight, bias = values.get("input"), values.get("weight"), values.get("bias")
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node):
        return None
    if bias is not None and not isinstance(bias, fx.Node):
        return None
    return x, weight, bias


def _changed_in_place(node: fx.Node) -> bool:
    """Whether a user of ``node`` looks like an in-place op (``mul_``, ``operator.iadd`` ...)."""
    for user in node.users:
        target = user.target
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            return True
        if getattr(target, "__module__", None) == "_operator" and name.startswith("i"):
            return True
    return False


def _example(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _group_key(weight: fx.Node, bias: fx.Node | None) -> tuple | None:
    """What linears of one input must agree on to be stacked; None when this one cannot be."""
    if weight.op not in _PARAMETER_OPS or (bias is not None and bias.op not in _PARAMETER_OPS):
        return None
    w = _example(weight)
    if w is None or w.dim() != 2:
        return None
    if bias is not None:
        b = _example(bias)
        if b is None or b.dim() != 1 or b.dtype != w.dtype or b.requires_grad != w.requires_grad:
            return None
    # requires_grad in the key: stacking a frozen weight (LoRA's base) with a trained one would
    # compute the frozen one's weight gradient too, only to drop it
    return (bias is not None, w.dtype, w.device, int(w.shape[1]), w.requires_grad)


def _fuse_group(graph: fx.Graph, x: fx.Node, members: list[tuple[fx.Node, fx.Node, fx.Node | None]]) -> None:
    weights = [weight for _, weight, _ in members]
    biases = [bias for _, _, bias in members if bias is not None]
    widths = [int(_example(weight).shape[0]) for weight in weights]
    first = members[0][0]
    position = {node: index for index, node in enumerate(graph.nodes)}
    for attribute in [*weights, *biases]:  # a get_attr after the first linear has no inputs, so it
        if attribute.op == "get_attr" and position[attribute] > position[first]:  # can move up to it
            first.prepend(attribute)
    with graph.inserting_before(first):
        stacked_weight = graph.call_function(torch.cat, (weights,), {"dim": 0})
        stacked_bias = graph.call_function(torch.cat, (biases,), {"dim": 0}) if biases else None
        product = graph.call_function(F.linear, (x, stacked_weight, stacked_bias))
        pieces = graph.call_function(torch.split, (product, widths), {"dim": -1})
    _stacked_example(stacked_weight, [_example(w) for w in weights])
    if stacked_bias is not None:
        _stacked_example(stacked_bias, [_example(b) for b in biases])
    for index, (node, _, _) in enumerate(members):
        with graph.inserting_before(node):
            piece = graph.call_function(operator.getitem, (pieces, index))
        piece.meta.update(node.meta)
        node.replace_all_uses_with(piece)
        graph.erase_node(node)


def _stacked_example(node: fx.Node, tensors: list[torch.Tensor | None]) -> None:
    """Give a stacking node an ``example_value`` like dynamo's (fake tensors), where they stack."""
    if any(t is None for t in tensors):
        return
    with contextlib.suppress(Exception):  # the meta is advisory: later passes skip nodes without it
        node.meta["example_value"] = torch.cat(tensors, dim=0)


def fuse_shared_input_linears(graph: fx.Graph) -> list[int]:
    """Stack the linears of ``graph`` that read the same input node; returns each fused group's size.

    Groups of two or more ``F.linear`` calls on one input, with parameters for weights and the
    same bias-ness, dtype, input width and ``requires_grad``, whose outputs are not changed in
    place, become one ``F.linear`` against ``cat(weights)`` (and ``cat(biases)``) followed by
    ``split`` along the last dimension. The graph is edited
    in place; the caller recompiles its module. Order: each group in the order of its first
    linear; within a group, the linears' order in the graph.
    """
    groups: dict[tuple, list[tuple[fx.Node, fx.Node, fx.Node | None]]] = {}
    for node in graph.nodes:
        args = _linear_args(node)
        if args is None:
            continue
        x, weight, bias = args
        key = _group_key(weight, bias)
        if key is not None and not _changed_in_place(node):
            groups.setdefault((x, *key), []).append((node, weight, bias))
    sizes = []
    for (x, *_), members in groups.items():
        if len(members) >= 2:
            _fuse_group(graph, x, members)
            sizes.append(len(members))
    return sizes


@functools.cache
def _source_hash() -> str:
    """This file's SHA-256: the pass's identity in inductor's cache key (read once per process)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


try:  # inductor's base class: a uuid() keeps its graph cache correct when the pass changes
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # pragma: no cover - a torch without it takes any callable
    _PassBase = object


class FuseSharedInputLinears(_PassBase):
    """:func:`fuse_shared_input_linears` as inductor's ``pre_grad_custom_pass``.

    Counts what it did in this process: ``graphs`` (graphs it ran on) and ``fused_groups`` (the
    sizes of the groups it stacked, over every graph; ``ci/bench_gpu.py`` records them). A graph
    inductor serves from its cache does not run the pass, so the counts can stay empty.
    """

    def __init__(self) -> None:
        self.graphs = 0
        self.fused_groups: list[int] = []

    def __call__(self, graph: fx.Graph) -> None:
        self.graphs += 1
        self.fused_groups.extend(fuse_shared_input_linears(graph))
        graph.lint()

    def uuid(self) -> str:
        return _source_hash()
