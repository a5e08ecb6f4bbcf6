"""GPTLightningModule: causal language modelling (GPT-2 and Llama shapes) for the MegatronStrategy.

A :class:`~lightning_megatron.language.module.LanguageLightningModule` (the language-model half every
family shares: the record in the hyper-parameters, chunks per virtual stage, megatron-core names with
global layer numbers, the [s, b, h] pipeline tensor, the default optimizer; on the model-agnostic
:class:`~lightning_megatron.module.MegatronLightningModule`). What is the decoder's own:

- ``config_class``: :class:`~lightning_megatron.models.gpt.config.GPTConfig`;
- ``build_chunk``: one :class:`GPTModel` per virtual pipeline stage;
- ``loss_forward``: the last chunk computes the vocab-parallel cross entropy of the next tokens
  (``labels``) averaged over ``loss_mask``;
- ``predict_forward`` / :meth:`GPTLightningModule.generate`: continuations with a KV cache;
- ``training_flops`` (``CountsFlops``): the decoder's count, grouped-query and gated MLP included;
- ``estimate_shape`` (``EstimatesCost``): the sizes ``check --estimate-memory / --estimate-time`` use;
- validation / test ``perplexity`` (torchmetrics, over the data-parallel group: the whole split's
  exp(mean token cross entropy), equal at every layout).

The batch (Megatron's GPT dataset): ``tokens`` [b, s] int64, ``labels`` [b, s] int64 (the tokens
shifted by one), ``loss_mask`` [b, s] float; optional ``position_ids`` [b, s] (default arange) and
``document_ids`` [b, s] (packed samples: attention within a document only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torchmetrics import MetricCollection
from typing_extensions import override

from lightning_megatron.flops import transformer_flops
from lightning_megatron.language.module import LanguageLightningModule
from lightning_megatron.metrics import Perplexity, eval_stage, log_epoch_metrics, on_device, sync_args
from lightning_megatron.models.gpt.config import GPTConfig
from lightning_megatron.models.gpt.hf import GPT_ARCHITECTURE_KEYS
from lightning_megatron.models.gpt.interop import GPTInterop
from lightning_megatron.models.gpt.model import GPTModel, gpt_loss
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.transformer.moe import ExpertGroups
from lightning_megatron.pipeline.layout import ChunkLayout
from lightning_megatron.tensor_parallel.mappings import all_reduce
from lightning_megatron.transformer.config import TransformerConfig
from lightning_megatron.transformer.context_parallel import split_batch

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
        predict_stop_at_eod: ``predict`` ends a sequence at the datamodule tokenizer's end-of-document
            token (as Hugging Face's ``generate`` stops at ``eos_token_id``): generation stops when every
            sequence of the batch has ended, and the written completion ends before it. ``False``: always
            ``predict_max_new_tokens`` tokens, EOD included as any other token.
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
        predict_stop_at_eod: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, lr=lr, weight_decay=weight_decay, adam_beta2=adam_beta2, **kwargs)

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
        self.eval_metrics = {stage: MetricCollection({"perplexity": Perplexity(**kw)}) for stage in ("val", "test")}

    # ------------------------------------------------------------------ weights from elsewhere

    interop = GPTInterop()  # Hugging Face Llama / GPT-2 folders, Megatron-LM GPT checkpoints, export hf
    supports_context_parallel = True  # loss_forward splits the batch; attention gathers keys and values
    architecture_keys = GPT_ARCHITECTURE_KEYS


    # ------------------------------------------------------------------ steps

    @override
    def loss_forward(self, batch: dict[str, torch.Tensor], chunk: GPTModel):
        """The next-token loss of the batch on the last chunk (averaged over ``loss_mask``, with the number of
        counted tokens to log; at validation / test the whole split's perplexity is updated); the hidden
        states elsewhere."""
        ps = self.parallel_state
        context = None
        if ps is not None and ps.cp_size > 1:  # this rank's part of every sequence, attention over the CP group
            batch, context = split_batch(batch, ps.cp_group, ps.cp_rank)
        labels = batch["labels"] if chunk.post_process else None
        out = chunk(batch["tokens"], batch.get("position_ids"), labels=labels, document_ids=batch.get("document_ids"),
                    context_parallel=context)
        if not chunk.post_process:
            return out
        loss_mask = batch["loss_mask"]
        if context is None:
            loss = gpt_loss(out, loss_mask)
            value, num_tokens = loss.detach(), loss_mask.float().sum()
        else:
            # The sequence's loss is its ranks' summed losses over its counted tokens: this rank's part,
            # times cp because the gradients are averaged over the data- and context-parallel ranks.
            mask = loss_mask.float()
            local = (out.float() * mask).sum()
            totals = torch.stack([local.detach(), mask.sum()])
            all_reduce(totals, ps.cp_group)
            value, num_tokens = totals[0] / totals[1].clamp(min=1.0), totals[1]
            loss = local * ps.cp_size / totals[1].clamp(min=1.0)
        with torch.no_grad():
            stage = eval_stage(self)
            if stage:  # the whole split's perplexity, logged at the end of the epoch
                on_device(self.eval_metrics[stage], loss.device)["perplexity"].update(value, num_tokens)
            stats = {"lm_loss": value, "num_tokens": num_tokens}
            if context is not None:
                stats["loss"] = value  # logged: the whole sequence's, not this rank's objective
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
    def generate(self, prompt_tokens: torch.Tensor, max_new_tokens: int, *, greedy: bool = True,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop_token: int | None = None,
                 use_cache: bool = True, generator: torch.Generator | None = None) -> torch.Tensor:
        """``prompt_tokens`` [b, s0] followed by up to ``max_new_tokens`` tokens [b, s0 + n], with a KV cache
        (:func:`lightning_megatron.generation.generate`); under TP every rank returns the same tokens.
        The whole model must be on this rank (``pipeline_model_parallel_size=1``), in eval mode meanwhile."""
        from lightning_megatron.generation import generate

        assert self.model_chunks is not None, "configure_model has not run"
        chunk = self.model_chunks[0]
        if len(self.model_chunks) != 1 or not (chunk.pre_process and chunk.post_process):
            raise ValueError("generate needs the whole model on this rank: pipeline_model_parallel_size=1 (the "
                             "decoder's pipeline stages are not chained token by token)")
        if chunk.config.sequence_parallel:
            raise ValueError("generate with sequence_parallel=True is not supported (one new token per step "
                             "cannot be split along the sequence); generate without sequence parallelism")

        def forward(tokens: torch.Tensor, offset: int, cache: Any) -> torch.Tensor:
            return chunk(tokens, position_offset=offset, inference_context=cache)

        was_training = chunk.training
        chunk.eval()
        try:
            return generate(forward, prompt_tokens, max_new_tokens, greedy=greedy, temperature=temperature,
                            top_k=top_k, top_p=top_p, use_cache=use_cache, stop_token=stop_token,
                            vocab_size=self.vocab_size, tp_group=self.parallel_state.group("tp"), generator=generator)
        finally:
            chunk.train(was_training)

    @override
    def predict_forward(self, batch: dict[str, torch.Tensor], chunk: GPTModel) -> torch.Tensor:
        """Each sample's ``tokens`` as the prompt, followed by ``predict_max_new_tokens`` generated ones (the
        whole model generates: ``chunk`` is the only one, :meth:`generate`)."""
        hp = self.hparams
        return self.generate(batch["tokens"], hp.predict_max_new_tokens, greedy=hp.predict_greedy,
                             temperature=hp.predict_temperature, top_k=hp.predict_top_k, top_p=hp.predict_top_p,
                             stop_token=self.predict_stop_token())

    def predict_stop_token(self) -> int | None:
        """The token ``predict`` stops at: the datamodule tokenizer's ``eod`` with ``predict_stop_at_eod``
        (refused when there is no tokenizer to take it from), else None."""
        if not self.hparams.get("predict_stop_at_eod", True):
            return None
        from lightning_megatron.datamodules.pretraining import PretrainingDataModule  # the data side, at predict time

        dm = self.trainer.datamodule if self._trainer is not None else None
        if not isinstance(dm, PretrainingDataModule):
            raise ValueError(f"{type(self).__name__}(predict_stop_at_eod=True) stops at the datamodule tokenizer's "
                             f"end-of-document token, and this predict has no PretrainingDataModule "
                             f"(got {type(dm).__name__}) to take it from: predict through a GPTDataModule, or set "
                             f"predict_stop_at_eod=False")
        return int(dm.tokenizer.eod)

    # ------------------------------------------------------------------ cost

    def training_flops(self, batch: dict[str, torch.Tensor], data_parallel_size: int) -> float:
        """FLOPs of a training step (``CountsFlops``): :func:`decoder_flops` on every token."""
        tokens = batch["tokens"]
        return decoder_flops(self.config, tokens.numel() * data_parallel_size, tokens.size(-1), self.vocab_size)

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
        return GPTCost.from_config(
            config, vocab_size=int(vocab), seq_length=int(data.get("seq_length", config.max_sequence_length)),
            micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
            optimizer=str(model.get("optimizer", "adamw")))


def decoder_flops(config: TransformerConfig, tokens: int, seq_length: int, vocab_size: int) -> float:
    """Megatron's count of a decoder training step (:func:`~lightning_megatron.flops.transformer_flops`):
    the output layer on every token, no head dense layer; model FLOPs (recomputation not counted)."""
    d = config.kv_channels
    return transformer_flops(num_layers=config.num_layers, hidden_size=config.hidden_size,
                             ffn_hidden_size=config.ffn_hidden_size, seq_length=seq_length, tokens=tokens,
                             head_tokens=tokens, vocab_size=vocab_size, head_dense=False,
                             query_projection_size=config.num_attention_heads * d,
                             kv_projection_size=config.num_query_groups * d,
                             gated_linear_unit=config.gated_linear_unit)
