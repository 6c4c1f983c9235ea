"""Agent rollouts with a slow, heavy-tailed tool: request-level loop against the turn-synchronous barrier.

    python packages/verity/benchmarks/bench_agent_rollout.py [--rows 64] [--tool-workers 32]
        [--slow-share 0.2] [--slow-s 2.0] [--fast-s 0.05] [--repeats 2] [--hidden 64] [--layers 2]

Each of ``rows`` trajectories calls the tool ``lookup`` 2, 3 or 4 times (3-5 model turns,
chosen by a seeded draw per row) and then answers. Every call sleeps ``slow-s`` seconds with
probability ``slow-share`` and ``fast-s`` otherwise, drawn from a seeded hash of the call's
row and turn, so both sides meet exactly the same latencies. The policy is a random-init
tiny Qwen2 on the HF engine, reached only through ``engine.request_scheduler``: every
request decodes as many tokens as its scripted turn has (the real decode cost), and the
scheduler hands back the scripted tokens (a hermes tool call, or the answer) in their
place, so the number of turns is what the draw says. Greedy.

The two sides alternate (``repeats`` times each, after a warm-up of the tool processes):
``request`` is :meth:`AgentRollout.generate` as it runs; ``barrier`` the same loop holding
every next turn until all trajectories' turns and tools are done (the older
turn-synchronous loop, :data:`verity.rollout.agent.scheduling.TURN_BARRIER`). Prints each
side's median rollout wall time, their ratio, the engine's busy fraction (time the
scheduler was stepping / wall time), the mean tool wait per trajectory, the requests in
flight per step, whether both sides wrote the same tokens, and the tool time alone of
each side (no decoding: the barrier's sum of slowest calls per round against the
trajectory with the most tool time), the ratio the loop would reach with free decoding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

SEED = 0
SLOW = {"share": 0.2, "slow_s": 2.0, "fast_s": 0.05}  # set by main() before the tool processes start


def latency_s(key: str, share: float = 0.2, slow_s: float = 2.0, fast_s: float = 0.05) -> float:
    """The seeded latency of the call with ``key``: ``slow_s`` with probability ``share``, else ``fast_s``."""
    draw = int(hashlib.sha256(f"{SEED}:{key}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return slow_s if draw < share else fast_s


def lookup(arguments: dict[str, Any], **row_kwargs: Any) -> str:
    """The benchmark's tool: sleeps a seeded heavy-tailed time (``row_kwargs``: the latency law)."""
    key = str(arguments.get("key", ""))
    time.sleep(latency_s(key, **{k: float(v) for k, v in row_kwargs.items()}))
    return f"value of {key}"


def tool_bounds(calls: list[int], law: dict[str, float]) -> tuple[float, float]:
    """Seconds of tool time alone: the barrier's (each round waits for its slowest call) and
    the request-level loop's (the trajectory with the most tool time), with no decoding."""
    rounds = max(calls)
    barrier = sum(
        max(latency_s(f"r{row}t{t}", **law) for row, n in enumerate(calls) if n > t) for t in range(rounds)
    )
    request = max(sum(latency_s(f"r{row}t{t}", **law) for t in range(n)) for row, n in enumerate(calls))
    return barrier, request


TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a key up.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def scripted_turn(context: str) -> str:
    """The text of the next turn for ``context``: a call while the row owes calls, then the answer."""
    body = context.split("calls:", 1)[1]
    wanted, _, rest = body.partition("|")
    row, _, calls = wanted.partition("/")
    done = rest.count("<tool_response>")
    if done < int(calls):
        call = {"name": "lookup", "arguments": {"key": f"r{row}t{done}"}}
        return "<tool_call>" + json.dumps(call, separators=(",", ":")) + "</tool_call>"
    return "=done"


class ScriptedScheduler:
    """Wraps the engine's scheduler: real decoding of the scripted length, scripted tokens handed back."""

    def __init__(self, inner: Any, tokenizer: Any, eos: int) -> None:
        self.inner = inner
        self.tokenizer = tokenizer
        self.eos = eos
        self.script: dict[int, list[int]] = {}

    def add(self, request: Any) -> None:
        text = scripted_turn(self.tokenizer.decode(list(request.context), skip_special_tokens=False))
        tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos]
        self.script[request.request_id] = tokens[: request.max_new_tokens]
        self.inner.add(replace(request, max_new_tokens=len(self.script[request.request_id])))

    def step(self) -> list[Any]:
        out = []
        for done in self.inner.step():
            tokens = self.script.pop(done.request_id)
            out.append(replace(done, token_ids=tokens, logprobs=[0.0] * len(tokens)))
        return out

    def pending(self) -> int:
        return self.inner.pending()

    def close(self) -> None:
        self.inner.close()


def build_agent(args: argparse.Namespace) -> tuple[Any, Any]:
    from verity.rollout import HFRollout
    from verity.rollout.agent.config import AgentConfig, ToolConfig
    from verity.rollout.agent.loop import AgentRollout
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(
        tokenizer, seed=0, max_pos=1024, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
        intermediate=3 * args.hidden,
    ).eval()  # fmt: skip

    class ScriptedHF(HFRollout):
        def request_scheduler(self, params: Any) -> Any:
            inner = super().request_scheduler(replace(params, ignore_eos=True))
            return ScriptedScheduler(inner, tokenizer, tokenizer.eos_token_id)

    config = AgentConfig(
        enabled=True,
        max_turns=5,
        tool_workers=args.tool_workers,
        tools=[ToolConfig(class_name="bench_agent_rollout:lookup", tool_schema=TOOL_SCHEMA, timeout_s=30.0)],
    )
    engine = ScriptedHF(model, tokenizer, seed=0)
    return AgentRollout(engine, tokenizer, config, max_model_len=1024), tokenizer


def prompts(args: argparse.Namespace, tokenizer: Any) -> Any:
    from verity.batch import Batch
    from verity.rollout import encode_prompts

    draw = random.Random(SEED)
    calls = [draw.choice([2, 3, 4]) for _ in range(args.rows)]
    law = {"share": args.slow_share, "slow_s": args.slow_s, "fast_s": args.fast_s}
    texts = [f"calls:{row}/{n}|" for row, n in enumerate(calls)]
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in texts])
    extra = [{"tools_kwargs": {"lookup": {"execute_kwargs": law}}} for _ in texts]
    batch = Batch.from_dict(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]},
        non_tensors={"extra_info": extra},
    )
    return batch, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tool-workers", type=int, default=32)
    parser.add_argument("--slow-share", type=float, default=0.2)
    parser.add_argument("--slow-s", type=float, default=2.0)
    parser.add_argument("--fast-s", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--budget", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tool processes import this module
    from verity.rollout import SamplingParams
    from verity.rollout.agent.metrics import agent_batch_metrics
    from verity.rollout.agent.scheduling import REQUEST_LEVEL, TURN_BARRIER

    agent, tokenizer = build_agent(args)
    batch, calls = prompts(args, tokenizer)
    params = SamplingParams(max_new_tokens=args.budget, temperature=0.0)
    agent.executor._get_pool().warm_up(__import__, ("bench_agent_rollout",))
    results: dict[str, list[dict[str, float]]] = {REQUEST_LEVEL: [], TURN_BARRIER: []}
    outputs: dict[str, Any] = {}
    try:
        for _ in range(args.repeats):
            for policy in (REQUEST_LEVEL, TURN_BARRIER):
                start = time.perf_counter()
                out = agent.generate_with_policy(batch, params, policy)
                wall = time.perf_counter() - start
                metrics = agent_batch_metrics(out)
                metrics["wall_s"] = wall
                results[policy].append(metrics)
                outputs[policy] = out
    finally:
        agent.close()
    turns = outputs[REQUEST_LEVEL]["num_turns"].tolist()
    print(
        f"rows={args.rows} calls/row: {dict(sorted((n, calls.count(n)) for n in set(calls)))} "
        f"turns/row mean {statistics.mean(turns):.2f}; tool: {args.slow_share:.0%} {args.slow_s:g} s, "
        f"else {args.fast_s:g} s; tool_workers={args.tool_workers}; model hidden={args.hidden} "
        f"layers={args.layers}; repeats={args.repeats}; torch threads=1"
    )
    summary = {}
    for policy, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        row = {
            "wall_s": wall,
            "engine_busy_fraction": statistics.median(r["agent/engine_busy_fraction"] for r in runs),
            "tool_wait_s_mean": statistics.median(r["agent/tool_wait_s_mean"] for r in runs),
            "tool_queue_s_mean": statistics.median(r["agent/tool_queue_s_mean"] for r in runs),
            "requests_in_flight_mean": statistics.median(r["agent/requests_in_flight_mean"] for r in runs),
            "requests_in_flight_max": max(r["agent/requests_in_flight_max"] for r in runs),
            "walls": [round(r["wall_s"], 2) for r in runs],
        }
        summary[policy] = row
        print(
            f"{policy:8s} wall {wall:6.2f} s (runs {row['walls']})  engine busy {row['engine_busy_fraction']:.3f}  "
            f"tool wait/traj {row['tool_wait_s_mean']:.2f} s (queue {row['tool_queue_s_mean']:.3f} s)  "
            f"in flight mean {row['requests_in_flight_mean']:.1f} max {row['requests_in_flight_max']:.0f}"
        )
    same = torch.equal(outputs[REQUEST_LEVEL]["responses"], outputs[TURN_BARRIER]["responses"]) and (
        outputs[REQUEST_LEVEL]["trajectory"] == outputs[TURN_BARRIER]["trajectory"]
    )
    ratio = summary[TURN_BARRIER]["wall_s"] / summary[REQUEST_LEVEL]["wall_s"]
    law = {"share": args.slow_share, "slow_s": args.slow_s, "fast_s": args.fast_s}
    barrier_tools, request_tools = tool_bounds(calls, law)
    print(
        f"tool time alone (no decoding): barrier {barrier_tools:.2f} s, request {request_tools:.2f} s, "
        f"ratio {barrier_tools / request_tools:.2f}x (the most the loop alone can gain here)"
    )
    print(f"barrier / request wall time: {ratio:.2f}x   same tokens and trajectories: {same}")
    print(json.dumps({"ratio": ratio, "same": same, **summary}))


if __name__ == "__main__":
    main()
