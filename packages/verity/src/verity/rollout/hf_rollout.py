"""Generation with a Hugging Face causal LM: a hand-written decode loop over a KV cache.

The loop (prefill once, then one token per step)::

    logits_0        = model(prompt, attention_mask, position_ids)[:, -1]      # prefill, fills the cache
    token_t, lp_t   = sample(logits_t)                                        # see rollout.sampling
    logits_{t+1}    = model(token_t, mask + [1], position = last + 1 + t, cache)[:, -1]

A row that has produced EOS is finished: from then on its response is the pad
id, its ``response_mask`` is 0 and its log-prob 0. Finished rows leave the decode
batch (their KV-cache rows, mask and positions with them) once they make up
``COMPACT_FINISHED_FRACTION`` of it, so later steps compute only rows still
generating; until then they ride along and their outputs are ignored. The loop
stops early once every row is finished; responses are always padded to ``max_new_tokens`` so that
batches from different workers concatenate.

Randomness comes only from the engine's own ``torch.Generator`` (seeded at
construction or by :meth:`HFRollout.set_seed`), so the same seed and the same
sequence of calls give the same tokens, whatever the global RNG does.

``n`` samples per prompt: each input row is repeated ``n`` times
consecutively (rows ``i*n .. i*n+n-1`` belong to prompt ``i``); when the input
has no ``group`` key the output gets one (``group[j] = j // n``). A trainer
that repeats the batch itself calls with ``n=1``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verity.batch import Batch
from verity.data.vision_inputs import (
    has_images,
    mask_vision_tokens,
    per_row_images,
    vision_forward_inputs,
    vision_token_ids,
)
from verity.rollout.base import RolloutEngine
from verity.rollout.batch_io import build_rollout_output, read_prompt_rows, resolve_sampling
from verity.rollout.gqa_attention import grouped_attention_name, grouped_sdpa, takes_grouped_sdpa
from verity.rollout.kv_cache import reserved_cache
from verity.rollout.prompts import position_ids_from_mask
from verity.rollout.requests import RequestScheduler
from verity.rollout.sampling import SamplingParams, sample_next_token

# a decode step drops the finished rows from the batch once they are at least this share of it
COMPACT_FINISHED_FRACTION = 0.125


def _resolve_eos_ids(
    eos_token_ids: int | Sequence[int] | None,
    tokenizer: PreTrainedTokenizerBase | None,
    model: PreTrainedModel,
) -> list[int]:
    if eos_token_ids is None and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_token_ids = tokenizer.eos_token_id
    if eos_token_ids is None:
        generation_config = getattr(model, "generation_config", None)
        eos_token_ids = getattr(generation_config, "eos_token_id", None)
    if eos_token_ids is None:
        eos_token_ids = getattr(model.config, "eos_token_id", None)
    if eos_token_ids is None:
        raise ValueError("eos_token_ids: not given and neither the tokenizer nor the model config names one")
    return [int(eos_token_ids)] if isinstance(eos_token_ids, int) else [int(i) for i in eos_token_ids]


def _resolve_pad_id(
    pad_token_id: int | None,
    tokenizer: PreTrainedTokenizerBase | None,
    model: PreTrainedModel,
    eos: list[int],
) -> int:
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = getattr(model.config, "pad_token_id", None)
    return int(eos[0] if pad_token_id is None else pad_token_id)


class HFRollout(RolloutEngine):
    """Batched sampling from a Hugging Face causal LM (see the module docstring).

    ``model``: any ``AutoModelForCausalLM`` model (it stays where it is; inputs
    are moved to its device). ``tokenizer`` supplies the pad and EOS ids unless
    ``pad_token_id`` / ``eos_token_ids`` are given. ``sampling``: the default
    :class:`SamplingParams`. ``seed``: seeds the engine's private generator.
    """

    name = "hf"  # what a run records as the rollout backend

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        pad_token_id: int | None = None,
        eos_token_ids: int | Sequence[int] | None = None,
    ) -> None:
        self.model = model
        self.sampling = sampling or SamplingParams()
        self.eos_token_ids = _resolve_eos_ids(eos_token_ids, tokenizer, model)
        self.pad_token_id = _resolve_pad_id(pad_token_id, tokenizer, model, self.eos_token_ids)
        self._awake_device: torch.device | None = None
        self._released: dict[int, tuple[torch.Size, torch.dtype]] = {}  # id(parameter): its shape, dtype
        self._stale: set[int] = set()  # parameters given storage again, not yet loaded
        self._seed = seed
        self._generator = self._new_generator(seed)

    @property
    def device(self) -> torch.device:
        """The device the model's parameters live on."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's parameters (the dtype it generates in)."""
        return next(self.model.parameters()).dtype

    @property
    def serving_attention(self) -> str | None:
        """The model's attention implementation as it decodes: where :func:`grouped_sdpa` switches
        it (grouped heads on CPU), :func:`grouped_attention_name` of its dtype (``verity_sdpa_gqa``,
        with ``+matmul_decode`` where decode steps take two matmuls), else transformers' name."""
        if takes_grouped_sdpa(self.model):
            return grouped_attention_name(self.dtype)
        return getattr(getattr(self.model, "config", None), "_attn_implementation", None)

    def _new_generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    def set_seed(self, seed: int) -> None:
        """Restart the engine's random stream from ``seed``."""
        self._seed = seed
        self._generator = self._new_generator(seed)

    def sync_generator_device(self) -> None:
        """Restart the random stream from the seed on the model's device if the model has moved
        since the generator was made (a generator draws on one device only)."""
        if self._generator.device.type != self.device.type:
            self._generator = self._new_generator(self._seed)

    # ------------------------------------------------------------------ request-level generation

    def request_scheduler(self, params: SamplingParams) -> RequestScheduler:
        """A continuous-batching scheduler over this engine's model (:mod:`verity.rollout.hf_requests`):
        requests join the decode batch and leave it between decode steps."""
        from verity.rollout.hf_requests import HFRequestScheduler

        return HFRequestScheduler(self, params)

    def check_prefill_lockstep(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> None:
        """Before a prefill of ``prompt_ids`` / ``prompt_mask`` ``[B, P]``: nothing on one process
        (a tensor-parallel engine checks its ranks agree, and raises where they do not)."""

    # ------------------------------------------------------------------ generate

    def generate(self, batch: Batch | Mapping[str, Any], params: SamplingParams | None = None) -> Batch:
        """Sample responses for left-padded prompts; keys and shapes in ``verity.rollout.base``.

        ``params`` overrides the engine's sampling parameters; otherwise the
        engine's are updated by sampling keys found in the batch's meta
        (``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``,
        ``n``, ``ignore_eos``). Non-tensor per-row fields, meta and
        ``pad_rows`` (only with ``n == 1``) pass through.
        """
        if self.needs_weight_sync:
            raise RuntimeError(
                "the HF rollout released its weights while asleep and has not received all of them since: "
                "a weight sync must come before the next generate"
            )
        params = resolve_sampling(batch, self.sampling, params)
        rows = read_prompt_rows(batch, params.n, takes_images="hf")
        images = per_row_images(rows.non_tensors) if has_images(rows.non_tensors) else None
        with grouped_sdpa(self.model):  # grouped KV heads read in place on CPU (rollout.gqa_attention)
            responses, response_mask, logprobs = self._decode(rows.prompt_ids, rows.prompt_mask, params, images)
        return build_rollout_output(rows, responses, response_mask, logprobs)

    @torch.no_grad()
    def _decode(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        images: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode loop. Returns responses [B, R] int64, response_mask [B, R] int64, logprobs [B, R] float32.

        ``images``: per-row ``(pixel_values, image_grid_thw)`` lists for a vision-language
        model; the prefill then takes the image patches and M-RoPE positions ``[3, B, P]``
        (:mod:`verity.data.vision_inputs`), and decoded token ``t`` sits at position
        ``max(prompt positions) + 1 + t`` on all three axes.
        """
        device = self.device
        self.sync_generator_device()
        prompt_ids = prompt_ids.to(device).long()
        attention_mask = prompt_mask.to(device).long()
        rows, length = prompt_ids.shape[0], params.max_new_tokens
        responses = torch.full((rows, length), self.pad_token_id, dtype=torch.long, device=device)
        response_mask = torch.zeros((rows, length), dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, length), dtype=torch.float32, device=device)
        eos_ids = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
        batch_rows = torch.arange(rows, device=device)  # the rows still in the decode batch
        finished = torch.zeros(rows, dtype=torch.bool, device=device)  # per decode-batch row
        ones = torch.ones((rows, 1), dtype=torch.long, device=device)

        was_training = self.model.training
        self.model.eval()
        try:
            position_ids = position_ids_from_mask(attention_mask)
            next_position = position_ids[:, -1:] + 1
            prefill: dict = {"position_ids": position_ids}
            if images is not None:
                prefill, _ = vision_forward_inputs(self.model, prompt_ids, attention_mask, *images)
                mrope = prefill["position_ids"]  # [3, B, P]; padding columns read 0
                next_position = (mrope.amax(dim=(0, 2)) + 1).reshape(-1, 1).unsqueeze(0).expand(3, -1, -1)
            cache = reserved_cache(prompt_ids.shape[1] + length)  # appends in place (rollout.kv_cache)
            next_logits, cache = self._prefill(
                prompt_ids, attention_mask, prefill, cache, shared=images is None
            )
            banned = vision_token_ids(self.model) if images is not None else []
            for step in range(length):
                if banned:
                    next_logits = mask_vision_tokens(next_logits, banned)  # see vision_inputs
                tokens, token_logprobs = sample_next_token(next_logits, params, self._generator)
                alive = ~finished
                responses[batch_rows, step] = torch.where(alive, tokens, self.pad_token_id)
                logprobs[batch_rows, step] = torch.where(alive, token_logprobs, 0.0)
                response_mask[batch_rows, step] = alive.long()
                if not params.ignore_eos:
                    finished = finished | (alive & torch.isin(tokens, eos_ids))
                    if bool(finished.all()):
                        break
                if step + 1 == length:
                    break
                fed = responses[batch_rows, step : step + 1]
                done = int(finished.sum())
                if done and done >= COMPACT_FINISHED_FRACTION * len(batch_rows):
                    # finished rows leave the batch: their cache rows, mask and positions go too
                    keep = (~finished).nonzero().squeeze(-1)
                    cache.batch_select_indices(keep)
                    attention_mask, fed = attention_mask[keep], fed[keep]
                    next_position = next_position[..., keep, :]  # [B, 1], or [3, B, 1] with M-RoPE
                    batch_rows, finished = batch_rows[keep], finished[keep]
                attention_mask = torch.cat([attention_mask, ones[: len(batch_rows)]], dim=1)
                output = self.model(
                    input_ids=fed,
                    attention_mask=attention_mask,
                    position_ids=next_position,
                    past_key_values=cache,
                    use_cache=True,
                )
                next_logits, cache = output.logits[:, -1, :], output.past_key_values
                next_position = next_position + 1
        finally:
            self.model.train(was_training)
        return responses, response_mask, logprobs

    def _prefill(
        self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, inputs: dict, cache: Any, *, shared: bool
    ) -> tuple[torch.Tensor, Any]:
        """The prompts' forward pass into ``cache``: ``(logits of the last position [B, V], KV cache of B rows)``.

        With ``shared``, rows repeating a prompt (the ``n`` samples of a group) are computed
        once and the cache is copied out to every row (``Cache.reorder_cache``), so a group
        of 8 costs one prompt's prefill; each row's logits and cache equal its own prefill's
        up to float rounding of the smaller batch.
        """
        if shared:
            key = torch.where(attention_mask.bool(), prompt_ids, -1)
            unique, inverse = torch.unique(key, dim=0, return_inverse=True)
            if unique.shape[0] < prompt_ids.shape[0]:
                rows = torch.arange(len(inverse), device=prompt_ids.device)
                first = torch.full((unique.shape[0],), len(inverse), dtype=torch.long, device=rows.device)
                first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # a row of each prompt
                output = self.model(
                    input_ids=prompt_ids[first],
                    attention_mask=attention_mask[first],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                    **{k: v[first] for k, v in inputs.items()},
                )
                cache = output.past_key_values
                cache.reorder_cache(inverse)
                return output.logits[inverse, -1, :], cache
        output = self.model(
            input_ids=prompt_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **inputs,
        )
        return output.logits[:, -1, :], output.past_key_values

    # ------------------------------------------------------------------ weights and memory

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy full tensors into the model's parameters/buffers in place (dtype and device converted).

        Names are ``model.state_dict()`` names. Raises KeyError for an unknown
        name and ValueError for a shape mismatch. Returns the number copied.
        """
        targets = self.model.state_dict(keep_vars=True)
        loaded = 0
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                raise KeyError(f"load_weights: the rollout model has no parameter named {name!r}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"load_weights[{name!r}]: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
                )
            target.data.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
            self._stale.discard(id(target))
            loaded += 1
            del tensor  # released before the stream gathers the next one
        return loaded

    def weight_bytes(self) -> int:
        """Bytes of weight storage on the rollout's device now (0 after :meth:`sleep`)."""
        device = self.device
        return sum(
            p.untyped_storage().nbytes() for p in self._parameters() if p.device == device and p.numel()
        )

    def sleep(self) -> None:
        """Give the weights' memory back until the next weight sync.

        On an accelerator the model moves to host memory and the device's cache is emptied;
        :meth:`wake` moves it back. On a CPU the weights are released (each parameter keeps its
        shape and dtype, not its storage): :meth:`wake` gives them storage again and
        :attr:`needs_weight_sync` stays True until :meth:`load_weights` has filled every one.
        Buffers (rotary frequencies) are kept.
        """
        device = self.device
        if device.type == "cpu":
            if not self._released:
                for param in self._parameters():
                    self._released[id(param)] = (param.shape, param.dtype)
                    param.data = torch.empty(0, dtype=param.dtype)
            return
        self._awake_device = device
        self.model.to("cpu")
        accelerator = getattr(torch, device.type, None)
        if accelerator is not None and hasattr(accelerator, "empty_cache"):
            accelerator.empty_cache()

    def wake(self) -> None:
        """Undo :meth:`sleep`: the model back on its device, or released weights given storage (unfilled)."""
        if self._released:
            for param in self._parameters():
                shape, dtype = self._released[id(param)]
                param.data = torch.empty(shape, dtype=dtype)
                self._stale.add(id(param))
            self._released = {}
        if self._awake_device is None:
            return
        self.model.to(self._awake_device)
        self._awake_device = None

    @property
    def needs_weight_sync(self) -> bool:
        """True from a CPU :meth:`sleep` until :meth:`load_weights` has filled every parameter."""
        return bool(self._released or self._stale)

    def _parameters(self) -> list[torch.nn.Parameter]:
        """Each distinct parameter once (tied embeddings share one)."""
        return list(self.model.parameters())
