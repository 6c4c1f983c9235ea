"""How the agent loop plugs into the run: config, the rollout-wrapper seam, rewards, metrics, gradients."""

from __future__ import annotations

import pytest
import torch
from verity.algorithms.aggregation import AggregationContext
from verity.algorithms.configs import KLConfig, PolicyLossConfig
from verity.batch import Batch, validate
from verity.config import ConfigError, load_config
from verity.rewards.manager import RewardManager
from verity.rollout.agent.config import AgentConfig
from verity.rollout.agent.metrics import agent_batch_metrics
from verity.rollout.base import RolloutEngine
from verity.rollout.registry import ROLLOUT_WRAPPERS, RolloutBuildContext
from verity.trainer.stage_plan import build_stage_plan
from verity.workers.actor_rollout import make_actor_loss

TOOLS = "rollout.agent.tools=[{class_name: calculator}]"


def test_the_agent_section_is_validated_before_anything_runs(tmp_path) -> None:
    cfg = load_config(["rollout.agent.enabled=true", TOOLS, "rollout.agent.max_turns=2"])
    assert cfg.rollout.agent.enabled and cfg.rollout.agent.tools[0].class_name == "calculator"
    assert build_stage_plan(cfg).names()[:3] == ["generate", "agent_metrics", "reward"]
    assert "agent_metrics" not in build_stage_plan(load_config([])).names()  # off by default
    with pytest.raises(ConfigError, match="rollout.agent.tools: the agent loop is enabled but no tool"):
        load_config(["rollout.agent.enabled=true"])
    with pytest.raises(ConfigError, match=r"rollout.agent.tools\[0\].class_name 'calculatr'"):
        load_config(["rollout.agent.enabled=true", "rollout.agent.tools=[{class_name: calculatr}]"])
    with pytest.raises(ConfigError, match="rollout.agent.max_turns"):
        load_config(["rollout.agent.max_turns=0"])
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(["rollout.agent.max_turn=2"])
    config_file = tmp_path / "tools.yaml"
    config_file.write_text(
        "defaults: [verity, _self_]\n"
        "rollout:\n  agent:\n    enabled: true\n    tools:\n"
        "      - class_name: python\n        config: {wall_s: 2.0}\n        timeout_s: 4\n"
    )
    cfg = load_config([], config_file=config_file)
    assert cfg.rollout.agent.tools[0].config == {"wall_s": 2.0}


class _Engine(RolloutEngine):
    name = "fake"

    def generate(self, batch, params=None):  # pragma: no cover - not called
        raise NotImplementedError

    def set_seed(self, seed):
        pass

    def load_weights(self, named_tensors):
        return 0


def test_the_agent_wraps_any_engine_through_the_wrapper_seam() -> None:
    from verity_toyworld.char_tokenizer import CharTokenizer

    wrap = ROLLOUT_WRAPPERS.get("agent")
    off = load_config([])
    ctx = RolloutBuildContext(model_path="", tokenizer=CharTokenizer(), device=torch.device("cpu"), cfg=off)
    engine = _Engine()
    assert wrap(engine, ctx) is engine
    on = load_config(["rollout.agent.enabled=true", TOOLS])
    ctx = RolloutBuildContext(model_path="", tokenizer=CharTokenizer(), device=torch.device("cpu"), cfg=on)
    wrapped = wrap(engine, ctx)
    try:
        assert wrapped.engine is engine and wrapped.name == "fake" and wrapped.wrappers == ("agent",)
    finally:
        wrapped.close()


def test_the_chat_template_must_render_tool_messages() -> None:
    from verity.rollout.agent.render import ToolMessageRenderer
    from verity_toyworld.char_tokenizer import CharTokenizer

    tokenizer = CharTokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="drops the content of tool messages"):
        ToolMessageRenderer(tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ raise_exception('no tools') if m['role'] == 'tool' }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="cannot render a tool message"):
        ToolMessageRenderer(tokenizer)


QWEN_LIKE = (  # the tool-message part of Qwen2.5's template, newlines inside expressions as there
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- m['content'] }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_tool_answers_render_as_a_qwen_style_template_puts_them() -> None:
    from verity.rollout.agent.render import ToolMessageRenderer
    from verity_toyworld.char_tokenizer import CharTokenizer

    tokenizer = CharTokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = QWEN_LIKE
    renderer = ToolMessageRenderer(tokenizer)
    messages = [
        {"role": "tool", "name": "a", "content": "408"},
        {"role": "tool", "name": "b", "content": "2"},
    ]
    after_eos = renderer.text(messages, stop_text="<|im_end|>")
    expected = (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n2\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert after_eos == expected
    # a turn cut without its stop token gets the end-of-turn marker from the template (not trained)
    assert renderer.text(messages, stop_text=None) == "<|im_end|>" + expected
    ids = renderer.encode(messages, stop_text="<|im_end|>")
    assert ids[1] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # special tokens stay single tokens


def _rows_with_tools() -> Batch:
    """Two multi-turn rows: prompt 'ab', response 'xy' + tool '12' + 'z' (and a shorter one)."""
    responses = torch.tensor([[20, 21, 30, 31, 22, 0], [20, 30, 22, 0, 0, 0]])
    response_mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    prompts = torch.tensor([[10, 11], [10, 11]])
    mask = torch.cat([torch.ones(2, 2, dtype=torch.long), attention], 1)
    shared_extra = {"index": 7}
    return Batch.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "tool_calls": torch.tensor([1, 2]),
            "tool_errors": torch.tensor([0, 1]),
            "num_turns": torch.tensor([2, 2]),
        },
        non_tensors={
            "data_source": ["t", "t"],
            "ground_truth": ["1", "1"],
            "extra_info": [shared_extra, shared_extra],
            "trajectory": [
                {"messages": [{"role": "assistant", "content": "xy"}], "error_kinds": {}, "stop": "answer"},
                {
                    "messages": [{"role": "tool", "content": "Error"}],
                    "error_kinds": {"timeout": 1},
                    "stop": "budget",
                },
            ],
        },
    )


def test_rewards_read_the_trajectory_and_the_whole_exchange(tmp_path) -> None:
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    trajectory = extra_info['trajectory']\n"
        "    return {'score': float(len(trajectory['messages'])), 'text': solution_str,\n"
        "            'index': extra_info['index']}\n"
    )

    class Chars:  # decodes ids as letters: 10 -> 'a', 20 -> 'k', 30 -> 'u'
        @staticmethod
        def batch_decode(ids, skip_special_tokens=True):
            return ["".join(chr(ord("a") + i - 10) for i in row) for row in ids]

    batch = _rows_with_tools()
    validate(batch)
    manager = RewardManager({"num_workers": 0, "custom_path": str(reward_file)}, tokenizer=Chars())
    scores, extra, _ = manager.score(batch)
    assert scores.tolist() == [1.0, 1.0]
    assert extra["text"] == ["kluvm", "kum"]  # model and tool tokens: the whole exchange
    assert extra["index"] == [7, 7]
    assert "trajectory" not in batch["extra_info"][0]  # the rows' shared dict is not changed


def test_agent_metrics_rates_and_kinds() -> None:
    metrics = agent_batch_metrics(_rows_with_tools())
    assert metrics["agent/tool_call_rate"] == 1.0
    assert metrics["agent/tool_calls_mean"] == 1.5
    assert metrics["agent/tool_error_rate"] == pytest.approx(1 / 3)
    assert metrics["agent/tool_errors/timeout"] == 1.0
    assert metrics["agent/tool_tokens_mean"] == 1.5
    assert metrics["agent/stop/answer"] == 0.5 and metrics["agent/stop/budget"] == 0.5
    assert agent_batch_metrics(Batch.from_dict({"scores": torch.zeros(2)})) == {}


def test_tool_tokens_get_no_gradient_from_the_policy_kl_and_entropy_terms() -> None:
    """d loss / d logprob and d loss / d entropy are exactly 0 at tool positions; scrambling every
    per-token input there leaves the parameters' gradient unchanged; including them changes it."""
    from verity.engines.logprobs import response_logprobs
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    model = build_tiny_qwen2_for(CharTokenizer(), hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    batch = _rows_with_tools()
    tool = (batch["attention_mask"][:, -6:] == 1) & (batch["response_mask"] == 0)
    g = torch.Generator().manual_seed(0)
    inputs = {
        "old_logprobs": -torch.rand(2, 6, generator=g),
        "ref_logprobs": -torch.rand(2, 6, generator=g),
        "advantages": torch.randn(2, 6, generator=g),
    }
    loss_fn = make_actor_loss(
        PolicyLossConfig(), KLConfig(use_kl_loss=True, kl_loss_coef=0.1), entropy_coeff=0.05
    )

    def gradients(per_token: dict, mask: torch.Tensor, hooks: list | None = None) -> list[torch.Tensor]:
        model.zero_grad()
        micro = {**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}}
        logprobs, entropy = response_logprobs(model, micro, temperature=1.0)
        if hooks is not None:
            logprobs.register_hook(lambda grad: hooks.append(("logprobs", grad.clone())))
            entropy.register_hook(lambda grad: hooks.append(("entropy", grad.clone())))
        micro.update(per_token, response_mask=mask)
        loss, _ = loss_fn(micro, logprobs, entropy, AggregationContext.from_mask(mask.float()))
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    seen: list = []
    base = gradients(inputs, batch["response_mask"], seen)
    assert {name for name, _ in seen} == {"logprobs", "entropy"}
    for name, grad in seen:
        assert bool((grad[tool] == 0).all()), name
        assert float(grad[batch["response_mask"].bool()].abs().max()) > 0, name
    scrambled = {k: torch.where(tool, torch.randn(2, 6, generator=g) * 5, v) for k, v in inputs.items()}
    same = gradients(scrambled, batch["response_mask"])
    assert all(torch.equal(a, b) for a, b in zip(base, same, strict=True))
    wrong = gradients(scrambled, batch["attention_mask"][:, -6:])  # tool tokens (wrongly) in the loss
    assert not all(torch.allclose(a, b) for a, b in zip(base, wrong, strict=True))


def test_agent_config_defaults_are_off() -> None:
    assert AgentConfig().enabled is False
    assert load_config([]).rollout.agent.enabled is False
