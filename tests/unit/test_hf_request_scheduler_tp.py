"""The HF request scheduler on a tensor-parallel replica (2 gloo processes) against one process.

Both ranks are given the same ``add`` / ``step`` sequence and must decode in lockstep: the same
tokens on each rank, those of the scheduler on the whole model (greedy), and an admission the
ranks disagree on raises on both instead of hanging. One spawn runs every scenario.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import tiny_qwen2_config
from verity.rollout import HFRollout, SamplingParams
from verity.rollout.hf_tensor_parallel import TensorParallelHFRollout
from verity.rollout.requests import GenerationRequest

pytestmark = pytest.mark.slow

WORLD = 2
INIT = 0.5  # logits far apart: TP sums in another order than one process (test_hf_tensor_parallel)
EOS = list(range(3, 100, 9))
GREEDY = SamplingParams(do_sample=False)
SAMPLED = SamplingParams(temperature=1.0)
CONTEXTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31], [41, 42, 43, 44, 45, 46, 47]]
ARRIVALS = {0: [0, 1], 2: [2], 3: [3]}  # step -> the requests added before it


def make_model():
    from transformers import Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(tiny_qwen2_config(initializer_range=INIT)).eval()


def run(engine, params: SamplingParams) -> dict[int, list[int]]:
    """The arrivals through ``engine``'s scheduler: request id -> (tokens, log-probs)."""
    scheduler = engine.request_scheduler(params)
    done: dict = {}
    for step in range(100):
        for request_id in ARRIVALS.get(step, []):
            scheduler.add(GenerationRequest(request_id, CONTEXTS[request_id], 10))
        if not scheduler.pending() and step > max(ARRIVALS):
            break
        done.update({f.request_id: (f.token_ids, f.logprobs) for f in scheduler.step()})
    return done


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        engine = TensorParallelHFRollout.from_config(
            tiny_qwen2_config(initializer_range=INIT), tp_mesh=mesh, eos_token_ids=EOS, pad_token_id=0, seed=5
        )
        engine.load_weights(make_model().state_dict().items())
        out: dict = {"greedy": run(engine, GREEDY), "sampled": run(engine, SAMPLED)}
        skewed = engine.request_scheduler(GREEDY)
        skewed.add(GenerationRequest(0, [11, 12 + rank], 4))
        try:
            skewed.step()
            out["skewed"] = "no error"
        except RuntimeError as error:
            out["skewed"] = str(error)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_and_load(_worker, WORLD, str(tmp_path_factory.mktemp("scheduler_tp")))


def test_ranks_decode_in_lockstep_and_as_the_whole_model(results):
    first, second = results
    assert first["greedy"] == second["greedy"] and first["sampled"] == second["sampled"]
    want = run(HFRollout(make_model(), eos_token_ids=EOS, pad_token_id=0, seed=5), GREEDY)
    assert sorted(first["greedy"]) == sorted(want) == [0, 1, 2, 3]
    for request_id, (tokens, logprobs) in want.items():
        got_tokens, got_logprobs = first["greedy"][request_id]
        assert got_tokens == tokens
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_an_admission_the_ranks_disagree_on_raises_on_every_rank(results):
    for out in results:
        assert "every rank of a replica must generate the same batch in lockstep" in out["skewed"]
