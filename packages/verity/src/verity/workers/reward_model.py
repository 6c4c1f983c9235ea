r"""The reward-model role: a sequence-classification head on a causal-LM backbone scores responses.

**Model.** A local HF checkpoint loaded with ``AutoModelForSequenceClassification``
(``num_labels=1``), e.g. ``Qwen2ForSequenceClassification``: the decoder backbone
plus a linear ``score`` head ``hidden -> 1``. A trained reward model checkpoint
carries its head; a plain causal-LM checkpoint gets a freshly initialised head
(useful only for tests and plumbing).

**Input.** The reward model may use a different tokenizer and chat template than the
policy, so it does not reuse the policy's token ids: each sample is re-rendered from
its chat messages (``raw_prompt``) plus ``{"role": "assistant", "content":
response_text}`` with the reward model's tokenizer (its chat template, or the
contents joined by newlines without one), truncated on the left to ``max_length``
tokens, and right-padded.

**Score.** The head's output at the last real token of each sequence:

.. math::
    r(x, y) = w^\top h_{T-1}(x \oplus y) + b

(taken from the backbone's hidden states at the last position the attention mask
keeps, so it does not depend on how the checkpoint marks padding). Scores come back
as ``rm_scores`` ``[B]`` float32 and can be used alone or mixed with rule rewards
(:func:`mix_scores`).

**Placement.** ``compute_rm_score`` is ``DP_SPLIT``: the driver's batch is spread over
the group's ranks. One rank, or a folder without safetensors weights: the whole model in
the rank (``from_pretrained``). Several ranks and a safetensors folder: the model is
sharded like the other roles, so no rank ever holds it whole (:func:`build_sharded_reward_model`):
built with its parameters on the ``meta`` device, each decoder layer and then the
backbone wrapped by FSDP2's ``fully_shard`` (parameters split on dim 0 over the ranks),
and rank 0 reads the checkpoint tensor by tensor and scatters each rank its shard
(:mod:`verity.engines.streamed_loading`). The ``score`` head (``hidden`` weights) stays
whole in every rank. Each layer's weights are gathered for its forward and freed after
it, so every rank must run the same number of forwards: ranks given fewer rows (or none)
run one-token filler forwards until all have run the largest rank's count
(:func:`score_texts` with ``sharded=True``). The scores equal the whole model's up to
float rounding; the run records ``reward_model_weights_loaded: streamed``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verity.batch import Batch, declared_keys, register_key
from verity.controller import Dispatch, Worker, register
from verity.workers.report import WorkerReport

if "rm_scores" not in declared_keys():
    register_key("rm_scores", ("B",), "float", "reward-model score of each sample (sequence level)")


def load_reward_model(model_path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The checkpoint at ``model_path`` as a one-label sequence classifier, in eval mode."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from verity.engines.hf_loading import quiet_loading

    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"reward model path {model_path!r}: expected a folder with an HF checkpoint")
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    config.num_labels = 1
    with quiet_loading():  # errors only: a causal-LM checkpoint has no head yet, as expected
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, config=config, dtype=dtype, local_files_only=True
        )
    model.eval()
    return model


def render_conversations(
    raw_prompts: list[list[dict[str, Any]]], responses: list[str], tokenizer: Any
) -> list[str]:
    """Prompt messages plus the response as an assistant turn, rendered with ``tokenizer``."""
    texts = []
    for messages, response in zip(raw_prompts, responses, strict=True):
        chat = [dict(m) for m in messages] + [{"role": "assistant", "content": response}]
        if getattr(tokenizer, "chat_template", None):
            texts.append(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False))
        else:
            texts.append("\n".join(str(m["content"]) for m in chat))
    return texts


def _collective_device(device: torch.device) -> torch.device:
    """Where this rank's tensors for a collective of the default group live: NCCL needs them on the device."""
    return device if "nccl" in str(dist.get_backend()) else torch.device("cpu")


def build_sharded_reward_model(
    model_path: str, dtype: torch.dtype, device: torch.device | str
) -> torch.nn.Module:
    """The reward model at ``model_path`` sharded over the default process group, in eval mode.

    A collective: every rank of the (initialised) group calls it. The one-label sequence
    classifier is built empty, each decoder layer and then the backbone are wrapped by
    ``fully_shard`` (each parameter a ``DTensor`` holding this rank's dim-0 chunk, about
    ``1 / world`` of the backbone), the ``score`` head stays a whole ``[1, hidden]``
    parameter in every rank, and :func:`~verity.engines.streamed_loading.fill_from_checkpoint`
    gives each rank its shard (rank 0 reads the safetensors files). A folder whose files
    hold no ``score`` head gets a fresh one, drawn on rank 0 as ``from_pretrained`` would
    (normal, std ``initializer_range``) and broadcast, so every rank scores alike.
    Call the backbone (``getattr(model, model.base_model_prefix)``) and the head
    separately, as :func:`score_texts` does; every rank must run the same number of forwards.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from verity.engines.fsdp2_sharding import shard_layers_and_root
    from verity.engines.model_source import ModelSource
    from verity.engines.streamed_loading import fill_from_checkpoint, materialize

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_sharded_reward_model: needs an initialised torch.distributed process group")
    device = torch.device(device)
    source = ModelSource(model_path, "reward_model", dtype)
    module = source.build_empty()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # the backbone is the root: its forward gathers the embedding and final norm, and frees them after
    shard_layers_and_root(module, getattr(module, module.base_model_prefix), mesh)
    materialize(module, device)
    fill_from_checkpoint(module, source, device)
    if source.fresh_parameters:  # a causal-LM folder: one fresh head for every rank
        head = module.score.weight
        with torch.no_grad():
            if dist.get_rank() == 0:
                head.normal_(mean=0.0, std=float(getattr(module.config, "initializer_range", 0.02)))
            comm = _collective_device(device)
            buffer = head.detach().to(comm)
            dist.broadcast(buffer, src=0)
            head.copy_(buffer)
    module.eval()
    module.requires_grad_(False)
    return module


@torch.no_grad()
def score_texts(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: list[str],
    max_length: int = 1024,
    micro_batch_size: int = 16,
    device: torch.device | str = "cpu",
    *,
    sharded: bool = False,
) -> torch.Tensor:
    """Reward-model scores ``[len(texts)]`` float32 of full conversations (see the module docstring).

    ``sharded``: ``model`` is FSDP2-sharded over the default process group
    (:func:`build_sharded_reward_model`); a collective then, every rank calling it with its
    own ``texts`` (any number, 0 included): the micro-batch counts are all-reduced (max)
    and a rank with fewer runs one-token forwards of the backbone, discarded, so every
    rank takes part in each layer's gather.
    """
    add_special = not getattr(tokenizer, "chat_template", None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("reward model tokenizer: needs a pad_token_id or eos_token_id")
    backbone = getattr(model, model.base_model_prefix)
    head = model.score
    extra = 0  # filler passes after this rank's own: agreed on before any pass, each a collective
    if sharded and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        mine = math.ceil(len(texts) / micro_batch_size)
        count = torch.tensor([mine], dtype=torch.long, device=_collective_device(torch.device(device)))
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        extra = int(count.item()) - mine
    out = []
    for start in range(0, len(texts), micro_batch_size):
        encoded = tokenizer(texts[start : start + micro_batch_size], add_special_tokens=add_special)[
            "input_ids"
        ]
        rows = [list(ids)[-max_length:] for ids in encoded]
        width = max(1, max(len(r) for r in rows))
        input_ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [b, T, H]
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0)  # [b]
        pooled = hidden[torch.arange(len(rows), device=hidden.device), last]  # [b, H]
        out.append(head(pooled).squeeze(-1).float().cpu())
    if extra:  # the other ranks' remaining passes gather each layer: take part, discard the output
        filler = torch.full((1, 1), int(pad_id), dtype=torch.long, device=device)
        for _ in range(extra):
            backbone(input_ids=filler, attention_mask=torch.ones_like(filler))
    return torch.cat(out) if out else torch.zeros(0)


def mix_scores(rule_scores: torch.Tensor, rm_scores: torch.Tensor, rm_weight: float = 1.0) -> torch.Tensor:
    """``rule_scores + rm_weight * rm_scores`` (both ``[B]``); ``rm_weight=0`` keeps the rule rewards only."""
    if rule_scores.shape != rm_scores.shape:
        raise ValueError(
            f"rule_scores {tuple(rule_scores.shape)} and rm_scores {tuple(rm_scores.shape)} differ"
        )
    return rule_scores.float() + float(rm_weight) * rm_scores.float()


class RewardModelWorker(Worker):
    """One rank of the reward model: the whole model, or its shard when the group has several ranks.

    ``init_model`` (broadcast) loads the checkpoint (see the module docstring's **Placement**);
    ``compute_rm_score`` (data-parallel) reads ``raw_prompt`` and ``response_text`` and
    returns a batch with ``rm_scores`` ``[b]``.
    """

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        max_length: int = 1024,
        micro_batch_size: int = 16,
        device: str = "cpu",
        dtype: str = "float32",
        backend: str = "auto",
    ) -> None:
        """``device``: a torch device string, or ``auto``: this rank's device on ``backend``
        (``auto`` | ``cpu`` | ``cuda`` | ``rocm`` | ``npu``), chosen as the actor chooses its own."""
        if max_length < 1 or micro_batch_size < 1:
            raise ValueError(
                f"max_length/micro_batch_size: expected >= 1, got {max_length}/{micro_batch_size}"
            )
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype!r}")
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.max_length = max_length
        self.micro_batch_size = micro_batch_size
        self.device = device
        self.backend = backend
        self.dtype = getattr(torch, dtype)
        self.model: torch.nn.Module | None = None
        self.tokenizer: Any = None
        self.sharded = False  # FSDP2-sharded over the group (several ranks, a safetensors folder)

    @classmethod
    def args_from_config(cls, cfg: Any) -> tuple:
        """Constructor arguments from the run config's ``reward_model`` section (device chosen per rank)."""
        rm = cfg.reward_model
        return (
            rm.model_path,
            rm.tokenizer_path,
            rm.max_length,
            rm.micro_batch_size,
            "auto",
            cfg.model.dtype,
            cfg.trainer.device,
        )

    @register(Dispatch.BROADCAST)
    def init_model(self) -> WorkerReport:
        """Load the tokenizer and the model (whole, or this rank's shard); returns this rank's report.

        With several ranks and a safetensors folder, joins the group's process group first
        (nothing to do when colocated roles already joined one).
        """
        from transformers import AutoTokenizer

        from verity.engines.model_source import ModelSource
        from verity.hardware import get_backend

        backend = get_backend(None if self.backend == "auto" else self.backend)
        if self.device == "auto":
            from verity.workers.role_training import role_device

            self.device = str(role_device(backend, self.local_rank))
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
        source = ModelSource(self.model_path, "reward_model", self.dtype)
        self.sharded = self.world_size > 1 and source.streams
        if self.sharded:
            if torch.device(self.device).type == "cuda":
                torch.cuda.set_device(torch.device(self.device))
            self.init_process_group(backend=backend.dist_backend)
            self.model = build_sharded_reward_model(self.model_path, self.dtype, self.device)
            n_params = source.parameter_count()
        else:
            self.model = load_reward_model(self.model_path, self.dtype).to(self.device)
            n_params = sum(p.numel() for p in self.model.parameters())
        return WorkerReport(
            rank=self.rank,
            device=self.device,
            n_params=n_params,
            weights_loaded="streamed" if self.sharded else "whole",
        )

    @register(Dispatch.DP_SPLIT)
    def compute_rm_score(self, batch: Batch) -> Batch:
        """``rm_scores`` ``[b]`` float32 for this rank's rows (needs ``raw_prompt`` and ``response_text``)."""
        if self.model is None:
            raise RuntimeError("RewardModelWorker: call init_model() before compute_rm_score()")
        for key in ("raw_prompt", "response_text"):
            if key not in batch:
                raise ValueError(f"compute_rm_score: batch needs {key!r}; it has {batch.keys()}")
        texts = render_conversations(list(batch["raw_prompt"]), list(batch["response_text"]), self.tokenizer)
        scores = score_texts(
            self.model,
            self.tokenizer,
            texts,
            self.max_length,
            self.micro_batch_size,
            self.device,
            sharded=self.sharded,
        )
        return Batch.from_dict({"rm_scores": scores})
