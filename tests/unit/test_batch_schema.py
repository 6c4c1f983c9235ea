"""The declared batch schema: shapes by symbol, dtype kinds, unknown keys, registration."""

from __future__ import annotations

import pytest
import torch
from verity.batch import Batch, BatchSchemaError, declared_keys, describe, get_key, register_key, validate

B, P, R = 4, 5, 7


def rollout_batch() -> Batch:
    """A batch after generation: prompts [B,P], responses [B,R], full sequence [B,P+R]."""
    long = torch.long
    return Batch.from_dict(
        {
            "prompts": torch.zeros(B, P, dtype=long),
            "responses": torch.zeros(B, R, dtype=long),
            "input_ids": torch.zeros(B, P + R, dtype=long),
            "attention_mask": torch.ones(B, P + R, dtype=long),
            "position_ids": torch.zeros(B, P + R, dtype=long),
            "response_mask": torch.ones(B, R),
            "old_logprobs": torch.zeros(B, R),
            "scores": torch.zeros(B),
            "group": torch.arange(B),
        },
        {"data_source": ["t"] * B, "ground_truth": ["1"] * B},
    )


def test_valid_batch_returns_dimension_values():
    assert validate(rollout_batch()) == {"B": B, "P": P, "R": R}


def test_every_contract_key_is_declared():
    names = set(declared_keys())
    for key in [
        "prompts", "input_ids", "attention_mask", "position_ids", "responses", "response_mask",
        "rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "entropy", "token_rewards",
        "scores", "advantages", "returns", "group", "data_source", "ground_truth", "extra_info", "prompt_text",
    ]:  # fmt: skip
        assert key in names, key
    assert get_key("advantages").dims == ("B", "R")
    assert get_key("input_ids").dims == ("B", "P+R")
    assert get_key("ground_truth").dtype == "object"
    assert "| `responses` | `[B, R]` | int |" in describe()


def test_mismatched_response_length_names_key_and_shapes():
    b = rollout_batch()
    b["advantages"] = torch.zeros(B, R - 1)
    with pytest.raises(BatchSchemaError) as err:
        validate(b)
    message = str(err.value)
    assert "'advantages'" in message
    assert "[B, R] = [4, 7]" in message and "R=7 from 'responses'" in message
    assert "got [4, 6]" in message


def test_full_sequence_must_be_prompt_plus_response():
    b = rollout_batch()
    b["input_ids"] = torch.zeros(B, P + R + 1, dtype=torch.long)
    with pytest.raises(
        BatchSchemaError, match=r"'input_ids': expected shape \[B, P\+R\] = \[4, 12\].*got \[4, 13\]"
    ):
        validate(b)


def test_prompt_length_is_inferred_from_full_sequence():
    b = rollout_batch().select("input_ids", "responses")
    assert validate(b) == {"B": B, "R": R, "P": P}
    b["prompts"] = torch.zeros(B, P + 1, dtype=torch.long)
    # prompts is declared before input_ids, so it fixes P and input_ids is reported
    with pytest.raises(
        BatchSchemaError, match=r"'input_ids': expected shape \[B, P\+R\] = \[4, 13\].*P=6 from 'prompts'"
    ):
        validate(b)


def test_sequence_keys_agree_before_generation():
    b = Batch.from_dict(
        {"input_ids": torch.zeros(3, 9, dtype=torch.long), "attention_mask": torch.ones(3, 9)}
    )
    assert validate(b) == {"B": 3, "P+R": 9}
    b["position_ids"] = torch.zeros(3, 8, dtype=torch.long)
    with pytest.raises(
        BatchSchemaError, match="'position_ids'.*P\\+R=9 \\(from 'input_ids'\\), got \\[3, 8\\]"
    ):
        validate(b)


def test_wrong_rank_and_dtype_are_errors():
    b = rollout_batch()
    b["scores"] = torch.zeros(B, 1)
    with pytest.raises(BatchSchemaError, match="'scores'.*got \\[4, 1\\] \\(2 dims instead of 1\\)"):
        validate(b)
    b = rollout_batch()
    b["responses"] = torch.zeros(B, R)
    with pytest.raises(BatchSchemaError, match="'responses': expected dtype kind int, got torch.float32"):
        validate(b)
    b = rollout_batch()
    b["group"] = torch.zeros(B, dtype=torch.bool)
    with pytest.raises(BatchSchemaError, match="'group': expected dtype kind int, got torch.bool"):
        validate(b)


def test_tensor_versus_list_placement():
    b = rollout_batch()
    b["ground_truth"] = torch.zeros(B)
    with pytest.raises(BatchSchemaError, match="'ground_truth': expected a per-sample list"):
        validate(b)
    b = rollout_batch()
    b["scores"] = [0.0] * B
    with pytest.raises(BatchSchemaError, match="'scores': expected a tensor \\[B\\] of float"):
        validate(b)


def test_unknown_key_is_an_error_unless_allowed():
    b = rollout_batch()
    b["old_log_probs"] = torch.zeros(B, R)
    with pytest.raises(BatchSchemaError, match=r"\['old_log_probs'\] are not declared"):
        validate(b)
    assert validate(b, allow_unknown=True)["R"] == R


def test_required_keys():
    b = rollout_batch()
    assert validate(b, keys=["responses", "response_mask"]) == {"B": B, "R": R}
    with pytest.raises(BatchSchemaError, match=r"missing required key\(s\) \['advantages'\]"):
        validate(b, keys=["responses", "advantages"])


def test_register_key_for_recipes():
    register_key("test_pixel_values", ("B", 3, "H", "W"), "float", "image pixels (test key)")
    register_key("test_pixel_values", ("B", 3, "H", "W"), "float", "image pixels (test key)")  # idempotent
    register_key("test_image_mask", ("B", "H", "W"), "mask", "image mask (test key)")
    register_key("test_features", ("B", "..."), "number", "any trailing shape (test key)")
    b = Batch.from_dict(
        {
            "test_pixel_values": torch.zeros(2, 3, 8, 6),
            "test_image_mask": torch.ones(2, 8, 6, dtype=torch.bool),
            "test_features": torch.zeros(2, 4, 4, 4),
        }
    )
    assert validate(b) == {"B": 2, "H": 8, "W": 6}
    b["test_image_mask"] = torch.ones(2, 8, 5, dtype=torch.bool)
    with pytest.raises(
        BatchSchemaError, match="'test_image_mask'.*W=6 from 'test_pixel_values'.*got \\[2, 8, 5\\]"
    ):
        validate(b)
    b = Batch.from_dict({"test_pixel_values": torch.zeros(2, 4, 8, 6)})
    with pytest.raises(BatchSchemaError, match=r"'test_pixel_values'.*\[B, 3, H, W\].*got \[2, 4, 8, 6\]"):
        validate(b)


def test_register_key_rejects_bad_declarations():
    with pytest.raises(ValueError, match="already declared"):
        register_key("responses", ("B", "T"), "int", "clash")
    with pytest.raises(ValueError, match="must start with 'B'"):
        register_key("test_bad", ("R",), "float", "x")
    with pytest.raises(ValueError, match="dtype must be one of"):
        register_key("test_bad", ("B",), "double", "x")
    with pytest.raises(ValueError, match="'...' is allowed only as the last"):
        register_key("test_bad", ("B", "...", "R"), "float", "x")
    with pytest.raises(ValueError, match="must be a symbol like 'R'"):
        register_key("test_bad", ("B", "R-1"), "float", "x")
    assert "test_bad" not in declared_keys()
    with pytest.raises(KeyError, match="'test_bad' is not declared"):
        get_key("test_bad")
