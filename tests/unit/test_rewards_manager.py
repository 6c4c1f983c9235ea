"""RewardManager: dispatch, per-sample timeouts, crashes, metrics, decoding, token placement."""

from __future__ import annotations

import logging
import operator
import pickle

import pytest
import torch
from verity.batch import Batch
from verity.rewards import RewardFailureError, RewardManager, RewardManagerConfig, token_rewards_from_scores
from verity.rewards.process_pool import TimeoutPool

HOSTILE = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "spin":
        while True:
            pass
    if solution_str == "sleep":
        time.sleep(3600)
    if solution_str == "raise":
        raise RuntimeError("verifier bug")
    if solution_str == "die":
        os._exit(7)
    if solution_str == "text":
        return "not a number"
    return {"score": float(solution_str == ground_truth), "length": len(solution_str)}
"""


@pytest.fixture
def hostile_file(tmp_path):
    path = tmp_path / "hostile_reward.py"
    path.write_text(HOSTILE)
    return path


def _rows(texts, truth="ok", source="mine"):
    return [{"data_source": source, "solution_str": t, "ground_truth": truth} for t in texts]


def test_hung_raising_and_crashing_verifiers_do_not_stall_scoring(hostile_file, caplog):
    config = {
        "num_workers": 2,
        "timeout_s": 1.0,
        "failure_score": -0.5,
        "custom_path": str(hostile_file),
        "max_failure_rate": 1.0,  # 5 of 8 fail: scored and summarised, not raised
    }
    texts = ["ok", "spin", "bad", "sleep", "raise", "die", "text", "ok"]
    with caplog.at_level(logging.WARNING, logger="verity.rewards"), RewardManager(config) as manager:
        scores, extra, metrics = manager.score(_rows(texts))
        # the pool recovered: a second call works with fresh workers
        again, _, again_metrics = manager.score(_rows(["ok", "no"]))
    assert scores.dtype == torch.float32
    assert scores.tolist() == [1.0, -0.5, 0.0, -0.5, -0.5, -0.5, -0.5, 1.0]
    assert extra["reward_status"] == ["ok", "timeout", "ok", "timeout", "error", "error", "error", "ok"]
    assert "RuntimeError: verifier bug" in extra["reward_error"][4]
    assert "exit code 7" in extra["reward_error"][5]
    assert extra["length"][0] == 2 and extra["length"][1] is None
    assert metrics["reward/timeouts"] == 2.0
    assert metrics["reward/errors"] == 3.0
    assert metrics["reward/mean"] == pytest.approx((1 + 0 + 1 - 0.5 * 5) / 8)
    assert again.tolist() == [1.0, 0.0] and again_metrics["reward/errors"] == 0.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # one summary for the call, not one line per sample
    assert "5 of 8 samples failed (3 errors, 2 timeouts)" in warnings[0]
    assert (
        "first: sample 1" in warnings[0] and "'spin'" in warnings[0]
    )  # the first failure, with its response


def test_failures_above_the_rate_stop_scoring_with_the_first_traceback(hostile_file):
    config = {"num_workers": 1, "timeout_s": 5.0, "custom_path": str(hostile_file)}
    with RewardManager(config) as manager:
        _, _, metrics = manager.score(_rows(["raise", "ok", "ok"]))  # 1 of 3: tolerated
        assert metrics["reward/errors"] == 1.0
        with pytest.raises(RewardFailureError) as caught:
            manager.score(_rows(["ok", "text", "raise", "raise"]))  # 3 of 4 > 0.5
    message = str(caught.value)
    assert "3 of 4 samples failed (3 errors, 0 timeouts)" in message
    assert "reward.max_failure_rate = 0.5" in message
    assert "first failure: sample 1" in message.lower() and "RewardResultError" in message
    assert "Traceback" in message  # the worker's traceback, not only the last line


def test_hung_samples_time_out_in_parallel(hostile_file):
    # one worker, eight hung samples: the pool widens instead of running eight timeouts in a row
    config = {"num_workers": 1, "timeout_s": 1.0, "custom_path": str(hostile_file), "max_failure_rate": 1.0}
    with RewardManager(config) as manager:
        _, extra, metrics = manager.score(_rows(["sleep"] * 8 + ["ok"]))
        pool = manager._pool
        assert pool is not None and pool.peak_workers >= 9  # all hung samples were in flight at once
        assert len(pool.worker_pids()) == 1  # and the pool shrank back afterwards
    assert extra["reward_status"] == ["timeout"] * 8 + ["ok"]
    assert metrics["reward/timeouts"] == 8.0


def test_dispatch_by_data_source_and_metrics_per_source():
    rows = [
        {"data_source": "openai/gsm8k", "solution_str": "#### 1,000", "ground_truth": "1000"},
        {"data_source": "openai/gsm8k", "solution_str": "1000", "ground_truth": "1000"},
        {"data_source": "lighteval/MATH", "solution_str": "\\boxed{\\frac12}", "ground_truth": "0.5"},
        {"data_source": "math_dapo", "solution_str": "Answer: 3", "ground_truth": "4"},
    ]
    with RewardManager({"num_workers": 1}) as manager:
        scores, extra, metrics = manager.score(rows)
    assert scores.tolist() == [1.0, 0.0, 1.0, -1.0]
    assert extra["pred"] == ["1000", None, "\\frac12", "3"]
    assert metrics["reward/openai/gsm8k/mean"] == 0.5
    assert metrics["reward/lighteval/MATH/mean"] == 1.0
    assert metrics["reward/math_dapo/mean"] == -1.0
    assert metrics["reward/acc"] == pytest.approx(2 / 4)


def test_built_in_verifiers_score_in_process_and_user_functions_in_the_pool(hostile_file):
    builtin = [
        {"data_source": "openai/gsm8k", "solution_str": "#### 7", "ground_truth": "7"},
        {"data_source": "math_dapo", "solution_str": "Answer: 3", "ground_truth": "4"},
        {"data_source": "verity/arithmetic", "solution_str": "12", "ground_truth": "12"},
        {"data_source": "verity/arithmetic", "solution_str": "13", "ground_truth": "12"},
    ]
    with RewardManager({"num_workers": 1}) as inline:
        scores, extra, metrics = inline.score(builtin)
        assert inline._pool is None  # nothing left the process
    with RewardManager({"num_workers": 1, "inline_builtin": False}) as pooled:
        p_scores, p_extra, p_metrics = pooled.score(builtin)
        assert pooled._pool is not None
    assert scores.tolist() == p_scores.tolist() == [1.0, -1.0, 1.0, 0.0]
    assert extra == p_extra and metrics == p_metrics
    # a user function is never run in-process: its hang still times out in the pool
    user = {"num_workers": 1, "timeout_s": 1.0, "custom_path": str(hostile_file), "max_failure_rate": 1.0}
    with RewardManager(user) as manager:
        scores, extra, _ = manager.score(_rows(["ok", "spin"]))
    assert extra["reward_status"] == ["ok", "timeout"] and scores.tolist() == [1.0, 0.0]


def test_overrides_and_per_source_timeouts():
    rows = [{"data_source": "openai/gsm8k", "solution_str": "it is 12", "ground_truth": "12"}]
    manager = RewardManager({"num_workers": 0, "overrides": {"openai/gsm8k": "gsm8k_flexible"}})
    assert manager.score(rows)[0].tolist() == [1.0]
    config = RewardManagerConfig.from_any({"timeout_overrides": {"code": 30.0}, "timeout_s": 2.0})
    assert config.timeout_overrides == {"code": 30.0} and config.timeout_s == 2.0


def test_inline_mode_scores_errors_without_a_pool(hostile_file):
    manager = RewardManager({"num_workers": 0, "custom_path": str(hostile_file)})
    scores, extra, metrics = manager.score(_rows(["ok", "raise"]))
    assert scores.tolist() == [1.0, 0.0]
    assert metrics["reward/errors"] == 1.0


def test_unknown_data_source_fails_before_scoring():
    with pytest.raises(ValueError, match="no reward function"):
        RewardManager({"num_workers": 0}).score(_rows(["x"], source="who_knows"))


class _DigitTokenizer:
    """Decodes ids 0-9 as digits; 10 is '#', 11 is ' ', 12 is EOS (dropped as a special token)."""

    def batch_decode(self, ids, skip_special_tokens=True):
        table = {
            **{i: str(i) for i in range(10)},
            10: "#",
            11: " ",
            12: "" if skip_special_tokens else "<eos>",
        }
        return ["".join(table[i] for i in row) for row in ids]


def test_batch_input_decodes_responses_with_the_mask():
    responses = torch.tensor([[10, 10, 10, 10, 11, 4, 2, 12], [4, 2, 12, 9, 9, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0]])
    batch = Batch.from_dict(
        {"responses": responses, "response_mask": mask},
        {"data_source": ["openai/gsm8k"] * 2, "ground_truth": ["42", "42"], "extra_info": [{}, {}]},
    )
    with RewardManager({"num_workers": 1}, tokenizer=_DigitTokenizer()) as manager:
        scores, extra, _ = manager.score(batch)
    assert scores.tolist() == [1.0, 0.0]  # "#### 42" vs "42" (strict needs ####)
    assert extra["pred"] == ["42", None]


def test_manager_pickles_without_its_pool():
    manager = RewardManager({"num_workers": 1})
    manager.score(_rows(["#### 1"], truth="1", source="gsm8k"))
    clone = pickle.loads(pickle.dumps(manager))
    assert clone._pool is None and clone.config == manager.config
    assert clone.score(_rows(["#### 1"], truth="1", source="gsm8k"))[0].tolist() == [1.0]
    clone.close()
    manager.close()


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="timeout_s"):
        RewardManagerConfig(timeout_s=0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardManagerConfig(num_workers=-1)


def test_config_from_run_config_style_objects():
    class Section:
        num_workers = 3
        timeout_s = 5.0
        failure_score = -1.0
        custom_path = "/x.py"
        custom_name = "fn"

    config = RewardManagerConfig.from_any(Section())
    assert (config.num_workers, config.timeout_s, config.failure_score) == (3, 5.0, -1.0)
    assert (config.custom_path, config.custom_name) == ("/x.py", "fn")
    nested = RewardManagerConfig.from_any(
        {"custom_reward": {"path": "/y.py", "name": "g", "kwargs": {"a": 1}}}
    )
    assert (nested.custom_path, nested.custom_name, nested.custom_kwargs) == ("/y.py", "g", {"a": 1})


def test_timeout_pool_keeps_order_and_rejects_bad_timeouts():
    # a stdlib function: the worker unpickles it without importing this (torch-heavy) test module
    with TimeoutPool(2) as pool:
        outcomes = pool.map(operator.mul, [(i, i) for i in range(10)], 30.0)
        assert [o.value for o in outcomes] == [i * i for i in range(10)]
        assert [o.status for o in outcomes] == ["ok"] * 10
        with pytest.raises(ValueError, match="timeout_s"):
            pool.map(operator.mul, [(1, 1)], 0)


def test_token_rewards_on_last_real_token():
    scores = torch.tensor([1.0, -2.0, 3.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    expected = torch.tensor([[0.0, 0.0, 1.0, 0.0], [-2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(token_rewards_from_scores(scores, mask), expected)
    with pytest.raises(ValueError, match="response_mask"):
        token_rewards_from_scores(scores, mask[:2])


def test_slow_importing_user_module_is_loaded_at_worker_start(tmp_path):
    # importing takes longer than the per-sample timeout; start-up is not charged to samples
    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(1.5)\n\ndef compute_score(**kwargs):\n    return 1.0\n")
    with RewardManager({"num_workers": 1, "timeout_s": 1.0, "custom_path": str(path)}) as manager:
        scores, extra, _ = manager.score(_rows(["a", "b"]))
    assert scores.tolist() == [1.0, 1.0]
    assert extra["reward_status"] == ["ok", "ok"]


def test_an_interrupted_call_leaves_no_stale_task_behind():
    import signal
    import time

    def interrupt(signum, frame):
        raise RuntimeError("stage time limit")

    with TimeoutPool(1) as pool:
        pool.map(operator.add, [(0, 0)], 60)  # the worker is up: the sleep below is really running
        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 1.0)
            with pytest.raises(RuntimeError, match="stage time limit"):
                pool.map(time.sleep, [(60,)], 120)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        outcome = pool.map(operator.add, [(1, 2)], 30)[0]  # not the sleeping task's late answer
    assert outcome.status == "ok" and outcome.value == 3
