"""Where a trained implicit PRM puts its process rewards: clean answers vs the same answers with a slip.

    python recipes/prime/scripts/prm_token_probe.py PRM_DIR REFERENCE_DIR DATA_FILE [--beta 0.05]

PRM_DIR is an exported PRM (``verity export RUN OUT --role prm``), REFERENCE_DIR the
checkpoint it started from (the embedded warm-start: ``~/.cache/verity/embedded/<key>/model``),
DATA_FILE held-out problems in the verl schema. For every problem it scores two responses
with the true answer, ``"<answer>"`` and ``"<answer>."`` (the embedded warm-start's designed
slip, which the strict verifier rejects), each followed by EOS, and prints per operation:

- the mean process reward r_t = beta * (log pi_prm - log pi_ref) on the answer's digits,
  on the full stop, and on the EOS token;
- the mean implicit score q = sum_t r_t of each variant, and how often q(clean) > q(slip).

A PRM that assigns credit by token puts a negative reward on the full stop itself.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def token_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """log p(response token | prompt, earlier response tokens), ``[len(response_ids)]``."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prm")
    parser.add_argument("reference")
    parser.add_argument("data")
    parser.add_argument("--beta", type=float, default=0.05)
    args = parser.parse_args(argv)

    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.prm)
    prm = AutoModelForCausalLM.from_pretrained(args.prm).eval()
    ref = AutoModelForCausalLM.from_pretrained(args.reference).eval()
    rows = pd.read_parquet(args.data)
    stats: dict[str, dict[str, list[float]]] = {}
    for _, row in rows.iterrows():
        messages = [dict(m) for m in row["prompt"]]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(prompt_ids, list):  # a BatchEncoding in recent transformers
            prompt_ids = list(prompt_ids["input_ids"])
        answer = str(row["reward_model"]["ground_truth"])
        operation = "-" if "-" in str(row["extra_info"]["expression"]) else "+"
        s = stats.setdefault(operation, {})
        scores = {}
        for name, text in (("clean", answer), ("slip", answer + ".")):
            response = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            r = args.beta * (
                token_logprobs(prm, prompt_ids, response) - token_logprobs(ref, prompt_ids, response)
            )
            scores[name] = float(r.sum())
            s.setdefault(f"{name}_digits", []).append(float(r[: len(answer)].mean()))
            s.setdefault(f"{name}_eos", []).append(float(r[-1]))
            if name == "slip":
                s.setdefault("slip_full_stop", []).append(float(r[len(answer)]))
            s.setdefault(f"{name}_q", []).append(scores[name])
        s.setdefault("clean_beats_slip", []).append(float(scores["clean"] > scores["slip"]))
    for operation, s in sorted(stats.items()):
        print(f"operation {operation} ({len(s['clean_q'])} problems)")
        for key, values in s.items():
            print(f"  {key:18s} {statistics.mean(values):+.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
