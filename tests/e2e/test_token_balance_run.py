"""Token-balanced ranks and longest-first micro-batches leave a GRPO step's metrics unchanged.

Two 1-step runs on 2 workers with the same data and seed: today's layout (``actor.balance_tokens=false``,
consecutive row micro-batches) and the balanced one with a token budget. Generation is not balanced, so
both sample the same responses; the log-prob passes and the update run on rows placed differently over
the ranks and the micro-batches, and must give the same losses and gradient norm to float tolerance.
"""

from __future__ import annotations

import json

import pytest
from verity.config import load_config

pytestmark = pytest.mark.slow  # two 1-step runs: about 40 s on 2 cores

COMPARED = (
    "reward/mean",
    "response_length/mean",
    "actor/loss",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/entropy",
)


def test_balanced_step_equals_the_consecutive_one(tiny_grpo_overrides, tmp_path, monkeypatch) -> None:
    import verity.controller.dispatch as dispatch
    from verity.launch.run import run_training

    orders: list[tuple[int, int, bool]] = []
    original = dispatch.balanced_order

    def recording(costs, parts, mini_batch_rows=0):
        order = original(costs, parts, mini_batch_rows)
        orders.append((len(costs), mini_batch_rows, bool((order != order.sort().values).any())))
        return order

    monkeypatch.setattr(dispatch, "balanced_order", recording)
    common = (
        "actor.ppo_mini_batch_size=4",  # 2 optimizer steps: rows move only within their mini-batch
        "algorithm.kl.use_kl_loss=true",  # a reference pass, and old log-probs recomputed
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
        "data.val_max_samples=8",
    )
    rows = {}
    for name, extra in (
        ("plain", ("actor.balance_tokens=false",)),
        ("balanced", ("actor.balance_tokens=true", "actor.fsdp2.micro_batch_tokens=76")),
    ):
        out = tmp_path / name
        run_training(load_config(tiny_grpo_overrides(str(out), *common, *extra)))
        rows[name] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # old log-probs, reference log-probs and the update (2 mini-batches of 16 rows) were balanced
    assert [(rows_, mini) for rows_, mini, _ in orders] == [(32, 0), (32, 0), (32, 16)]
    assert any(moved for _, _, moved in orders)  # some rows really changed rank
    plain, balanced = rows["plain"], rows["balanced"]
    for key in COMPARED:
        assert balanced[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
