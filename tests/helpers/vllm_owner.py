"""A process that owns a VLLMRollout, generates once, reports what it holds, then waits to be killed.

    python tests/helpers/vllm_owner.py MODEL_DIR CACHE_DIR in_process|multi_process

Prints one line ``READY {"pid": ..., "descendants": [...], "segments": [...]}``: its
descendant processes and the /dev/shm files that it and they map. Used by the leak tests.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(model_dir: str, cache_dir: str, mode: str) -> None:
    import psutil
    from verity.rollout import SamplingParams
    from verity.rollout.orphan_reaper import mapped_segments
    from verity.rollout.vllm_rollout import VLLMRollout
    from verity_toyworld.char_tokenizer import CharTokenizer

    tokenizer = CharTokenizer()
    rollout = VLLMRollout(
        model_dir,
        tokenizer,
        max_model_len=64,
        kv_cache_bytes=16 * 1024**2,
        cache_dir=cache_dir,
        in_process=(mode == "in_process"),
    )
    ids = tokenizer("<bos>1+2=", add_special_tokens=False)["input_ids"]
    batch = {"input_ids": torch_tensor([ids]), "attention_mask": torch_tensor([[1] * len(ids)])}
    rollout.generate(batch, SamplingParams(do_sample=False, max_new_tokens=4))
    descendants = [p.pid for p in psutil.Process().children(recursive=True)]
    segments = sorted(mapped_segments([os.getpid(), *descendants]))
    print(
        "READY " + json.dumps({"pid": os.getpid(), "descendants": descendants, "segments": segments}),
        flush=True,
    )
    while True:
        time.sleep(1)


def torch_tensor(rows):
    import torch

    return torch.tensor(rows, dtype=torch.long)


if __name__ == "__main__":
    main(*sys.argv[1:4])
