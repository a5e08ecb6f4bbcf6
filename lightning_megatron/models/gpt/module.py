"""GPTLightningModule: causal language modelling (GPT-2 and Llama shapes) for the MegatronStrategy.

A :class:`~lightning_megatron.language.module.LanguageLightningModule` (the language-model half every
family shares: the record in the hyper-parameters, chunks per virtual stage, megatron-core names with
global layer numbers, the [s, b, h] pipeline tensor, the default optimizer; on the model-agnostic
:class:`~lightning_megatron.module.MegatronLightningModule`). What is the decoder's own:

- ``config_class``: :class:`~lightning_megatron.models.gpt.config.GPTConfig`;
- ``build_chunk``: one :class:`GPTModel` per virtual pipeline stage;
- ``loss_forward``: the last chunk computes the vocab-parallel cross entropy of the next tokens
  (``labels``) averaged over ``loss_mask``;
- :meth:`GPTLightningModule.generate` (and ``complete`` for texts): continuations with a KV cache at any
  layout (pipeline stages token by token, sequence parallelism off while generating), prompts of different
  lengths left-padded in one batch, one stop rule (:meth:`~GPTLightningModule.stop_rule`: the tokenizer's
  end-of-document token by default, stop strings) shared with ``predict`` (``predict_batch``, the strategy's
  ``PredictsBatches``; ``predict_stop_rule``, which the PredictionWriter cuts with);
- ``training_flops`` (``CountsFlops``): the decoder's count, grouped-query and gated MLP included;
- ``estimate_shape`` (``EstimatesCost``): the sizes ``check --estimate-memory / --estimate-time`` use;
- validation / test ``perplexity`` (torchmetrics, over the data-parallel group: the whole split's
  exp(mean token cross entropy), equal at every layout).

The batch (Megatron's GPT dataset): ``tokens`` [b, s] int64, ``labels`` [b, s] int64 (the tokens
shifted by one), ``loss_mask`` [b, s] float; optional ``position_ids`` [b, s] (default arange) and
``document_ids`` [b, s] (packed samples: attention within a document only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torchmetrics import MetricCollection
from typing_extensions import override

from lightning_megatron.generation import GenerationTokenizer, Prompts, StopRule, TokenizedData, stop_strings_problem
from lightning_megatron.language.module import LanguageLightningModule
from lightning_megatron.metrics import Perplexity, eval_stage, float32_states, log_epoch_metrics, on_device, sync_args
from lightning_megatron.models.gpt.config import GPTConfig
from lightning_megatron.models.gpt.hf_config import GPT_ARCHITECTURE_KEYS
from lightning_megatron.models.gpt.interop import GPTInterop
from lightning_megatron.models.gpt.model import GPTModel, gpt_loss
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.transformer.moe import ExpertGroups
from lightning_megatron.pipeline.layout import ChunkLayout
from lightning_megatron.tensor_parallel.mappings import all_reduce
from lightning_megatron.transformer.context_parallel import split_batch
from lightning_megatron.transformer.inference import sequence_parallel_off

__all__ = ["GPTLightningModule"]


class GPTLightningModule(LanguageLightningModule):
    """A causal decoder LM (megatron-core's GPTModel), any TP x SP x PP x VP x DP x ZeRO-1 layout.

    Args:
        config: the model (:class:`~lightning_megatron.models.gpt.config.GPTConfig`: sizes, spec,
            positions, grouped-query attention, tied or untied output layer, ...; ``config.vocab_size``
            None reads ``trainer.datamodule.vocab_size``).
        lr, weight_decay, adam_beta2: as the base, at GPT-3 / Llama's defaults (3e-4, 0.1, 0.95).
        predict_max_new_tokens, predict_greedy, predict_temperature, predict_top_k, predict_top_p: what
            ``predict`` generates after each sample's ``tokens`` (:meth:`generate`): the prompt followed by
            the new tokens, greedy or sampled (Hugging Face's temperature / top-k / top-p).
        predict_seed: what ``predict``'s sampling draws from: each prompt its own generator, seeded from this and
            the prompt's index (:func:`~lightning_megatron.generation.row_seed`), so the same seed samples the same
            tokens at any layout, batch size or data-parallel size, and another seed others.
        predict_stop_at_eod: ``predict`` ends a sequence at the datamodule tokenizer's end-of-document
            token (as Hugging Face's ``generate`` stops at ``eos_token_id``): generation stops when every
            sequence of the batch has ended, and the written completion ends before it. ``False``: always
            ``predict_max_new_tokens`` tokens, EOD included as any other token.
        calculate_per_token_loss: train on the mean over the counted tokens (``loss_mask``) of the whole
            global batch, whatever microbatches and ranks hold them (megatron-core's option of that name;
            Hugging Face's Trainer normalises so across gradient accumulation). ``False`` (megatron-core's
            default): each microbatch's loss is its own tokens' mean, and the step the mean of those; where
            samples count different numbers of tokens (fine-tuning's masked prompts, padding) the objective
            then changes with ``micro_batch_size``. The logged ``loss`` is the objective either way.
        predict_stop_strings: texts that also end a sequence once its generated text contains one (e.g.
            ``["\\n\\n"]``); the written completion is cut before it. The rule of both settings is
            :meth:`predict_stop_rule`, the one :meth:`generate` applies (:meth:`stop_rule`).
        Others: as :class:`~lightning_megatron.language.module.LanguageLightningModule` (``init_seed``,
            ``optimizer``, ``adam_beta1``, ``compile``, ``init_from``: a lightning_megatron checkpoint, a
            Hugging Face ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` folder or a Megatron-LM GPT checkpoint,
            docs/interop.md; ``optimizer_class``, ``lr_scheduler_class``, ...).
    """

    config_class = GPTConfig
    config: GPTConfig

    def __init__(
        self,
        config: GPTConfig | None = None,
        *,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        adam_beta2: float = 0.95,
        predict_max_new_tokens: int = 32,
        predict_greedy: bool = True,
        predict_temperature: float = 1.0,
        predict_top_k: int = 0,
        predict_top_p: float = 1.0,
        predict_seed: int = 0,
        predict_stop_at_eod: bool = True,
        predict_stop_strings: list[str] | None = None,
        calculate_per_token_loss: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, lr=lr, weight_decay=weight_decay, adam_beta2=adam_beta2, **kwargs)
        problem = stop_strings_problem(predict_stop_strings or [], "predict_stop_strings")
        if problem:
            raise ValueError(f"{type(self).__name__}: {problem}")
        self.calculate_per_token_loss = bool(calculate_per_token_loss)
        """The training loss is the mean over the counted tokens of the whole global batch (this module's
        :meth:`start_step`, which the step calls before its schedule, counts them); False: the mean of the microbatches' own means (megatron-core's
        ``calculate_per_token_loss``, off by default there too)."""
        self._token_factor: torch.Tensor | None = None

    # ------------------------------------------------------------------ model

    @override
    def build_chunk(self, config: GPTConfig, place: ChunkLayout, parallel_state: ParallelState) -> GPTModel:
        return GPTModel(config, config.spec, self.vocab_size, config.max_sequence_length,
                        tp_group=parallel_state.group("tp"), position_embedding_type=config.position_embedding_type,
                        share_embeddings_and_output_weights=not config.untie_embeddings_and_output_weights,
                        pre_process=place.pre_process, post_process=place.post_process, layer_range=place.layers,
                        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by, seed=self.init_seed,
                        expert_groups=ExpertGroups.of(parallel_state) if config.num_moe_experts else None)

    @override
    def on_chunks_built(self) -> None:
        # val/test perplexity of the whole split, gathered over DP (a plain dict: outside the state dict)
        kw = sync_args(self.parallel_state)
        with float32_states():
            self.eval_metrics = {stage: MetricCollection({"perplexity": Perplexity(**kw)}) for stage in ("val", "test")}

    # ------------------------------------------------------------------ weights from elsewhere

    interop = GPTInterop()  # Hugging Face Llama / GPT-2 folders, Megatron-LM GPT checkpoints, export hf
    supports_context_parallel = True  # loss_forward splits the batch; attention gathers keys and values
    architecture_keys = GPT_ARCHITECTURE_KEYS

    @classmethod
    @override
    def free_arguments(cls, hparams: Mapping[str, Any]) -> frozenset[str]:
        """``max_sequence_length`` with rope or no positions (the rope table is computed, not a weight); learned
        positions are a tensor of that many rows."""
        free = cls.flat_hparams(hparams).get("position_embedding_type") in ("rope", "none")
        return frozenset({"max_sequence_length"}) if free else frozenset()


    # ------------------------------------------------------------------ steps

    def start_step(self, microbatches: Sequence[dict[str, torch.Tensor]]) -> None:
        """Before a training step's schedule (the strategy's ``StepRunner`` calls it with this rank's
        microbatches): with ``calculate_per_token_loss``, the factor that turns a microbatch's summed token
        losses into its share of the global batch's token mean, ``M x DP x CP / T`` (``T`` the counted tokens
        of the global batch, summed over the data-parallel group: one scalar all-reduce; the schedule divides by
        the ``M`` microbatches and the gradient reduction by ``DP x CP``). The last stage's ranks only."""
        self._token_factor = None
        ps = self.parallel_state
        if not self.calculate_per_token_loss or not self.model_chunks[-1].post_process:
            return
        counted = torch.stack([mb["loss_mask"].float().sum() for mb in microbatches]).sum()
        dp, cp = (ps.dp_size, ps.cp_size) if ps is not None else (1, 1)
        if dp > 1:
            all_reduce(counted, ps.group("dp"))
        self._token_factor = len(microbatches) * dp * cp / counted.clamp(min=1.0)

    @override
    def loss_forward(self, batch: dict[str, torch.Tensor], chunk: GPTModel):
        """The next-token loss of the batch on the last chunk (averaged over ``loss_mask``, with the number of
        counted tokens to log; at validation / test the whole split's perplexity is updated); the hidden
        states elsewhere."""
        ps = self.parallel_state
        context = None
        if ps is not None and ps.cp_size > 1:  # this rank's part of every sequence, attention over the CP group
            batch, context = split_batch(batch, ps.group("cp"), ps.cp_rank)
        labels = batch["labels"] if chunk.post_process else None
        out = chunk(batch["tokens"], batch.get("position_ids"), labels=labels, document_ids=batch.get("document_ids"),
                    context_parallel=context)
        if not chunk.post_process:
            return out
        loss_mask = batch["loss_mask"]
        stage = eval_stage(self)
        factor = self._token_factor if self.calculate_per_token_loss and not stage else None
        if context is None and factor is None:
            loss = gpt_loss(out, loss_mask)
            value, num_tokens = loss.detach(), loss_mask.float().sum()
        else:
            # The sequence's loss is its ranks' summed losses over its counted tokens: this rank's part,
            # times cp because the gradients are averaged over the data- and context-parallel ranks; per token,
            # its share of the global batch's mean (start_step's factor).
            mask = loss_mask.float()
            local = (out.float() * mask).sum()
            totals = torch.stack([local.detach(), mask.sum()])
            if context is not None:
                all_reduce(totals, ps.cp_group)
            value, num_tokens = totals[0] / totals[1].clamp(min=1.0), totals[1]
            loss = local * (factor if factor is not None else ps.cp_size / totals[1].clamp(min=1.0))
        with torch.no_grad():
            if stage:  # the whole split's perplexity, logged at the end of the epoch
                on_device(self.eval_metrics[stage], loss.device)["perplexity"].update(value, num_tokens)
            stats = {"lm_loss": value, "num_tokens": num_tokens}
            if context is not None or self.calculate_per_token_loss:
                # logged: the microbatch's token mean (the strategy weights it by num_tokens when the loss is
                # per token), not this rank's objective
                stats["loss"] = value
        return loss, stats

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_perplexity("val")

    @override
    def on_test_epoch_end(self) -> None:
        self._log_perplexity("test")

    def _log_perplexity(self, stage: str) -> None:
        log_epoch_metrics(self, self.eval_metrics[stage], stage, self.parallel_state, self.model_chunks[-1].post_process)

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, prompt_tokens: Prompts, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
                 greedy: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 stop_token: int | Literal["eod"] | None = "eod", stop_strings: Sequence[str] = (),
                 tokenizer: GenerationTokenizer | None = None, use_cache: bool = True,
                 generator: torch.Generator | None = None,
                 seeds: Sequence[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
        """Each prompt followed by up to ``max_new_tokens`` new tokens, with a KV cache
        (:func:`lightning_megatron.generation.generate`), at any layout: every rank of the model returns the
        same tokens (call it on all of them).

        - ``prompt_tokens`` [b, s0] -> [b, s0 + n] (rows that ended padded with the stop token); with
          ``attention_mask`` [b, s0] the rows are left-padded prompts of different lengths;
        - a list of 1-D prompts (tensors or lists of ids, any lengths) -> a list of 1-D tensors, each its
          prompt and its new tokens up to and including the one that ended it.

        Stopping (:meth:`stop_rule`, the rule ``predict`` applies): ``stop_token="eod"`` (the default) is the
        tokenizer's end-of-document token, from ``tokenizer`` or else from the attached datamodule's tokenizer,
        and refused when neither is there; an id; or None (always ``max_new_tokens``). ``stop_strings`` end a
        sequence when its generated text contains one (the text from the same tokenizer; :meth:`complete`
        gives the texts cut before the stop).

        Checked before any forward: ``max_new_tokens`` an integer >= 0, the sampling settings, and the longest
        prompt plus ``max_new_tokens - 1`` within ``config.max_sequence_length``. Pipeline stages run token by
        token (:func:`~lightning_megatron.generation.pipelined_forward`: each rank its chunks, the last
        stage picks the token); a sequence-parallel model generates without splitting the sequence
        (:func:`~lightning_megatron.transformer.inference.sequence_parallel_off`: the same weights). The
        chunks are in eval mode meanwhile. Sampling draws with ``generator`` (None: torch's default), or with
        ``seeds``, one a prompt: each prompt its own generator, the same tokens in any batch and at any layout
        (``predict`` seeds each prompt from ``predict_seed`` and its index).
        """
        rule = self.stop_rule(stop_token, stop_strings, tokenizer)
        return self._generate(prompt_tokens, max_new_tokens, rule, attention_mask=attention_mask, greedy=greedy,
                              temperature=temperature, top_k=top_k, top_p=top_p, use_cache=use_cache,
                              generator=generator, seeds=seeds)

    def complete(self, prompts: Sequence[str], max_new_tokens: int, *, tokenizer: GenerationTokenizer | None = None,
                 stop_token: int | Literal["eod"] | None = "eod", stop_strings: Sequence[str] = (),
                 **kwargs: Any) -> list[str]:
        """The completion of each text of ``prompts``: tokenized by ``tokenizer`` (else the datamodule's),
        generated as one left-padded batch (:meth:`generate`; ``kwargs``: its sampling settings) and the text of
        the new tokens cut before the stop (:meth:`StopRule.completion
        <lightning_megatron.generation.StopRule.completion>`)."""
        rule = self.stop_rule(stop_token, stop_strings, tokenizer)
        tok = self._tokenizer(tokenizer)
        if tok is None:
            raise ValueError(f"{type(self).__name__}.complete tokenizes the prompts, and no tokenizer is known: no "
                             f"tokenizer= was given and {self._no_tokenizer()}; pass tokenizer=...")
        ids = [tok.tokenize(text) for text in prompts]
        out = self._generate(ids, max_new_tokens, rule, **kwargs)
        return [rule.completion(row[len(p):].tolist()) for row, p in zip(out, ids)]

    def stop_rule(self, stop_token: int | Literal["eod"] | None = "eod", stop_strings: Sequence[str] = (),
                  tokenizer: GenerationTokenizer | None = None) -> StopRule:
        """The :class:`~lightning_megatron.generation.StopRule` of :meth:`generate` (and, from the
        ``predict_*`` settings, of ``predict``): ``stop_token="eod"`` is the end-of-document token (``eod``) of
        ``tokenizer``, else of the attached datamodule's ``tokenizer`` (any datamodule that has one), refused
        when there is neither (pass ``tokenizer=``, an id, or ``stop_token=None``); ``stop_strings`` take
        their text from the same tokenizer's ``detokenize``."""
        tok = self._tokenizer(tokenizer)
        if tok is None and (stop_token == "eod" or stop_strings):
            what = "stops at the tokenizer's end-of-document token by default (stop_token='eod')" if \
                stop_token == "eod" else f"needs the text of the new tokens for stop_strings={list(stop_strings)!r}"
            raise ValueError(f"{type(self).__name__}.generate {what}, and no tokenizer is known: no tokenizer= was "
                             f"given and {self._no_tokenizer()}. Pass tokenizer=<a tokenizer with eod, tokenize and "
                             f"detokenize>" + (", or stop_token=<the id to stop at>, or stop_token=None to always "
                                               "generate max_new_tokens tokens" if stop_token == "eod" else ""))
        others: tuple[int, ...] = ()
        if stop_token == "eod":  # with the tokenizer's other end-of-sequence ids (ChatTokenizer.stop_ids)
            stop_token = int(tok.eod)
            others = tuple(int(t) for t in getattr(tok, "stop_ids", ()) if int(t) != stop_token)
        return StopRule(stop_token, tuple(stop_strings), None if tok is None else tok.detokenize, others)

    def _tokenizer(self, tokenizer: GenerationTokenizer | None) -> GenerationTokenizer | None:
        """``tokenizer`` (checked), else the attached datamodule's ``tokenizer`` when it is one, else None."""
        if tokenizer is not None:
            if not isinstance(tokenizer, GenerationTokenizer):
                raise TypeError(f"tokenizer={type(tokenizer).__name__}: generation needs a tokenizer with eod (the "
                                f"end-of-document id), tokenize(text) and detokenize(ids) "
                                f"(lightning_megatron.generation.GenerationTokenizer)")
            return tokenizer
        dm = self.trainer.datamodule if self._trainer is not None else None
        found = dm.tokenizer if isinstance(dm, TokenizedData) else None
        return found if isinstance(found, GenerationTokenizer) else None

    def _no_tokenizer(self) -> str:
        """Why the datamodule gives no tokenizer, for the errors."""
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is None:
            return "no datamodule is attached"
        return f"the datamodule ({type(dm).__name__}) has no tokenizer with eod, tokenize and detokenize"

    def _generate(self, prompt_tokens: Prompts, max_new_tokens: int, rule: StopRule, *,
                  attention_mask: torch.Tensor | None = None, **settings: Any) -> torch.Tensor | list[torch.Tensor]:
        """:meth:`generate` with its stop rule resolved: every chunk of this rank through
        :func:`~lightning_megatron.generation.pipelined_forward`, eval mode, sequence parallelism off."""
        from lightning_megatron.generation import generate, pipelined_forward

        assert self.model_chunks is not None, "configure_model has not run"
        chunks = list(self.model_chunks)
        device = next(chunks[0].parameters()).device
        if torch.is_tensor(prompt_tokens):
            prompt_tokens = prompt_tokens.to(device)
        else:
            prompt_tokens = [p.to(device) if torch.is_tensor(p) else torch.tensor(list(p), device=device)
                             for p in prompt_tokens]
        if attention_mask is not None:
            attention_mask = attention_mask.to(device)

        def run(chunk: GPTModel, tokens: torch.Tensor, offset: int, cache: Any) -> torch.Tensor:
            return chunk(tokens, position_offset=offset, inference_context=cache)

        ps = self.parallel_state
        forward = pipelined_forward(chunks, ps, self.config.hidden_size, run)
        modes = [chunk.training for chunk in chunks]
        self.model_chunks.eval()
        try:
            with sequence_parallel_off(self.model_chunks):
                return generate(forward, prompt_tokens, max_new_tokens, attention_mask=attention_mask,
                                stop_token=rule.stop_token, stop_strings=rule.stop_strings, detokenize=rule.detokenize,
                                other_stop_tokens=rule.other_stop_tokens,
                                vocab_size=self.vocab_size, max_sequence_length=self.config.max_sequence_length,
                                tp_group=ps.group("tp"), pp_group=ps.group("pp"),
                                step_group=ps.group("ep") if self.config.num_moe_experts else None, **settings)
        finally:
            for chunk, mode in zip(chunks, modes):
                chunk.train(mode)

    def predict_batch(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """``predict`` (the strategy's :class:`~lightning_megatron.protocols.PredictsBatches`): each sample's
        ``tokens`` as the prompt, followed by up to ``predict_max_new_tokens`` generated ones with the
        ``predict_*`` settings, stopped by :meth:`predict_stop_rule`. Every rank runs it, each pipeline stage
        its chunks token by token (:meth:`generate`); every rank returns the same tokens [b, s0 + n]."""
        hp = self.hparams
        seeds = None
        if not hp.predict_greedy:  # each prompt its own draws: from predict_seed and its index, at any layout
            from lightning_megatron.data.predict import SAMPLE_INDEX
            from lightning_megatron.generation import row_seed

            b = batch["tokens"].shape[0]
            index = batch[SAMPLE_INDEX].tolist() if SAMPLE_INDEX in batch else range(batch_idx * b, batch_idx * b + b)
            seeds = [row_seed(hp.predict_seed, i) for i in index]
        return self._generate(batch["tokens"], hp.predict_max_new_tokens, self.predict_stop_rule(),
                              greedy=hp.predict_greedy, temperature=hp.predict_temperature, top_k=hp.predict_top_k,
                              top_p=hp.predict_top_p, seeds=seeds)

    @override
    def predict_forward(self, batch: dict[str, torch.Tensor], chunk: GPTModel) -> torch.Tensor:
        """:meth:`predict_batch` (``predict_step`` without the MegatronStrategy: ``chunk`` is the whole model)."""
        return self.predict_batch(batch, 0)

    def predict_stop_rule(self) -> StopRule:
        """What ``predict`` stops at, and where the PredictionWriter cuts what it writes: the datamodule
        tokenizer's end-of-document token with ``predict_stop_at_eod``, and ``predict_stop_strings``
        (:meth:`stop_rule`); refused, naming the setting, when the datamodule has no tokenizer for them."""
        hp = self.hparams
        stop_at_eod, strings = hp.get("predict_stop_at_eod", True), tuple(hp.get("predict_stop_strings") or ())
        try:
            return self.stop_rule("eod" if stop_at_eod else None, strings)
        except ValueError:
            setting = "predict_stop_at_eod=True" if stop_at_eod else f"predict_stop_strings={list(strings)!r}"
            fix = "set predict_stop_at_eod=False" if stop_at_eod else "drop predict_stop_strings"
            raise ValueError(f"{type(self).__name__}({setting}) needs the datamodule's tokenizer (its end-of-document "
                             f"token and text), and {self._no_tokenizer()}: predict through a datamodule with a "
                             f"tokenizer (GPTDataModule), or {fix}") from None

    # ------------------------------------------------------------------ cost

    def training_flops(self, batch: dict[str, torch.Tensor], data_parallel_size: int) -> float:
        """FLOPs of a training step (``CountsFlops``): the executed model FLOPs ``check --estimate-time`` counts
        (:func:`lightning_megatron.cost.flops.model_flops` of this module's cost record at the step's tokens):
        Megatron's decoder count with the output layer on every token, a mixture of experts at the width a token
        passes through, and under LoRA without the frozen weights' weight gradients (the adapters' counted)."""
        from lightning_megatron.cost.flops import model_flops

        tokens = batch["tokens"]
        seq = tokens.size(-1)
        samples = tokens.numel() // seq * data_parallel_size
        records = self.__dict__.setdefault("_flops_records", {})  # one record per step shape (built once)
        if (samples, seq) not in records:
            records[(samples, seq)] = self.estimate_shape(
                {"config": self.config, "lora": self.lora}, {"vocab_size": self.vocab_size, "seq_length": seq},
                micro_batch_size=samples, global_batch_size=samples)
        return model_flops(records[(samples, seq)])

    @classmethod
    def estimate_shape(cls, model: Mapping[str, Any], data: Mapping[str, Any], *, micro_batch_size: int,
                       global_batch_size: int) -> Any:
        """The decoder's costs for ``check --estimate-memory`` / ``--estimate-time`` (``EstimatesCost``):
        a :class:`~lightning_megatron.models.gpt.cost.GPTCost` from this module's arguments (its
        ``config``, whose ``vocab_size`` must be set) and the data's ``seq_length``; unset ones at their defaults."""
        from lightning_megatron.models.gpt.cost import GPTCost

        config = cls.config_class.coerce(model.get("config"))
        vocab = config.vocab_size if config.vocab_size is not None else data.get("vocab_size")
        if vocab is None:
            raise ValueError("GPTLightningModule.estimate_shape: set model.config.vocab_size (the estimate builds no "
                             "tokenizer)")
        from lightning_megatron.transformer.lora import LoRAConfig

        lora = LoRAConfig.coerce(model.get("lora"))
        adapters = (dict(lora_rank=lora.rank, lora_targets=tuple(lora.target_modules), lora_dropout=lora.dropout)
                    if lora is not None else {})
        return GPTCost.from_config(
            config, vocab_size=int(vocab), seq_length=int(data.get("seq_length", config.max_sequence_length)),
            micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
            optimizer=str(model.get("optimizer", "adamw")), compiled_loss=bool(model.get("compile", False)),
            **adapters)
