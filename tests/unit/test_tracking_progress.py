"""Console progress and the metric-name registry."""

from __future__ import annotations

import io

import pytest
from verity.tracking import ProgressLine, format_metrics, format_value, names


def test_plain_lines_every_k_steps_when_not_a_tty():
    stream = io.StringIO()
    with ProgressLine(25, stream=stream, every=10) as progress:
        for step in range(1, 26):
            progress.update(step, {names.REWARD_MEAN: step / 25, names.PERF_TOKENS_PER_S: 15234.0})
    lines = stream.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert lines[-1].startswith("train step 25/25 [")
    assert lines[-1].endswith("reward 1 tok/s 15.2k")
    assert "reward 0.4 " in lines[1]


def test_live_bar_shows_metrics_in_its_postfix():
    stream = io.StringIO()
    progress = ProgressLine(3, stream=stream, live=True, keys=(names.ACC_MEAN, names.ACTOR_KL))
    for step in (1, 2, 3):
        progress.update(step, {names.ACC_MEAN: 0.5, names.ACTOR_KL: 0.00123})
    progress.close()
    out = stream.getvalue()
    assert "3/3" in out
    assert "acc 0.5 kl 1.2e-03" in out


def test_progress_rejects_bad_steps():
    progress = ProgressLine(5, stream=io.StringIO())
    with pytest.raises(ValueError, match=r"1\.\.5"):
        progress.update(6, {})
    with pytest.raises(ValueError, match="total_steps"):
        ProgressLine(0)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (15234.0, "15.2k"),
        (2_500_000.0, "2.5M"),
        (123.4, "123"),
        (0.51234, "0.512"),
        (0.00123, "1.2e-03"),
        (0.0, "0"),
        (-3.0, "-3"),
        (float("nan"), "nan"),
    ],
)
def test_format_value(value, text):
    assert format_value(value) == text


def test_format_metrics_uses_short_labels_and_skips_missing():
    assert (
        format_metrics(
            {names.RESPONSE_LENGTH_MEAN: 23.4, "x/y": 1.0},
            (names.ACC_MEAN, names.RESPONSE_LENGTH_MEAN, "x/y"),
        )
        == "len 23.4 x/y 1"
    )


def test_metric_names_are_valid_and_distinct():
    constants = [value for key, value in vars(names).items() if key.isupper() and isinstance(value, str)]
    assert len(constants) == len(set(constants)) >= 20
    for name in constants:
        names.check_name(name)
    assert names.REWARD_MEAN == "reward/mean"
    assert names.RESPONSE_LENGTH_CLIP_RATIO == "response_length/clip_ratio"
    assert names.timing("generate") == "timing/generate_s"
    assert [names.timing(stage) for stage in names.STAGES][-1] == "timing/step_s"
    assert names.metric("critic", "value_loss") == names.CRITIC_VALUE_LOSS
    with pytest.raises(ValueError, match="stage"):
        names.timing("Gen erate")
    with pytest.raises(ValueError, match="invalid"):
        names.metric("acc", "mean%")
