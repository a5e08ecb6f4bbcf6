"""Autoregressive generation for any decoder: greedy, temperature, top-k and top-p sampling with a KV cache.

The interface a model provides (GPTModel does; any ``nn.Module`` or function will do)::

    forward(tokens, position_offset, inference_context) -> logits

- ``tokens`` [b, s] int64: the new tokens, at positions ``position_offset .. position_offset + s - 1``;
- ``inference_context``: a :class:`~lightning_megatron.transformer.InferenceContext` (the KV cache;
  the model passes it as ``inference_context=`` to its TransformerBlock and computes the rotary table
  ``RotaryEmbedding(s, offset=position_offset)`` or learned positions from the offset), or None: then
  ``tokens`` is the whole sequence and ``position_offset`` 0;
- ``logits`` [b, s, V] or vocab-parallel [b, s, V_pad / t] (ColumnParallelLinear without
  ``gather_output``): pass the TP group as ``tp_group`` and the logits of the last position are
  gathered over it (vocab padding cut at ``vocab_size``). Every TP rank then holds the same logits;
  the token is picked on TP rank 0 and shared with the others (an all-reduce), so all ranks continue
  with the same tokens whatever their generators. The forward runs in ``torch.no_grad`` and the
  model should be in eval mode (no dropout).

:func:`generate` runs the prompt once (prefill), then one token per step; each step's token is
:func:`sample_next_token` of the last position's logits. Prompts of one batch have equal length (no
padding); ``stop_token`` (e.g. the tokenizer's ``eod``) ends a sequence, which is then padded with it,
and generation stops when every sequence has ended. Pipeline parallelism is not handled here: the
forward must return the logits on every rank that calls :func:`generate`.

Sampling follows Hugging Face's warpers, in their order: ``logits / temperature``, then top-k (keep the
k largest), then top-p (keep the smallest set of most likely tokens whose probability reaches p), then
one draw from the softmax with ``generator``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_megatron.parallel_state import group_rank, group_size
from lightning_megatron.tensor_parallel import gather_from_tensor_model_parallel_region
from lightning_megatron.tensor_parallel.mappings import all_reduce
from lightning_megatron.transformer.inference import InferenceContext

__all__ = ["generate", "sample_next_token", "filter_logits", "generation_problems", "DecoderForward"]

DecoderForward = Callable[[torch.Tensor, int, InferenceContext | None], torch.Tensor]
"""``forward(tokens [b, s], position_offset, inference_context or None) -> logits [b, s, V or V/t]``."""


def generation_problems(*, max_new_tokens: object = 0, temperature: object = 1.0, top_k: object = 0,
                        top_p: object = 1.0, prefix: str = "") -> list[str]:
    """What is wrong with these generation settings, one line each ([] when nothing): ``max_new_tokens``
    an integer >= 0, ``temperature`` > 0, ``top_k`` an integer >= 0 (0: off), ``top_p`` in (0, 1] (1: off).
    ``prefix`` spells the names (``"--model.predict_"`` for the CLI's options)."""
    def number(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def integer(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    problems = []
    if not (integer(max_new_tokens) and max_new_tokens >= 0):  # type: ignore[operator]
        problems.append(f"{prefix}max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if not (number(temperature) and temperature > 0):  # type: ignore[operator]
        problems.append(f"{prefix}temperature={temperature!r} must be > 0 (it divides the logits; greedy decoding "
                        f"takes the argmax)")
    if not (integer(top_k) and top_k >= 0):  # type: ignore[operator]
        problems.append(f"{prefix}top_k={top_k!r} must be an integer >= 0 (0 turns it off)")
    if not (number(top_p) and 0.0 < top_p <= 1.0):  # type: ignore[operator]
        problems.append(f"{prefix}top_p={top_p!r} must be in (0, 1] (1.0 turns it off)")
    return problems


def filter_logits(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
                  ) -> torch.Tensor:
    """``logits`` [b, V] scaled by ``1 / temperature`` with the tokens outside top-k / top-p set to -inf
    (``top_k=0`` and ``top_p=1.0`` keep everything). Hugging Face's Temperature/TopK/TopP warpers."""
    problems = generation_problems(temperature=temperature, top_k=top_k, top_p=top_p)
    if problems:
        raise ValueError(problems[0])
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - top_p  # the least likely tokens whose total stays within 1 - p
        remove[..., -1:] = False  # always keep the most likely token
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


def sample_next_token(logits: torch.Tensor, *, greedy: bool = True, temperature: float = 1.0, top_k: int = 0,
                      top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token [b] (int64) from the last position's logits [b, V]: the argmax when ``greedy``,
    else one draw from ``softmax(filter_logits(...))``."""
    if greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _last_logits(logits: torch.Tensor, tp_group: dist.ProcessGroup | None, vocab_size: int | None) -> torch.Tensor:
    last = logits[:, -1].float()  # [b, V/t]
    if group_size(tp_group) > 1:
        last = gather_from_tensor_model_parallel_region(last.contiguous(), tp_group)  # [b, V_pad]
    return last if vocab_size is None else last[:, :vocab_size]


def _agree(token: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """TP rank 0's token on every TP rank (a sum in which the other ranks give zeros)."""
    if group_size(tp_group) == 1:
        return token
    mine = token if group_rank(tp_group) == 0 else torch.zeros_like(token)
    return all_reduce(mine.clone(), tp_group)


@torch.no_grad()
def generate(forward: DecoderForward, prompt_tokens: torch.Tensor, max_new_tokens: int, *, greedy: bool = True,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, use_cache: bool = True,
             stop_token: int | None = None, vocab_size: int | None = None,
             tp_group: dist.ProcessGroup | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """``prompt_tokens`` [b, s0] followed by up to ``max_new_tokens`` generated ones: [b, s0 + n].

    ``use_cache=False`` re-runs the whole sequence each step (the reference the cache is tested
    against). ``vocab_size`` cuts padded vocabulary columns so they are never picked.
    """
    if prompt_tokens.dim() != 2 or prompt_tokens.shape[1] < 1:
        raise ValueError(f"prompt_tokens of shape {tuple(prompt_tokens.shape)}: expected [batch, length >= 1]")
    problems = generation_problems(max_new_tokens=max_new_tokens)
    if problems:
        raise ValueError(problems[0])
    if not greedy:
        filter_logits(prompt_tokens.new_zeros(1, 1, dtype=torch.float32), temperature=temperature, top_k=top_k,
                      top_p=top_p)  # validate the settings before any forward
    b, s0 = prompt_tokens.shape
    tokens = prompt_tokens
    cache = InferenceContext(max_batch_size=b, max_sequence_length=s0 + max_new_tokens) if use_cache else None
    finished = torch.zeros(b, dtype=torch.bool, device=tokens.device)
    new = tokens  # what the next forward sees
    for _ in range(max_new_tokens):
        if cache is None:
            logits = forward(tokens, 0, None)
        else:
            logits = forward(new, cache.sequence_len_offset, cache)
            cache.advance(new.shape[1])
        token = sample_next_token(_last_logits(logits, tp_group, vocab_size), greedy=greedy,
                                  temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        token = _agree(token.to(tokens.dtype), tp_group)
        if stop_token is not None:
            token = token.masked_fill(finished, stop_token)
            finished |= token == stop_token
        new = token[:, None]
        tokens = torch.cat([tokens, new], dim=1)
        if stop_token is not None and bool(finished.all()):
            break
    return tokens
