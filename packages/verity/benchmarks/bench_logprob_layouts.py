"""Forward + backward of one quickstart-shaped micro-batch in the three layouts of ``response_logprobs``.

    python packages/verity/benchmarks/bench_logprob_layouts.py [--rows 128] [--group 8] [--repeats 15]

The embedded default's architecture (randomly initialised), one torch thread, ``rows`` rows in
groups of ``group`` samples per prompt (the quickstart's ``rollout.n=8``): left-padded prompts of
6-9 tokens in 9 columns and right-padded responses of 2-4 tokens in 8 columns (answers are a few
digits, ``data.max_response_length=8``). Layouts:

- ``full``: every column of every row;
- ``window``: the padding-free window (leading all-padding and trailing all-padding columns dropped);
- ``shared``: the window with each group's prompt computed once (:mod:`verity.engines.shared_prompt`).

The layouts alternate after a warm-up; the medians and their ratios are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from verity.engines.logprobs import response_logprobs
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.tiny_model import build_tiny_qwen2_for

PROMPT_COLUMNS, RESPONSE_COLUMNS = 9, 8
LAYOUTS = {"full": (False, False), "window": (True, False), "shared": (True, True)}  # trim, share


def quickstart_shaped_batch(
    rows: int, group: int = 8, seed: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(micro_batch, response_mask [rows, 8])``: left-padded prompts (each repeated ``group`` times), right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompts_needed = -(-rows // group)
    prompt_lens = torch.randint(6, PROMPT_COLUMNS + 1, (prompts_needed,), generator=g)
    prompt_mask = (torch.arange(PROMPT_COLUMNS) >= PROMPT_COLUMNS - prompt_lens[:, None]).long()
    prompts = torch.randint(5, 40, (prompts_needed, PROMPT_COLUMNS), generator=g) * prompt_mask
    prompts = prompts.repeat_interleave(group, 0)[:rows]
    prompt_mask = prompt_mask.repeat_interleave(group, 0)[:rows]
    response_lens = torch.randint(2, 5, (rows,), generator=g)
    response_mask = (torch.arange(RESPONSE_COLUMNS) < response_lens[:, None]).long()
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
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_qwen2_for(CharTokenizer())
    batch, mask = quickstart_shaped_batch(args.rows, args.group)

    def step(layout: str) -> float:
        trim, share = LAYOUTS[layout]
        start = time.perf_counter()
        model.zero_grad()
        logprobs, _ = response_logprobs(model, batch, trim_padding=trim, share_prompts=share)
        (logprobs * mask).sum().backward()
        return time.perf_counter() - start

    for _ in range(2):
        for layout in LAYOUTS:
            step(layout)
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for _ in range(args.repeats):
        for layout in LAYOUTS:
            times[layout].append(step(layout))
    median = {layout: statistics.median(t) for layout, t in times.items()}
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    print(
        f"{args.rows} rows in groups of {args.group}, forward+backward (median of {args.repeats}, "
        f"load average {load}): " + ", ".join(f"{layout} {ms * 1000:.1f} ms" for layout, ms in median.items())
    )
    print(
        f"full / window = {median['full'] / median['window']:.2f}, "
        f"window / shared = {median['window'] / median['shared']:.2f}, "
        f"full / shared = {median['full'] / median['shared']:.2f}"
    )


if __name__ == "__main__":
    main()
