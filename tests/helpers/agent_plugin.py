"""Test pieces for the agent loop: a scripted tool-using policy, misbehaving tools, probes.

Loaded in Ray workers as a plug-in (``VERITY_PLUGINS=helpers.agent_plugin:register`` with
``tests/`` on ``PYTHONPATH``); unit tests import the pieces directly.

The scripted policy answers prompts of the form ``task:<what>:<argument>|`` (rendered
with :data:`TOOL_TEMPLATE`: messages verbatim after ``<bos>``, tool answers in brackets).
Its first turn calls the tool ``<what>`` names; every later turn reads the tool's answer
and answers ``=<that answer>``. Its tokens are teacher-forced through the real model,
whose log-prob of each one is reported exactly as a sampler reports its samples' log-probs.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import torch
from verity.batch import Batch
from verity.engines.fsdp2 import FSDP2Engine
from verity.engines.logprobs import response_logprobs
from verity.rollout.batch_io import (
    build_rollout_output,
    read_prompt_rows,
    resolve_sampling,
    responses_from_token_lists,
)
from verity.rollout.hf_rollout import HFRollout
from verity.rollout.prompts import position_ids_from_mask
from verity.rollout.sampling import SamplingParams

# ---------------------------------------------------------------- tools


def echo_tool(arguments: dict[str, Any], **row_kwargs: Any) -> str:
    """Answers with its arguments and the row's tool kwargs (JSON)."""
    return json.dumps({"text": arguments.get("text"), "kwargs": row_kwargs}, sort_keys=True)


def hang_tool(arguments: dict[str, Any], **row_kwargs: Any) -> str:
    """Never answers."""
    time.sleep(3600)
    return "late"


def crash_tool(arguments: dict[str, Any], **row_kwargs: Any) -> str:
    """Kills its own process."""
    os._exit(3)


def garbage_tool(arguments: dict[str, Any], **row_kwargs: Any) -> Any:
    """Returns bytes, not text."""
    return b"\xff\xfe garbage"


def raise_tool(arguments: dict[str, Any], **row_kwargs: Any) -> str:
    """Raises an ordinary exception."""
    raise RuntimeError("the index is offline")


def _schema(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    }


def scripted_tools(hang_timeout_s: float = 2.0) -> list[dict[str, Any]]:
    """``rollout.agent.tools`` entries: calculator, echo, and the misbehaving ones."""
    return [
        {"class_name": "calculator", "timeout_s": 120.0},
        {"class_name": "helpers.agent_plugin:echo_tool", "tool_schema": _schema("echo"), "timeout_s": 120.0},
        {
            "class_name": "helpers.agent_plugin:hang_tool",
            "tool_schema": _schema("hang"),
            "timeout_s": hang_timeout_s,
        },
        {
            "class_name": "helpers.agent_plugin:crash_tool",
            "tool_schema": _schema("crash"),
            "timeout_s": 120.0,
        },
        {
            "class_name": "helpers.agent_plugin:garbage_tool",
            "tool_schema": _schema("garbage"),
            "timeout_s": 120.0,
        },
        {"class_name": "helpers.agent_plugin:raise_tool", "tool_schema": _schema("fail"), "timeout_s": 120.0},
    ]


# ---------------------------------------------------------------- the scripted policy


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A hermes tool call."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


TOOL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}[{{ message['content'] }}]{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
)
"""The character model's template with tool answers in brackets, so a reader can tell where they end."""

_ANSWERS = re.compile(r"^((?:\[[^\]]*\])*)(.*)$", re.DOTALL)


def intended_turn(what: str, argument: str, turn: int, answer: str | None) -> str:
    """The whole text of the scripted policy's ``turn``-th turn (0-based), given the last tool answer.

    ``what`` = ``<tool>*<n>``: ``n`` turns each calling ``<tool>`` with the argument, then the answer.
    """
    if "*" in what:
        tool, _, times = what.partition("*")
        return call_text(tool, {"text": argument}) if turn < int(times) else "=" + (answer or "")[:24]
    if what == "plain":
        return "=" + argument
    if turn > 0 and what != "loop":
        return "=" + (answer or "")[:24]
    if what in ("calculator", "loop"):
        return call_text("calculator", {"expression": argument})
    if what == "badjson":
        return "<tool_call>{oops}</tool_call>"
    if what == "unknown":
        return call_text("nosuch", {})
    if what == "two":
        return call_text("calculator", {"expression": argument}) + call_text(
            "calculator", {"expression": "1+1"}
        )
    if what == "badargs":
        return call_text("calculator", {"expression": 12})
    return call_text(what, {"text": argument})


def script(context: str) -> str:
    """The rest of the scripted policy's current turn for ``context`` (prompt + response so far).

    The prompt is ``task:<what>:<argument>|``; each finished turn ends with ``<eos>`` and is
    followed by its tool answers in brackets (:data:`TOOL_TEMPLATE`); a turn cut short
    (the engine's length cap) is continued where it stopped.
    """
    body = context.removeprefix("<bos>")
    prompt, _, response = body.partition("|")
    _, what, argument = (prompt.split(":", 2) + ["", ""])[:3]
    turn = response.count("<eos>")
    tail = response.rsplit("<eos>", 1)[-1]
    answers, partial = _ANSWERS.match(tail).groups() if turn else ("", tail)
    first = answers[1:].split("]", 1)[0] if answers else None
    full = intended_turn(what, argument, turn, first)
    if not full.startswith(partial):
        raise AssertionError(f"the context {context!r} does not continue the scripted turn {full!r}")
    return full[len(partial) :]


def answers_of_turn(trajectory: dict, turn: int) -> list[dict]:
    """The tool messages that follow the ``turn``-th assistant message of a trajectory."""
    seen, out = -1, []
    for message in trajectory["messages"]:
        if message["role"] == "assistant":
            seen += 1
        elif seen == turn:
            out.append(message)
    return out


def expected_response(tokenizer: Any, prompt_text: str, trajectory: dict) -> tuple[list[int], list[int]]:
    """The tokens and model mask the script implies for a row, given the tool answers it recorded.

    Built independently of the loop: each turn is the script's text + EOS (mask 1), followed
    by that turn's answers as :data:`TOOL_TEMPLATE` renders them (mask 0).
    """
    eos = tokenizer.eos_token_id
    tokens: list[int] = []
    mask: list[int] = []
    context = prompt_text
    for turn in range(trajectory["num_turns"]):
        text = script(context)
        model_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        tokens += model_ids
        mask += [1] * len(model_ids)
        context += text + "<eos>"
        answers = "".join(f"[{m['content']}]" for m in answers_of_turn(trajectory, turn))
        tool_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
        tokens += tool_ids
        mask += [0] * len(tool_ids)
        context += answers
    return tokens, mask


class ScriptedRollout(HFRollout):
    """An HF rollout whose tokens come from :func:`script`, with the model's log-prob of each one."""

    name = "scripted"

    def __init__(self, model: Any, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(model, tokenizer, **kwargs)
        self.tokenizer = tokenizer

    def request_scheduler(self, params: SamplingParams) -> Any:
        """One scripted ``generate`` call per step (HFRollout's own scheduler would decode the model)."""
        from verity.rollout.requests import BatchedCallScheduler

        return BatchedCallScheduler(self, params, self.pad_token_id)

    @property
    def serving_attention(self) -> str | None:
        """The model's own attention: this engine's ``generate`` scores its script outside HFRollout's decode."""
        return self.model.config._attn_implementation

    def generate(self, batch: Batch | Mapping[str, Any], params: SamplingParams | None = None) -> Batch:
        params = resolve_sampling(batch, self.sampling, params)
        rows = read_prompt_rows(batch, params.n)
        prompt_ids, prompt_mask = rows.prompt_ids.cpu(), rows.prompt_mask.cpu()
        texts = [
            self.tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=False)
            for ids, m in zip(prompt_ids, prompt_mask, strict=True)
        ]
        eos = self.eos_token_ids[0]
        tokens = [
            (self.tokenizer(script(t), add_special_tokens=False)["input_ids"] + [eos])[
                : params.max_new_tokens
            ]
            for t in texts
        ]
        responses, response_mask, _ = responses_from_token_lists(
            tokens, [[0.0] * len(t) for t in tokens], params.max_new_tokens, self.pad_token_id
        )
        attention = torch.cat([prompt_mask.long(), response_mask], dim=1)
        inputs = {
            "input_ids": torch.cat([prompt_ids, responses], dim=1).to(self.device),
            "attention_mask": attention.to(self.device),
            "position_ids": position_ids_from_mask(attention).to(self.device),
            "responses": responses.to(self.device),
        }
        temperature = 1.0 if params.greedy else params.temperature
        with torch.no_grad():
            logprobs, _ = response_logprobs(
                self.model, inputs, temperature=temperature, compute_entropy=False
            )
        return build_rollout_output(rows, responses, response_mask, logprobs.cpu().float() * response_mask)


# ---------------------------------------------------------------- probes for the 2-worker run


class GradProbeFSDP2(FSDP2Engine):
    """FSDP2 that records the loss gradient reaching each response position's log-prob and entropy.

    After each optimizer step its metrics hold ``probe/tool_grad_max`` (the largest
    |d loss / d logprob| or |d loss / d entropy| at tool-answer positions, over all ranks and
    micro-batches), ``probe/model_grad_max`` (the same at model positions) and
    ``probe/tool_positions`` (how many tool positions the step saw).
    """

    name = "fsdp2_grad_probe"

    def forward_backward(
        self, batch: Any, loss_fn: Any, micro_batch_size: int, temperature: float = 1.0, **kwargs: Any
    ):
        seen = {"tool": 0.0, "model": 0.0, "positions": 0.0}

        def probed(micro: Any, logprobs: torch.Tensor, entropy: Any, agg: Any):
            width = logprobs.shape[1]
            tool = (micro["attention_mask"][:, -width:] > 0) & (micro["response_mask"] == 0)
            model = micro["response_mask"] > 0
            seen["positions"] += float(tool.sum())

            def hook(grad: torch.Tensor) -> None:
                if bool(tool.any()):
                    seen["tool"] = max(seen["tool"], float(grad[tool].abs().max()))
                if bool(model.any()):
                    seen["model"] = max(seen["model"], float(grad[model].abs().max()))

            for tensor in (logprobs, entropy):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(hook)
            return loss_fn(micro, logprobs, entropy, agg)

        out = super().forward_backward(batch, probed, micro_batch_size, temperature, **kwargs)
        tool, model, positions = self._all_reduce([seen["tool"], seen["model"], seen["positions"]], op="max")
        out.update(
            {"probe/tool_grad_max": tool, "probe/model_grad_max": model, "probe/tool_positions": positions}
        )
        return out


def _build_probe(ctx: Any) -> Any:
    return GradProbeFSDP2(ctx.load_model(), ctx.optim, total_steps=ctx.total_steps, device=ctx.device)


def _build_scripted(ctx: Any) -> Any:
    return ScriptedRollout(ctx.load_policy().to(ctx.device).eval(), ctx.tokenizer, seed=ctx.seed)


PROBE_DIR = "VERITY_AGENT_PROBE_DIR"


def dump_batch(ctx: Any, batch: Batch) -> Batch:
    """Stage ``agent_probe``: save the step's rows (masks, log-probs, trajectories) for the test to read.

    Reading a key the workers kept (the prompt side) fetches it here, through the driver.
    """
    keys = ["prompts", "responses", "response_mask", "attention_mask", "rollout_logprobs", "old_logprobs"]
    keys += ["num_turns", "tool_calls", "tool_errors"]
    view = batch.select(*(k for k in keys if k in batch))
    data = {k: view[k].clone() for k in keys if k in view}
    data["trajectory"] = list(batch["trajectory"])
    torch.save(data, os.path.join(os.environ[PROBE_DIR], f"step_{ctx.step}.pt"))
    return batch


def _plan_probe(cfg: Any, plan: Any) -> None:
    from verity.trainer.stages import Stage

    if os.environ.get(PROBE_DIR) and cfg.rollout.agent.enabled:
        plan.insert_after("old_log_prob", Stage("agent_probe", dump_batch))


_registered = False


def register() -> None:
    """Register the scripted rollout, the gradient-probe engine and the dump stage (once per process)."""
    global _registered
    if _registered:
        return
    from verity.engines.registry import register_training_engine
    from verity.rollout.registry import register_rollout_engine
    from verity.trainer.stage_plan import register_stage_planner

    register_rollout_engine("scripted", _build_scripted)
    register_training_engine("fsdp2_grad_probe", _build_probe)
    register_stage_planner("agent_probe", _plan_probe)
    _registered = True
