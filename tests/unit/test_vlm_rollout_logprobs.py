"""The HF rollout generates with images; the trainer's log-probs on the same inputs equal the rollout's."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from verity.data.prompt_loader import collate_prompts
from verity.data.verl_dataset import PromptDataset
from verity.data.vision_inputs import vision_forward_inputs
from verity.engines.logprobs import response_logprobs
from verity.engines.micro_batches import model_inputs
from verity.rollout.hf_rollout import HFRollout
from verity.rollout.sampling import SamplingParams
from verity_toyworld.tiny_vlm import build_tiny_qwen2_5_vl, build_vlm_image_processor, build_vlm_tokenizer


def png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def setup():
    tokenizer = build_vlm_tokenizer()
    model = build_tiny_qwen2_5_vl(tokenizer, seed=3).eval()
    rows = [
        {"prompt": [{"role": "user", "content": "<image>red?"}], "images": [png((56, 56), (255, 0, 0))]},
        {
            "prompt": [{"role": "user", "content": "a longer question <image> then <image>?"}],
            "images": [png((112, 56), (0, 0, 255)), png((56, 56), (0, 255, 0))],
        },
        {"prompt": [{"role": "user", "content": "text only"}], "images": []},
    ]
    for r in rows:
        r.update(data_source="shapes", reward_model={"ground_truth": "1"})
    dataset = PromptDataset(rows, tokenizer, 64, image_processor=build_vlm_image_processor())
    batch = collate_prompts(dataset.records, dataset.pad_token_id)
    return tokenizer, model, batch


def test_rollout_logprobs_equal_trainer_logprobs(setup) -> None:
    tokenizer, model, batch = setup
    rollout = HFRollout(model, tokenizer, seed=0)
    out = rollout.generate(batch, SamplingParams(max_new_tokens=6, temperature=1.0, n=2, ignore_eos=True))
    assert out["responses"].shape == (6, 6)
    assert len(out["pixel_values"]) == 6  # per-row images follow the repeated rows
    assert out["image_grid_thw"][2].tolist() == [[1, 4, 8], [1, 4, 4]]
    with torch.no_grad():
        trained, entropy = response_logprobs(model, model_inputs(out), compute_entropy=True)
        full, _ = response_logprobs(model, model_inputs(out), compute_entropy=False, trim_padding=False)
    mask = out["response_mask"].bool()
    assert not torch.isin(out["responses"], torch.tensor([260, 261, 262, 263])).any()  # never a vision token
    assert torch.allclose(trained[mask], out["rollout_logprobs"][mask], atol=1e-5)
    assert torch.allclose(full[mask], out["rollout_logprobs"][mask], atol=1e-5)
    assert torch.isfinite(entropy).all() and bool((entropy[mask] > 0).all())  # masked tokens: p*z = 0, not nan


def test_log_probs_use_the_image(setup) -> None:
    tokenizer, model, batch = setup
    out = HFRollout(model, tokenizer, seed=1).generate(batch, SamplingParams(max_new_tokens=4, n=1))
    inputs = model_inputs(out)
    blank = dict(inputs, pixel_values=[torch.zeros_like(p) for p in inputs["pixel_values"]])
    with torch.no_grad():
        real, _ = response_logprobs(model, inputs, compute_entropy=False)
        blanked, _ = response_logprobs(model, blank, compute_entropy=False)
    assert not torch.allclose(real[0], blanked[0])
    assert torch.allclose(real[2], blanked[2])  # the text-only row has no image to change


def test_mrope_positions_follow_the_image_grid(setup) -> None:
    tokenizer, model, batch = setup
    kwargs, deltas = vision_forward_inputs(
        model, batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch["image_grid_thw"]
    )
    positions = kwargs["position_ids"]
    assert positions.shape == (3, 3, batch["input_ids"].shape[1])
    row0 = positions[:, 0][:, batch["attention_mask"][0].bool()]
    image = (batch["input_ids"][0][batch["attention_mask"][0].bool()] == 262).nonzero().flatten()
    # the 2x2 image tokens: same time, heights 0,0,1,1 and widths 0,1,0,1 after the start
    start = int(row0[0, image[0]])
    assert row0[1, image].tolist() == [start, start, start + 1, start + 1]
    assert row0[2, image].tolist() == [start, start + 1, start, start + 1]
    # the text-only row gets plain positions on all three axes
    real = batch["attention_mask"][2].bool()
    assert positions[0, 2][real].tolist() == list(range(int(real.sum())))
    assert int(deltas[2]) == 0 and int(deltas[0]) < 0


def test_weight_sync_covers_the_vision_tower(setup) -> None:
    tokenizer, model, _ = setup
    other = build_tiny_qwen2_5_vl(tokenizer, seed=9)
    rollout = HFRollout(other, tokenizer)
    names = [n for n, _ in model.state_dict().items()]
    assert any(n.startswith("model.visual.blocks.") for n in names)
    rollout.load_weights(model.state_dict().items())
    for name, tensor in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], tensor), name


def test_engines_that_cannot_take_images_refuse_them(setup) -> None:
    from verity.engines.values import response_values
    from verity.rollout.batch_io import read_prompt_rows

    tokenizer, model, batch = setup
    with pytest.raises(ValueError, match="does not feed images"):
        read_prompt_rows(batch, 1)  # what vLLM, SGLang and the agent loop call
    out = HFRollout(model, tokenizer).generate(batch, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="value model does not take them"):
        response_values(model, model_inputs(out))
