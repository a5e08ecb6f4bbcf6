"""GPTLightningModule: causal language modelling (GPT-2 and Llama shapes) for the MegatronStrategy.

A :class:`~lightning_megatron.module.MegatronLightningModule` (the model-agnostic base: the
strategy's ``parallel_state``, building the chunks once, steps without the strategy, the optimizer
on parameter groups). What is the decoder's own:

- ``build_chunks``: one :class:`GPTModel` chunk per virtual pipeline stage, each with its global layer range;
- ``forward_step(microbatch, chunk) -> (output, loss_func)``: the last chunk computes the
  vocab-parallel cross entropy of the next tokens (``labels``) averaged over ``loss_mask``;
- ``pipeline_tensor_shape``: [s, b, h] ([s/t, b, h] under sequence parallelism);
- ``sharded_named_parameters``: megatron-core names with global layer numbers (reshardable checkpoints);
- ``training_flops`` (``CountsFlops``): the decoder's count, grouped-query and gated MLP included;
- ``estimate_shape`` (``EstimatesCost``): the sizes ``check --estimate-memory / --estimate-time`` use;
- validation / test ``perplexity`` (torchmetrics, over the data-parallel group: the whole split's
  exp(mean token cross entropy), equal at every layout).

The batch (Megatron's GPT dataset): ``tokens`` [b, s] int64, ``labels`` [b, s] int64 (the tokens
shifted by one), ``loss_mask`` [b, s] float; optional ``position_ids`` [b, s] (default arange).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torchmetrics import MetricCollection
from typing_extensions import override

from lightning_megatron.metrics import Perplexity, eval_stage, log_epoch_metrics, on_device, sync_args
from lightning_megatron.models.gpt.hf import GPT_ARCHITECTURE_KEYS
from lightning_megatron.models.gpt.interop import GPTInterop
from lightning_megatron.models.gpt.model import GPTModel, gpt_loss
from lightning_megatron.module import MegatronLightningModule
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.pipeline.layout import stage_chunks
from lightning_megatron.tensor_parallel import set_param_facts
from lightning_megatron.flops import transformer_flops
from lightning_megatron.transformer.config import TransformerConfig

__all__ = ["GPTLightningModule"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
_SPEC_NORM = {"gpt_layer_spec": "LayerNorm", "llama_layer_spec": "RMSNorm"}


class GPTLightningModule(MegatronLightningModule):
    """A causal decoder LM (megatron-core's GPTModel), any TP x SP x PP x VP x DP x ZeRO-1 layout.

    Args:
        num_layers, hidden_size, num_attention_heads, ffn_hidden_size, kv_channels, ...: the TransformerConfig.
        num_query_groups: key/value heads of grouped-query attention (None: one per query head); it
            must divide num_attention_heads, and the TP size must divide it (megatron-core's rule).
        vocab_size: None reads ``trainer.datamodule.vocab_size``.
        max_sequence_length: rows of the learned position embedding (the longest sequence).
        spec: a registered layer spec name: ``gpt_layer_spec`` (LayerNorm) or ``llama_layer_spec`` (RMSNorm).
        position_embedding_type: ``learned_absolute`` (GPT-2), ``rope`` (Llama) or ``none``.
        normalization: ``config.normalization``, the norm of specs that take it from the config
            (``transformer.Norm``); None: the spec's own (LayerNorm for ``gpt_layer_spec``, RMSNorm for
            ``llama_layer_spec``, which refuse the other).
        activation: the MLP activation (GPT-2: ``gelu_tanh``; Megatron GPT: ``gelu``; Llama: ``silu``).
        gated_linear_unit: a gated MLP, ``act(x W_gate) * (x W_up)`` (with ``silu``: Llama's SwiGLU).
        rotary_base, rotary_percent: rope's base (Llama 2: 10000, Llama 3: 500000) and the fraction of
            each head's channels it rotates (``position_embedding_type="rope"``).
        add_bias_linear: biases in attention and MLP (GPT-2: yes; Llama: no).
        untie_embeddings_and_output_weights: the output layer has its own weight (Llama) instead of the
            word embedding's (GPT-2).
        params_dtype: "float32", "bfloat16" or "float16" (16-bit pairs with the MegatronOptimizerCallback).
        optimizer, lr, weight_decay, adam_*, sgd_momentum, fused_optimizer, optimizer_class, ...: as
            :class:`~lightning_megatron.models.bert.module.BertLightningModule`.
        compile: ``torch.compile`` each transformer layer (regional compilation).
        init_from: start from pretrained weights, any layout: a lightning_megatron checkpoint, a Hugging
            Face ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` folder or a Megatron-LM GPT checkpoint (the
            architecture: :meth:`from_pretrained`, ``--model.init_from``; docs/interop.md).
        predict_max_new_tokens, predict_greedy, predict_temperature, predict_top_k, predict_top_p: what
            ``predict`` generates after each sample's ``tokens`` (:meth:`generate`): the prompt followed by
            the new tokens, greedy or sampled (Hugging Face's temperature / top-k / top-p).
        predict_stop_at_eod: ``predict`` ends a sequence at the datamodule tokenizer's end-of-document
            token (as Hugging Face's ``generate`` stops at ``eos_token_id``): generation stops when every
            sequence of the batch has ended, and the written completion ends before it. ``False``: always
            ``predict_max_new_tokens`` tokens, EOD included as any other token.
    """

    def __init__(
        self,
        *,
        num_layers: int = 2,
        hidden_size: int = 128,
        num_attention_heads: int = 4,
        num_query_groups: int | None = None,
        ffn_hidden_size: int | None = None,
        kv_channels: int | None = None,
        vocab_size: int | None = None,
        max_sequence_length: int = 128,
        spec: str = "gpt_layer_spec",
        position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute",
        normalization: Literal["LayerNorm", "RMSNorm"] | None = None,
        activation: Literal["gelu", "gelu_tanh", "relu", "silu"] = "gelu",
        add_bias_linear: bool = True,
        gated_linear_unit: bool = False,
        untie_embeddings_and_output_weights: bool = False,
        rotary_base: float = 10000.0,
        rotary_percent: float = 1.0,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method_std: float = 0.02,
        params_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        make_vocab_size_divisible_by: int = 128,
        recompute_granularity: Literal["full", "selective"] | None = None,
        recompute_method: Literal["uniform", "block"] | None = None,
        recompute_num_layers: int | None = None,
        num_layers_in_first_pipeline_stage: int | None = None,
        num_layers_in_last_pipeline_stage: int | None = None,
        defer_embedding_wgrad_compute: bool = False,
        attention_backend: Literal["auto", "sdpa", "unfused"] = "auto",
        init_seed: int = 1234,
        optimizer: Literal["adamw", "adam", "sgd"] = "adamw",
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.95,
        adam_eps: float = 1e-8,
        sgd_momentum: float = 0.9,
        fused_optimizer: bool = True,
        compile: bool = False,
        predict_max_new_tokens: int = 32,
        predict_greedy: bool = True,
        predict_temperature: float = 1.0,
        predict_top_k: int = 0,
        predict_top_p: float = 1.0,
        predict_stop_at_eod: bool = True,
        optimizer_class: str | None = None,
        optimizer_kwargs: dict[str, Any] | None = None,
        lr_scheduler_class: str | None = None,
        lr_scheduler_kwargs: dict[str, Any] | None = None,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        if params_dtype not in _DTYPES:
            raise ValueError(f"params_dtype={params_dtype!r} must be one of {sorted(_DTYPES)}")
        if optimizer not in ("adamw", "adam", "sgd"):
            raise ValueError(f"optimizer={optimizer!r} must be 'adamw', 'adam' or 'sgd'")
        if spec not in _SPEC_NORM:
            import lightning_megatron.models.gpt.specs  # noqa: F401  (a user's spec registered by name)
            from lightning_megatron.transformer import get_spec

            get_spec(spec)  # ValueError listing the registered names
        elif normalization not in (None, _SPEC_NORM[spec]):
            raise ValueError(f"normalization={normalization!r} but spec={spec!r} uses {_SPEC_NORM[spec]}: drop "
                             f"normalization, or use the other spec")
        self.save_hyperparameters()
        self.init_seed = init_seed
        self.use_optimizer(optimizer_class, optimizer_kwargs)
        self.use_lr_scheduler(lr_scheduler_class, lr_scheduler_kwargs)
        self._config_kwargs = dict(
            num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
            num_query_groups=num_query_groups, ffn_hidden_size=ffn_hidden_size, kv_channels=kv_channels,
            gated_linear_unit=gated_linear_unit, rotary_base=rotary_base, rotary_percent=rotary_percent, hidden_dropout=hidden_dropout,
            attention_dropout=attention_dropout, layernorm_epsilon=layernorm_epsilon,
            normalization=normalization or _SPEC_NORM.get(spec, "LayerNorm"), activation=activation,
            add_bias_linear=add_bias_linear,
            init_method_std=init_method_std, params_dtype=_DTYPES[params_dtype],
            recompute_granularity=recompute_granularity, recompute_method=recompute_method,
            recompute_num_layers=recompute_num_layers,
            num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage, attention_backend=attention_backend,
            defer_embedding_wgrad_compute=defer_embedding_wgrad_compute)
        # Validate sizes now (heads, ffn...) with TP=1; TP-dependent checks run in configure_model.
        TransformerConfig(**self._config_kwargs)

    # ------------------------------------------------------------------ model

    def build_chunks(self, ps: ParallelState) -> list[GPTModel]:
        hp = self.hparams
        config = TransformerConfig(**self._config_kwargs, tensor_model_parallel_size=ps.tp_size,
                                   sequence_parallel=self.sequence_parallel)
        self.config = config
        self.vocab_size = self.resolved_vocab_size()
        chunks = []
        for place in stage_chunks(config.num_layers, ps.pp_size, ps.pp_rank, ps.vp_size,
                                  num_layers_in_first_pipeline_stage=config.num_layers_in_first_pipeline_stage,
                                  num_layers_in_last_pipeline_stage=config.num_layers_in_last_pipeline_stage):
            chunk = GPTModel(
                config, hp.spec, self.vocab_size, hp.max_sequence_length, tp_group=ps.group("tp"),
                position_embedding_type=hp.position_embedding_type,
                share_embeddings_and_output_weights=not hp.untie_embeddings_and_output_weights,
                pre_process=place.pre_process, post_process=place.post_process, layer_range=place.layers,
                make_vocab_size_divisible_by=hp.make_vocab_size_divisible_by,
                seed=hp.init_seed)
            _tag_vocab_parallel(chunk, self.vocab_size)
            if hp.compile:
                chunk.compile_layers()
            chunks.append(chunk)
        return chunks

    @override
    def on_chunks_built(self) -> None:
        # val/test perplexity of the whole split, gathered over DP (a plain dict: outside the state dict)
        kw = sync_args(self.parallel_state)
        self.eval_metrics = {stage: MetricCollection({"perplexity": Perplexity(**kw)}) for stage in ("val", "test")}

    # ------------------------------------------------------------------ weights from elsewhere

    interop = GPTInterop()  # Hugging Face Llama / GPT-2 folders, Megatron-LM GPT checkpoints, export hf
    architecture_keys = GPT_ARCHITECTURE_KEYS

    def sharded_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """megatron-core names with global layer numbers (no chunk index)."""
        assert self.model_chunks is not None, "configure_model has not run"
        for chunk in self.model_chunks:
            start = chunk.decoder.layer_range.start
            for name, p in chunk.named_parameters():
                m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
                yield (f"decoder.layers.{start + int(m.group(1))}.{m.group(2)}" if m else name), p

    def pipeline_tensor_shape(self, microbatch: dict[str, torch.Tensor]) -> tuple[int, int, int]:
        """[s, b, h] exchanged between stages ([s/t, b, h] under sequence parallelism)."""
        b, s = microbatch["tokens"].shape
        if self.config.sequence_parallel:
            s //= self.config.tensor_model_parallel_size
        return (s, b, self.config.hidden_size)

    # ------------------------------------------------------------------ steps

    def forward_step(self, batch: dict[str, torch.Tensor], chunk: GPTModel):
        """Megatron's forward step: run ``chunk``; on the last chunk return the loss function too.
        While predicting: the generated tokens (:meth:`generate`), logged as ``predictions``."""
        if self._trainer is not None and self.trainer.predicting:
            out = self.predict_step(batch, 0)

            def predictions(output: torch.Tensor):
                return torch.zeros((), device=output.device), {"predictions": output}

            return out, predictions
        labels = batch["labels"] if chunk.post_process else None
        out = chunk(batch["tokens"], batch.get("position_ids"), labels=labels)
        if not chunk.post_process:
            return out, None
        loss_mask = batch["loss_mask"]
        loss = gpt_loss(out, loss_mask)
        with torch.no_grad():
            num_tokens = loss_mask.float().sum()
            stage = eval_stage(self)
            if stage:  # the whole split's perplexity, logged at the end of the epoch
                on_device(self.eval_metrics[stage], loss.device)["perplexity"].update(loss.detach(), num_tokens)
            stats = {"lm_loss": loss.detach(), "num_tokens": num_tokens}

        def loss_func(output: torch.Tensor):
            return output, {"loss": output.detach(), **stats}

        return loss, loss_func

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
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Each sample's ``tokens`` as the prompt, followed by ``predict_max_new_tokens`` generated ones."""
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
        a :class:`~lightning_megatron.models.gpt.cost.DecoderShape` from this module's arguments
        (``vocab_size`` must be set) and the data's ``seq_length``; unset ones at their defaults."""
        from lightning_megatron.models.gpt.cost import DecoderShape

        vocab = model.get("vocab_size", data.get("vocab_size"))
        if vocab is None:
            raise ValueError("GPTLightningModule.estimate_shape: set model.vocab_size (the estimate builds no "
                             "tokenizer)")
        spec = str(model.get("spec", "gpt_layer_spec"))
        return DecoderShape(
            num_layers=int(model.get("num_layers", 2)), hidden_size=int(model.get("hidden_size", 128)),
            num_attention_heads=int(model.get("num_attention_heads", 4)), ffn_hidden_size=model.get("ffn_hidden_size"),
            num_query_groups=model.get("num_query_groups"), kv_channels=model.get("kv_channels"),
            gated_linear_unit=bool(model.get("gated_linear_unit", False)),
            add_bias_linear=bool(model.get("add_bias_linear", True)),
            untie_embeddings_and_output_weights=bool(model.get("untie_embeddings_and_output_weights", False)),
            learned_positions=model.get("position_embedding_type", "learned_absolute") == "learned_absolute",
            vocab_size=int(vocab), make_vocab_size_divisible_by=int(model.get("make_vocab_size_divisible_by", 128)),
            max_sequence_length=int(model.get("max_sequence_length", 128)),
            seq_length=int(data.get("seq_length", model.get("max_sequence_length", 128))),
            micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
            params_dtype=str(model.get("params_dtype", "float32")), optimizer=str(model.get("optimizer", "adamw")),
            rmsnorm=(model.get("normalization") or _SPEC_NORM.get(spec)) == "RMSNorm",
            recompute=model.get("recompute_granularity") == "full",
            attention_backend=str(model.get("attention_backend", "auto")),
            hidden_dropout=float(model.get("hidden_dropout", 0.1)),
            attention_dropout=float(model.get("attention_dropout", 0.1)))

    # ------------------------------------------------------------------ optimizer

    @override
    def optimizer_defaults(self) -> dict[str, float]:
        return {"lr": self.hparams.lr, "weight_decay": self.hparams.weight_decay}

    @override
    def default_optimizer(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """``optimizer``: "adamw", "adam" or "sgd" with the module's lr, weight decay, betas, eps, momentum."""
        hp = self.hparams
        if hp.optimizer == "sgd":
            return torch.optim.SGD(param_groups, lr=hp.lr, momentum=hp.sgd_momentum, weight_decay=hp.weight_decay)
        cls = torch.optim.AdamW if hp.optimizer == "adamw" else torch.optim.Adam
        return cls(param_groups, lr=hp.lr, betas=(hp.adam_beta1, hp.adam_beta2), eps=hp.adam_eps,
                   weight_decay=hp.weight_decay, fused=hp.fused_optimizer or None)


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


def _tag_vocab_parallel(chunk: GPTModel, vocab_size: int) -> None:
    """Mark the vocab-padded tensors so checkpoints store only the real rows (padding depends on TP)."""
    tensors = []
    if chunk.pre_process:
        tensors.append(chunk.embedding.word_embeddings.weight)
    if chunk.post_process and chunk.output_layer.weight is not None:
        tensors.append(chunk.output_layer.weight)
    for t in tensors:
        set_param_facts(t, real_vocab_size=vocab_size)
