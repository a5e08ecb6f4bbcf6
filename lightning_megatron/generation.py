"""Autoregressive generation for any decoder: greedy, temperature, top-k and top-p sampling with a KV cache,
prompts of different lengths in one batch, stop tokens and stop strings, tensor and pipeline parallelism.

The interface a model provides (GPTModel does; any ``nn.Module`` or function will do)::

    forward(tokens, position_offset, inference_context) -> logits

- ``tokens`` [b, s] int64: the new tokens, at positions ``position_offset .. position_offset + s - 1``;
- ``inference_context``: a :class:`~lightning_megatron.transformer.InferenceContext` (the KV cache;
  the model passes it as ``inference_context=`` to its TransformerBlock and computes the rotary table
  ``RotaryEmbedding(s, offset=position_offset)`` or learned positions from the offset; for left-padded
  prompts it takes each row's positions from ``inference_context.position_ids(s)``, and attention
  takes the padding mask from the context), or None: then ``tokens`` is the whole sequence and
  ``position_offset`` 0;
- ``logits`` [b, s, V] or vocab-parallel [b, s, V_pad / t] (ColumnParallelLinear without
  ``gather_output``): pass the TP group as ``tp_group`` and the logits of the last position are
  gathered over it (vocab padding cut at ``vocab_size``). Every TP rank then holds the same logits;
  the token is picked on TP rank 0 and shared with the others (an all-reduce), so all ranks continue
  with the same tokens whatever their generators. The forward runs in ``torch.no_grad`` and the
  model should be in eval mode (no dropout).
- pipeline parallelism (``pp_group``): the forward returns the logits on the last stage and None on the
  others (:func:`pipelined_forward` runs a rank's chunks in model order and passes the hidden states on);
  the last stage picks the token and shares it with every stage (an all-reduce over ``pp_group``).

:func:`generate` runs the prompt once (prefill), then one token per step; each step's token is
:func:`sample_next_token` of the last position's logits. Prompts of different lengths (a list of 1-D
tensors, or a left-padded tensor with its ``attention_mask``) run as one left-padded batch: the cache
holds the padding (``InferenceContext(left_padding=...)``), which gives each row its own positions
(counted from its first real token, as Hugging Face's ``cumsum(attention_mask) - 1``) and hides the pad
keys in every forward, so each row generates what it would alone. :class:`StopRule` ends a sequence at
``stop_token`` (e.g. the tokenizer's ``eod``) or when its text (``detokenize`` of its new tokens) contains
one of ``stop_strings``; an ended sequence is padded with ``pad_token`` and generation stops when every
sequence has ended. Every rank holds the same tokens, so every rank takes the same decisions.

Before any forward: ``max_new_tokens`` is an integer >= 0, the sampling settings are in range
(:func:`generation_problems`) and the longest prompt and the new tokens fit ``max_sequence_length``
(:func:`context_length_problem`: the model sees ``prompt + max_new_tokens - 1`` positions, the last
token being returned, never fed back).

Sampling follows Hugging Face's warpers, in their order: ``logits / temperature``, then top-k (keep the
k largest), then top-p (keep the smallest set of most likely tokens whose probability reaches p), then
one draw from the softmax with ``generator``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.parallel_state import Group, ParallelState, group_rank, group_size
from lightning_megatron.pipeline.p2p import P2PCommunicator
from lightning_megatron.tensor_parallel import gather_from_tensor_model_parallel_region
from lightning_megatron.tensor_parallel.mappings import all_reduce
from lightning_megatron.transformer.inference import InferenceContext

__all__ = ["generate", "sample_next_token", "filter_logits", "generation_problems", "context_length_problem",
           "stop_strings_problem", "left_pad", "pipelined_forward", "StopRule", "StopsGeneration",
           "GenerationTokenizer", "TokenizedData", "DecoderForward", "Prompts"]

DecoderForward = Callable[[torch.Tensor, int, InferenceContext | None], torch.Tensor | None]
"""``forward(tokens [b, s], position_offset, inference_context or None) -> logits [b, s, V or V/t]`` (None on a
pipeline stage that does not end the model)."""

Prompts = torch.Tensor | Sequence[torch.Tensor | Sequence[int]]
"""A [b, s0] tensor (equal lengths, or left-padded with an ``attention_mask``) or a list of 1-D prompts."""


@runtime_checkable
class GenerationTokenizer(Protocol):
    """What generation takes from a tokenizer (our BPE and WordPiece tokenizers have it): the id that ends a
    document, the text of ids (stop strings, completions) and the ids of a text (prompts given as text)."""

    @property
    def eod(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class TokenizedData(Protocol):
    """A datamodule that tokenizes its text (GPTDataModule, a fine-tuning datamodule): a decoder's generation
    takes the end-of-document token and the text of ids from its ``tokenizer`` (a :class:`GenerationTokenizer`)."""

    tokenizer: object


@runtime_checkable
class StopsGeneration(Protocol):
    """A module whose ``predict`` generates (GPTLightningModule): the rule that ended its sequences, with which
    the PredictionWriter cuts what it writes."""

    def predict_stop_rule(self) -> StopRule: ...


@dataclass(frozen=True)
class StopRule:
    """When a generated sequence ends, and what a reader sees of it.

    A sequence ends at the first new token that is ``stop_token`` (or one of ``other_stop_tokens``), or after
    which the text of its new tokens (``detokenize``) contains one of ``stop_strings``. It keeps its new tokens up
    to and including that one (:meth:`end`); its completion is their text without the stop token, cut before the
    first stop string (:meth:`completion`). The default rule never ends a sequence.
    """

    stop_token: int | None = None
    """The id that ends a sequence (the tokenizer's end-of-document token), or None."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end a sequence once its generated text contains one (needs ``detokenize``)."""
    detokenize: Callable[[Sequence[int]], str] | None = None
    """Ids -> text (the tokenizer's ``detokenize``): for ``stop_strings`` and :meth:`completion`."""
    other_stop_tokens: tuple[int, ...] = ()
    """More ids that end a sequence as ``stop_token`` does (a Hugging Face folder's ``generation_config.json``
    names several: Llama 3.1 Instruct's ``<|end_of_text|>``, ``<|eom_id|>`` beside ``<|eot_id|>``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "other_stop_tokens", tuple(self.other_stop_tokens))
        named = [("stop_token", self.stop_token), *(("other_stop_tokens", t) for t in self.other_stop_tokens)]
        for name, token in named:
            if token is not None and (not isinstance(token, int) or isinstance(token, bool) or token < 0):
                raise ValueError(f"{name}: {token!r} must be a token id (an integer >= 0) or None")
        problem = stop_strings_problem(self.stop_strings)
        if problem:
            raise ValueError(problem)
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if self.stop_strings and self.detokenize is None:
            raise ValueError(f"stop_strings={list(self.stop_strings)!r} need the text of the generated tokens: give "
                             f"a detokenize function (the tokenizer's detokenize)")

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """Every id that ends a sequence."""
        return ((self.stop_token,) if self.stop_token is not None else ()) + self.other_stop_tokens

    @property
    def stops(self) -> bool:
        """Whether anything ends a sequence."""
        return bool(self.stop_tokens) or bool(self.stop_strings)

    def _has_stop_string(self, ids: Sequence[int]) -> bool:
        text = self.detokenize(list(ids))  # type: ignore[misc]
        return any(s in text for s in self.stop_strings)

    def end(self, new: Sequence[int]) -> int:
        """How many of the generated tokens ``new`` the sequence keeps: up to and including the one that ended
        it, else all of them."""
        new = list(new)
        n = len(new)
        stops = self.stop_tokens
        n = next((i + 1 for i, token in enumerate(new) if token in stops), n)
        if self.stop_strings and self._has_stop_string(new[:n]):
            lo, hi = 1, n  # the fewest tokens whose text holds a stop string (text only grows with tokens)
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self._has_stop_string(new[:mid]) else (mid + 1, hi)
            n = lo
        return n

    def completion(self, new: Sequence[int]) -> str:
        """The text a reader sees of the generated tokens ``new``: the kept ones (:meth:`end`) without the stop
        token, cut before the first stop string."""
        if self.detokenize is None:
            raise ValueError("StopRule.completion needs detokenize (the tokenizer's detokenize)")
        kept = list(new)[: self.end(new)]
        if kept and kept[-1] in self.stop_tokens:
            kept = kept[:-1]
        text = self.detokenize(kept)
        return text[: min((i for s in self.stop_strings if (i := text.find(s)) >= 0), default=len(text))]

    def ended(self, new: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
        """Which rows have ended [b] (bool), given the new tokens so far ``new`` [b, k] (the last column just
        picked) and the rows ``finished`` before it."""
        ended = finished.clone()
        for token in self.stop_tokens:  # a scalar each: no list of ids copied to the device every step
            ended |= new[:, -1] == token
        if self.stop_strings:
            rows = new.tolist()
            for i in torch.nonzero(~ended).flatten().tolist():
                if self._has_stop_string(rows[i]):
                    ended[i] = True
        return ended


def stop_strings_problem(stop_strings: object, name: str = "stop_strings") -> str | None:
    """Why ``stop_strings`` is not a list of non-empty strings (None when it is); ``name`` spells the setting."""
    if isinstance(stop_strings, str) or not isinstance(stop_strings, Sequence) or \
            not all(isinstance(s, str) and s for s in stop_strings):
        return f"{name}={stop_strings!r} must be a list of non-empty strings (e.g. ['\\n\\n'])"
    return None


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


def context_length_problem(prompt_length: int, max_new_tokens: int, max_sequence_length: int | None) -> str | None:
    """Why a prompt of ``prompt_length`` tokens followed by ``max_new_tokens`` does not fit a model of
    ``max_sequence_length`` positions (None when it does): the model sees ``prompt_length + max_new_tokens - 1``
    positions (the last new token is returned, never fed back), the rule of ``predict``'s check before launch."""
    if max_sequence_length is None or max_new_tokens == 0:
        return None
    need = prompt_length + max_new_tokens - 1
    if need <= max_sequence_length:
        return None
    fewer = max_sequence_length - prompt_length + 1
    fix = (f"generate at most {fewer} new tokens (max_new_tokens={fewer}) or shorten the prompt to at most "
           f"{max(max_sequence_length - max_new_tokens + 1, 1)} tokens" if fewer >= 1 else
           f"shorten the prompt to at most {max(max_sequence_length - max_new_tokens + 1, 1)} tokens")
    return (f"a prompt of {prompt_length} tokens followed by max_new_tokens={max_new_tokens} needs {need} positions, "
            f"more than the model's max_sequence_length={max_sequence_length}; {fix}")


def filter_logits(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
                  ) -> torch.Tensor:
    """``logits`` [b, V] scaled by ``1 / temperature`` with the tokens outside top-k / top-p set to -inf
    (``top_k=0`` and ``top_p=1.0`` keep everything). Hugging Face's Temperature/TopK/TopP warpers."""
    problems = generation_problems(temperature=temperature, top_k=top_k, top_p=top_p)
    if problems:
        raise ValueError(problems[0])
    scaled = logits.float() / temperature
    if bool(scaled.isposinf().any()):  # a temperature so small that logits / T overflows: the same softmax from
        scaled = (logits.float() - logits.float().amax(dim=-1, keepdim=True)) / temperature  # the largest at 0
    logits = scaled
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
                      top_p: float = 1.0, generator: torch.Generator | Sequence[torch.Generator] | None = None
                      ) -> torch.Tensor:
    """The next token [b] (int64) from the last position's logits [b, V]: the argmax when ``greedy``,
    else one draw from ``softmax(filter_logits(...))``, with ``generator``, or row ``i`` with ``generator[i]``
    (a sequence of one generator a row: :func:`row_generators`)."""
    if greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p).softmax(dim=-1)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if len(generator) != probs.shape[0]:
        raise ValueError(f"{len(generator)} generators for {probs.shape[0]} rows: give one a row")
    return torch.cat([torch.multinomial(row[None], 1, generator=g)[0] for row, g in zip(probs, generator)])


def row_seed(seed: int, index: int) -> int:
    """The seed of prompt ``index``'s draws under ``seed`` (a 63-bit mix of the two: neighbouring seeds and indices
    give unrelated streams)."""
    mixed = (int(seed) * 0x9E3779B97F4A7C15 + int(index) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    mixed ^= mixed >> 31
    return mixed % 2**63


def row_generators(seeds: Sequence[int], device: torch.device) -> list[torch.Generator]:
    """One generator a row, seeded with ``seeds[i]``: a row's draws depend on its seed alone, not on the rows
    beside it, the batch size or the layout."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def left_pad(prompts: Sequence[torch.Tensor | Sequence[int]], pad_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one batch, padded on the left with ``pad_token``: tokens [b, s0] (s0 the
    longest) and the attention mask [b, s0] (1 on a prompt's tokens, 0 on padding), Hugging Face's layout."""
    rows = [p if torch.is_tensor(p) else torch.tensor(list(p), dtype=torch.int64) for p in prompts]
    if not rows or any(r.dim() != 1 or r.numel() < 1 or r.is_floating_point() for r in rows):
        raise ValueError(f"prompts: expected a non-empty list of 1-D integer prompts of at least one token each, "
                         f"got shapes {[tuple(r.shape) for r in rows]}")
    device, s0 = rows[0].device, max(r.numel() for r in rows)
    tokens = torch.full((len(rows), s0), pad_token, dtype=torch.int64, device=device)
    mask = torch.zeros((len(rows), s0), dtype=torch.int64, device=device)
    for i, r in enumerate(rows):
        tokens[i, s0 - r.numel():] = r.to(device)
        mask[i, s0 - r.numel():] = 1
    return tokens, mask


def _left_padding(attention_mask: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """The pad positions of each row [b] of a left-padded batch's ``attention_mask`` (None: no padding)."""
    if attention_mask is None:
        return None
    if attention_mask.shape != shape:
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} for prompt_tokens of shape "
                         f"{tuple(shape)}: give one 0/1 entry per token")
    real = attention_mask != 0
    padding = shape[1] - real.sum(dim=1)
    left_padded = torch.equal(real, torch.arange(shape[1], device=real.device) >= padding[:, None])
    if not left_padded or bool((padding == shape[1]).any()):
        raise ValueError("attention_mask: generation takes left-padded prompts (each row 0 ... 0 1 ... 1, at least "
                         "one 1); pad on the left (lightning_megatron.generation.left_pad) or pass a list of prompts")
    return padding if bool(padding.any()) else None


def _last_logits(logits: torch.Tensor, tp_group: Group, vocab_size: int | None) -> torch.Tensor:
    last = logits[:, -1].float()  # [b, V/t]
    if group_size(tp_group) > 1:
        last = gather_from_tensor_model_parallel_region(last.contiguous(), tp_group)  # [b, V_pad]
    return last if vocab_size is None else last[:, :vocab_size]


def _all_ended(finished: torch.Tensor, group: Group) -> bool:
    """Whether every row of every rank of ``group`` has ended (one scalar all-reduce when it has several ranks)."""
    running = (~finished).any().to(torch.int64).reshape(1)
    if group_size(group) > 1:
        running = all_reduce(running, group)
    return not bool(running)


def _from_rank(token: torch.Tensor, group: Group, src: int) -> torch.Tensor:
    """Group rank ``src``'s ``token`` on every rank of ``group`` (a sum in which the other ranks give zeros)."""
    if group_size(group) == 1:
        return token
    mine = token if group_rank(group) == src else torch.zeros_like(token)
    return all_reduce(mine.clone(), group)


def pipelined_forward(chunks: Sequence[nn.Module], parallel_state: ParallelState, hidden_size: int,
                      run: Callable[[nn.Module, torch.Tensor, int, InferenceContext | None], torch.Tensor]
                      ) -> DecoderForward:
    """A :data:`DecoderForward` over a pipeline: this rank's ``chunks`` (one per virtual stage; virtual stage v
    of pipeline rank r is the model's stage ``v * pp + r``) run in model order, each on the hidden states
    [s, b, h] of the stage before (received over the PP group, :class:`~lightning_megatron.pipeline.p2p.
    P2PCommunicator`, and given to the chunk's ``set_input_tensor``) and sending its own to the next stage;
    ``run(chunk, tokens, position_offset, inference_context)`` runs one chunk. Returns the logits on the
    stage that ends the model, None on the others. One KV cache serves every chunk of the rank (its
    layers are keyed by their global number)."""
    def forward(tokens: torch.Tensor, offset: int, cache: InferenceContext | None) -> torch.Tensor | None:
        b, s = tokens.shape
        dtype = next(chunks[0].parameters()).dtype
        comm = P2PCommunicator(parallel_state, (s, b, hidden_size), dtype, tokens.device, requires_grad=False)
        received = None
        if not parallel_state.is_pipeline_first_stage():
            received = comm.send_forward_recv_forward(None, recv_prev=True)
        for v, chunk in enumerate(chunks):
            if not chunk.pre_process:
                chunk.set_input_tensor(received)
            out = run(chunk, tokens, offset, cache)
            if chunk.post_process:
                return out
            received = comm.send_forward_recv_forward(out, recv_prev=v + 1 < len(chunks))
        return None

    return forward


@torch.no_grad()
def generate(forward: DecoderForward, prompt_tokens: Prompts, max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, greedy: bool = True, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, use_cache: bool = True, stop_token: int | None = None,
             stop_strings: Sequence[str] = (), detokenize: Callable[[Sequence[int]], str] | None = None,
             other_stop_tokens: Sequence[int] = (), pad_token: int | None = None, vocab_size: int | None = None,
             max_sequence_length: int | None = None, tp_group: Group = None, pp_group: Group = None,
             step_group: Group = None, generator: torch.Generator | None = None,
             seeds: Sequence[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
    """Each prompt followed by up to ``max_new_tokens`` generated tokens.

    - ``prompt_tokens`` [b, s0] -> [b, s0 + n] (n <= ``max_new_tokens``: fewer when every row ended). With
      ``attention_mask`` [b, s0] (1 real, 0 padding) the rows are left-padded prompts, returned with their padding.
      A row that ended is padded with ``pad_token`` after its stop.
    - a list of 1-D prompts (tensors or lists of ids) -> a list of 1-D tensors, each its prompt followed by its
      new tokens up to and including the one that ended it (no padding).

    ``stop_token``, ``stop_strings``, ``detokenize``, ``other_stop_tokens``: the :class:`StopRule`.
    ``pad_token``: what fills the left padding of a list's batch and ended rows (None: ``stop_token``, else 0).
    ``use_cache=False`` re-runs the whole sequence each step (the reference the cache is tested against;
    left-padded prompts then go through a fresh cache per step, which carries their padding). ``vocab_size`` cuts
    padded vocabulary columns so they are never picked. ``max_sequence_length``: the model's positions, checked
    before any forward (:func:`context_length_problem`). ``tp_group`` / ``pp_group``: module docstring.
    ``step_group``: ranks with prompts of their own whose forwards meet in collectives (expert parallelism's token
    dispatch): they take the same steps, a rank whose rows all ended going on (its rows filled) until every rank's
    have; alone, it stopped, and the others waited in the dispatch until the process group's timeout.
    ``generator``: the sampling's (None: torch's default); ``seeds``: one a row instead, each row drawing from its
    own generator (:func:`row_generators`), so that a row samples the same tokens in any batch and at any layout.
    """
    rule = StopRule(stop_token, tuple(stop_strings), detokenize, tuple(other_stop_tokens))
    fill = pad_token if pad_token is not None else stop_token if stop_token is not None else 0
    ragged = not torch.is_tensor(prompt_tokens)
    if ragged:
        if attention_mask is not None:
            raise ValueError("a list of prompts is padded here: give no attention_mask with it")
        prompts = [p if torch.is_tensor(p) else torch.tensor(list(p), dtype=torch.int64) for p in prompt_tokens]
        prompt_tokens, attention_mask = left_pad(prompts, fill)
    if prompt_tokens.dim() != 2 or prompt_tokens.shape[1] < 1:
        raise ValueError(f"prompt_tokens of shape {tuple(prompt_tokens.shape)}: expected [batch, length >= 1]")
    problems = generation_problems(max_new_tokens=max_new_tokens)
    if problems:
        raise ValueError(problems[0])
    if not greedy:
        filter_logits(prompt_tokens.new_zeros(1, 1, dtype=torch.float32), temperature=temperature, top_k=top_k,
                      top_p=top_p)  # validate the settings before any forward
    b, s0 = prompt_tokens.shape
    if seeds is not None:
        if generator is not None:
            raise ValueError("give generator (one for the batch) or seeds (one a row), not both")
        if len(seeds) != b:
            raise ValueError(f"seeds: {len(seeds)} for {b} prompts; give one a prompt")
        generator = row_generators(seeds, prompt_tokens.device)
    problem = context_length_problem(s0, max_new_tokens, max_sequence_length)
    if problem:
        raise ValueError(problem if b == 1 and not ragged else f"the longest prompt: {problem}")
    padding = _left_padding(attention_mask, prompt_tokens.shape)
    tokens = prompt_tokens
    cache = InferenceContext(b, s0 + max_new_tokens, left_padding=padding) if use_cache else None
    finished = torch.zeros(b, dtype=torch.bool, device=tokens.device)
    kept = torch.full((b,), max_new_tokens, dtype=torch.int64, device=tokens.device)  # new tokens each row keeps
    last_stage = group_size(pp_group) - 1
    new = tokens  # what the next forward sees
    for step in range(max_new_tokens):
        if cache is not None:
            logits = forward(new, cache.sequence_len_offset, cache)
            cache.advance(new.shape[1])
        elif padding is not None:
            logits = forward(tokens, 0, InferenceContext(b, tokens.shape[1], left_padding=padding))
        else:
            logits = forward(tokens, 0, None)
        if (logits is None) != (group_rank(pp_group) != last_stage):
            raise ValueError(f"the forward returned {'no logits' if logits is None else 'logits'} on pipeline rank "
                             f"{group_rank(pp_group)} of {group_size(pp_group)}: it must return them on the last "
                             f"stage only (pipelined_forward)")
        if logits is not None:
            token = sample_next_token(_last_logits(logits, tp_group, vocab_size), greedy=greedy,
                                      temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            token = _from_rank(token.to(tokens.dtype), tp_group, 0)
        else:
            token = torch.zeros(b, dtype=tokens.dtype, device=tokens.device)
        token = _from_rank(token, pp_group, last_stage).masked_fill(finished, fill)
        new = token[:, None]
        tokens = torch.cat([tokens, new], dim=1)
        if rule.stops:
            ended = rule.ended(tokens[:, s0:], finished)
            kept = torch.where(ended & ~finished, step + 1, kept)
            finished = ended
        # every rank of step_group asks, each step, whether or not its own rows can end
        if (rule.stops or group_size(step_group) > 1) and _all_ended(finished, step_group):
            break
    if not ragged:
        return tokens
    return [torch.cat([p.to(tokens.device), tokens[i, s0: s0 + int(kept[i])]]) for i, p in enumerate(prompts)]
