"""AdamW settings, LR schedule and gradient clipping of the training engines."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from verity.engines.optim import (
    OptimConfig,
    build_lr_scheduler,
    build_optimizer,
    clip_gradients,
    lr_multiplier,
)


def test_warmup_is_linear_and_starts_above_zero():
    cfg = OptimConfig(lr=1.0, warmup_steps=4)
    assert [lr_multiplier(s, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_after_warmup_hand_values():
    cfg = OptimConfig(lr=1.0, warmup_steps=2, scheduler="cosine", min_lr_ratio=0.2)
    # total T = 6; progress p = (s - 2) / 4 ; f = 0.2 + 0.8 * 0.5 * (1 + cos(pi p))
    assert lr_multiplier(0, cfg, 6) == pytest.approx(0.5)
    assert lr_multiplier(2, cfg, 6) == pytest.approx(1.0)
    assert lr_multiplier(4, cfg, 6) == pytest.approx(0.2 + 0.4 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(6, cfg, 6) == pytest.approx(0.2)
    assert lr_multiplier(100, cfg, 6) == pytest.approx(0.2)


def test_warmup_ratio_resolves_against_total_steps():
    cfg = OptimConfig(warmup_ratio=0.25)
    assert cfg.warmup_length(20) == 5
    assert [lr_multiplier(s, cfg, 20) for s in (0, 4, 5)] == [0.2, 1.0, 1.0]


def test_scheduler_sets_optimizer_lr_per_step():
    model = nn.Linear(2, 2)
    cfg = OptimConfig(lr=0.1, warmup_steps=2)
    opt = build_optimizer(model.parameters(), cfg)
    sched = build_lr_scheduler(opt, cfg)
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1])


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"lr": -1e-3}, "lr"),
        ({"betas": [0.9, 1.0]}, "betas"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"scheduler": "linear"}, "scheduler"),
        ({"warmup_ratio": 1.5}, "warmup_ratio"),
        ({"warmup_steps": -1}, "warmup_steps"),
    ],
)
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        OptimConfig(**kwargs).validate()
    with pytest.raises(ValueError, match=key):
        build_optimizer(nn.Linear(2, 2).parameters(), OptimConfig(**kwargs))


def test_clip_gradients_hand_computed():
    a = nn.Parameter(torch.zeros(2))
    b = nn.Parameter(torch.zeros(1))
    a.grad = torch.tensor([3.0, 0.0])
    b.grad = torch.tensor([4.0])
    norm = clip_gradients([a, b], max_norm=1.0)
    assert norm == pytest.approx(5.0)
    assert torch.allclose(a.grad, torch.tensor([0.6, 0.0]), atol=1e-6)
    assert torch.allclose(b.grad, torch.tensor([0.8]), atol=1e-6)


def test_clip_disabled_only_measures():
    a = nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([3.0, 4.0])
    assert clip_gradients([a], max_norm=0.0) == pytest.approx(5.0)
    assert torch.equal(a.grad, torch.tensor([3.0, 4.0]))


def test_optimizer_needs_trainable_parameters():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        build_optimizer(model.parameters(), OptimConfig())
