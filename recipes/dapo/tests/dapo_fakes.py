"""Stand-ins for the actor group, the reward manager and the prompt loader, for the DAPO stage tests.

Each prompt carries a *kind* in ``extra_info``: ``right`` (every sample correct), ``wrong``
(every sample wrong) or ``mixed`` (even samples of its group correct, odd ones wrong); a
kind ending in ``+long`` (``mixed+long``) makes every response of the prompt truncated.
The fake actor samples response lengths from a generator seeded by the call's seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from verity.batch import Batch

PAD, EOS, R = 0, 2, 10


@dataclass
class FakeTokenizer:
    pad_token_id: int = PAD
    eos_token_id: int = EOS


def prompt_batch(kinds: list[str], tag: str, width: int) -> Batch:
    """Left-padded prompts of ``width`` columns (each prompt 2 real tokens), one per kind."""
    size = len(kinds)
    input_ids = torch.full((size, width), PAD, dtype=torch.long)
    attention_mask = torch.zeros((size, width), dtype=torch.long)
    input_ids[:, -2:] = 7
    attention_mask[:, -2:] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return Batch.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        {
            "uid": [f"{tag}-{i}" for i in range(size)],
            "data_source": ["math_dapo"] * size,
            "ground_truth": ["1"] * size,
            "extra_info": [{"kind": k.split("+")[0], "long": k.endswith("+long")} for k in kinds],
        },
    )


class FakeLoader:
    """``next_batch()`` returns the given prompt batches in order (widths 3, 4, 5, ...), counting draws."""

    def __init__(self, batches: list[list[str]]) -> None:
        self.batches = [prompt_batch(kinds, f"b{i}", 3 + i) for i, kinds in enumerate(batches)]
        self.drawn = 0

    def next_batch(self) -> Batch:
        if self.drawn >= len(self.batches):
            raise AssertionError("the fake loader ran out of prompt batches")
        self.drawn += 1
        return self.batches[self.drawn - 1]


@dataclass
class FakeActor:
    """``generate`` like the actor group (one response per row); records seeds and updates."""

    seeds: list[int] = field(default_factory=list)
    updates: list[Batch] = field(default_factory=list)
    scored: list[int] = field(default_factory=list)  # rows of each score call
    generated: Batch | None = None  # the last generate call's rows: what the ranks hold

    def generate(self, rows: Batch) -> Batch:
        seed = int(rows.meta["seed"])
        self.seeds.append(seed)
        gen = torch.Generator().manual_seed(seed)
        size = len(rows)
        lengths = torch.randint(2, R - 2, (size,), generator=gen)
        long = torch.tensor([info.get("long", False) for info in rows["extra_info"]])
        lengths = torch.where(long, torch.full_like(lengths, R), lengths)
        responses = torch.full((size, R), PAD, dtype=torch.long)
        mask = torch.zeros((size, R), dtype=torch.long)
        for i, n in enumerate(lengths.tolist()):
            responses[i, :n] = 5
            mask[i, :n] = 1
            if not long[i]:
                responses[i, n - 1] = EOS
        out = rows.select(*rows.keys())
        prompts = rows["input_ids"]
        out["prompts"] = prompts
        out["responses"] = responses
        out["response_mask"] = mask
        out["input_ids"] = torch.cat([prompts, responses], 1)
        out["attention_mask"] = torch.cat([rows["attention_mask"], mask], 1)
        out["position_ids"] = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        self.generated = out
        return out

    def score(self, request: Batch) -> Batch:
        """``reward.placement=workers``: the ranks score the rows they generated, as FakeRewards would."""
        assert self.generated is not None and len(request) == len(self.generated)
        assert torch.equal(request["responses"], self.generated["responses"])
        self.scored.append(len(request))
        scores, extra, _ = FakeRewards().score(self.generated)
        return Batch.from_dict(
            {
                "scores": scores,
                "acc": torch.tensor(extra["acc"]),
                "reward_status": torch.zeros(len(request), dtype=torch.int8),
            }
        )

    def update_actor(self, batch: Batch) -> dict[str, float]:
        self.updates.append(batch)
        return {"actor/pg_loss": 0.0}


class FakeRewards:
    """DAPO-style +1 / -1 scores from each prompt's kind (see the module docstring)."""

    tokenizer = FakeTokenizer()

    def score(self, batch: Batch):
        seen: dict[int, int] = {}
        acc = []
        for group, info in zip(batch["group"].tolist(), batch["extra_info"], strict=True):
            index = seen.get(group, 0)
            seen[group] = index + 1
            kind = info["kind"]
            acc.append(1.0 if kind == "right" or (kind == "mixed" and index % 2 == 0) else 0.0)
        scores = torch.tensor([1.0 if a else -1.0 for a in acc])
        return scores, {"acc": acc}, {}
