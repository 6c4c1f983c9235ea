"""Forward + backward of one quickstart-shaped micro-batch, padding-free window against full width.

    python packages/verity/benchmarks/bench_padding_trim.py [--rows 128] [--repeats 15]

The embedded default's architecture (randomly initialised), one torch thread, ``rows``
left-padded prompts of 6-9 tokens in 9 columns and right-padded responses of 2-4 tokens in 8
columns (the quickstart's shape: answers are a few digits, ``data.max_response_length=8``).
The two variants alternate after a warm-up; the medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from verity.data.char_tokenizer import CharTokenizer
from verity.data.tiny_model import build_tiny_qwen2_for
from verity.engines.logprobs import response_logprobs

PROMPT_COLUMNS, RESPONSE_COLUMNS = 9, 8


def quickstart_shaped_batch(rows: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(micro_batch, response_mask [rows, 8])`` with left-padded prompts and right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(6, PROMPT_COLUMNS + 1, (rows,), generator=g)
    response_lens = torch.randint(2, 5, (rows,), generator=g)
    prompt_mask = (torch.arange(PROMPT_COLUMNS) >= PROMPT_COLUMNS - prompt_lens[:, None]).long()
    response_mask = (torch.arange(RESPONSE_COLUMNS) < response_lens[:, None]).long()
    prompts = torch.randint(5, 40, (rows, PROMPT_COLUMNS), generator=g) * prompt_mask
    responses = torch.randint(5, 40, (rows, RESPONSE_COLUMNS), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    batch = {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
    }
    return batch, response_mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_qwen2_for(CharTokenizer())
    batch, mask = quickstart_shaped_batch(args.rows)

    def step(trim: bool) -> float:
        start = time.perf_counter()
        model.zero_grad()
        logprobs, _ = response_logprobs(model, batch, trim_padding=trim)
        (logprobs * mask).sum().backward()
        return time.perf_counter() - start

    for _ in range(2):
        step(True), step(False)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for trim in (True, False):
            times[trim].append(step(trim))
    trimmed, full = statistics.median(times[True]), statistics.median(times[False])
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    print(
        f"{args.rows} rows, forward+backward: padding-free window {trimmed * 1000:.1f} ms, "
        f"full width {full * 1000:.1f} ms, full / trimmed = {full / trimmed:.2f} (load average {load})"
    )


if __name__ == "__main__":
    main()
