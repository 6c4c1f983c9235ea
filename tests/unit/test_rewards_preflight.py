"""Reward checks before any worker starts: unknown data sources, broken user reward functions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from verity.config import load_config
from verity.rewards.preflight import RewardSetupError, check_rewards


def dataset(*sources: str, truth: str = "7") -> SimpleNamespace:
    records = [
        SimpleNamespace(data_source=s, ground_truth=truth, extra_info={"index": i})
        for i, s in enumerate(sources)
    ]
    return SimpleNamespace(records=records)


def splits(train: SimpleNamespace, val: SimpleNamespace) -> dict:
    return {"train": (["train.parquet"], train), "val": (["test.parquet"], val)}


def test_every_unknown_source_of_both_splits_is_listed_with_a_way_that_loads():
    data = splits(dataset("openai/gsm8k", "my/source", "my/source"), dataset("other_set"))
    with pytest.raises(RewardSetupError) as caught:
        check_rewards({"num_workers": 1}, data)
    message = str(caught.value)
    assert "'my/source': 2 rows of data.train_files ['train.parquet']" in message
    assert "'other_set': 1 rows of data.val_files ['test.parquet']" in message
    assert "openai/gsm8k" not in message.split("Built-in")[0]  # a known source is not listed
    suggested = message.split("command line with '")[1].split("'")[0]
    assert load_config([suggested]).reward.overrides == {"my/source": "gsm8k_strict"}  # the advice works
    check_rewards(
        {"overrides": {"my/source": "gsm8k_strict", "other_set": "math_boxed"}}, data
    )  # mapped: fine


BROKEN = {
    "syntax": ("def compute_score(:\n", "score", "cannot be imported: SyntaxError"),
    "import": ("import no_such_module_here\n", "score", "cannot be imported: ModuleNotFoundError"),
    "name": (
        "def scorer(**kw):\n    return 1.0\n",
        "score",
        "has no function 'score'; it defines ['scorer']",
    ),
    "raises": ("def score(**kw):\n    raise KeyError('answer')\n", "score", "raised KeyError: 'answer'"),
    "text": ("def score(**kw):\n    return 'right'\n", "score", "returned str; expected a float"),
    "hangs": ("import time\ndef score(**kw):\n    time.sleep(60)\n", "score", "did not return within 1 s"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_user_reward_function_is_named_with_what_went_wrong(tmp_path, case):
    code, name, expected = BROKEN[case]
    path = tmp_path / f"reward_{case}.py"
    path.write_text(code)
    config = {"custom_path": str(path), "custom_name": name, "timeout_s": 1.0}
    with pytest.raises(RewardSetupError) as caught:
        check_rewards(config, splits(dataset("anything"), dataset("anything")))
    message = str(caught.value)
    assert f"reward.custom_path={str(path)!r}" in message and "reward.custom_name='score'" in message
    assert expected in message, message


def test_a_working_user_function_and_its_kwargs_pass(tmp_path):
    path = tmp_path / "reward_ok.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
        "    assert solution_str == ground_truth and extra_info['index'] == 0\n"
        "    return scale\n"
    )
    config = {"custom_path": str(path), "custom_name": "score", "custom_kwargs": {"scale": 2.0}}
    check_rewards(config, splits(dataset("anything"), dataset("anything")))


def test_out_of_range_reward_settings_name_the_key():
    with pytest.raises(RewardSetupError, match=r"reward.max_failure_rate"):
        check_rewards({"max_failure_rate": 2.0}, splits(dataset("openai/gsm8k"), dataset("openai/gsm8k")))


@pytest.mark.parametrize("key", ["overrides", "timeout_overrides"])
def test_an_override_for_a_source_the_data_lacks_is_rejected(key):
    value = {"math/typo": "math_boxed"} if key == "overrides" else {"math/typo": 30.0}
    data = splits(dataset("openai/gsm8k"), dataset("openai/gsm8k"))
    with pytest.raises(RewardSetupError) as caught:
        check_rewards({key: value}, data)
    message = str(caught.value)
    assert f"reward.{key}: no row of the data has data_source 'math/typo'" in message
    assert "sources: ['openai/gsm8k'] (data.train_files, data.val_files)" in message
    check_rewards({key: {"openai/gsm8k": value["math/typo"]}}, data)  # a source the data has: fine
