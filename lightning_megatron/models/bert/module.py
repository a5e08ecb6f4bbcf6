"""BertLightningModule: BERT pretraining as a LightningModule for the MegatronStrategy.

A :class:`~lightning_megatron.module.MegatronLightningModule` (the model-agnostic base: the
strategy's ``parallel_state``, building the chunks once, steps without the strategy, the optimizer
on parameter groups). What is BERT's own:

- ``build_chunks``: one :class:`BertModel` chunk per virtual pipeline stage, each with its global layer range;
- ``forward_step(microbatch, chunk) -> (output, loss_func)``: Megatron's forward-step function;
  the last chunk computes the masked-LM + binary loss and its logged statistics;
- ``pipeline_tensor_shape(microbatch)``: the [s, b, h] activation exchanged between stages;
- ``sharded_named_parameters()``: parameters under global, layout-independent names (global layer
  numbers), which is what makes checkpoints reshardable across TP, PP and VP.

It also works without the MegatronStrategy (plain single-device Lightning): then one chunk is built
and ``training_step`` computes the loss of the whole batch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import override

from lightning_megatron.datamodules.pretraining import NO_PADDING  # set on the host: skip the mask, no sync
from lightning_megatron.models.bert.interop import ARCHITECTURE_KEYS, MISSING_TENSORS_HINT, BertInterop
from lightning_megatron.models.bert.metrics import eval_stage as _eval_stage
from lightning_megatron.models.bert.metrics import log_epoch_metrics, on_device, pretraining_metrics
from lightning_megatron.models.bert.model import BertModel, bert_loss
from lightning_megatron.models.bert.predict import vocab_parallel_argmax
from lightning_megatron.module import MegatronLightningModule
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.pipeline.layout import stage_chunks
from lightning_megatron.tensor_parallel import set_param_facts, vocab_parallel_cross_entropy
from lightning_megatron.transformer.config import TransformerConfig, training_flops


__all__ = ["BertLightningModule", "vocab_parallel_argmax"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class BertLightningModule(MegatronLightningModule):
    """BERT masked-LM + sentence-order pretraining (Megatron's BERT), any TP x PP x VP x DP layout.

    Args:
        num_layers, hidden_size, num_attention_heads, ffn_hidden_size, ...: the TransformerConfig.
        vocab_size: None reads ``trainer.datamodule.vocab_size``.
        spec: a registered layer spec name (``bert_layer_local_spec`` pre-norm as Megatron,
            ``bert_layer_post_norm_spec`` as Hugging Face, ``bert_layer_rmsnorm_spec``).
        params_dtype: "float32", "bfloat16" or "float16" (bf16/fp16 pair with the
            MegatronOptimizerCallback, which keeps fp32 main params).
        optimizer: "adamw", "adam" or "sgd"; lr/weight_decay/betas/eps/momentum as in torch.
            The learning rate is usually driven by the OptimizerParamSchedulerCallback.
        lm_head_on_masked_only: run the LM head (dense, norm, [h, V] output layer) only on the
            masked tokens, the only ones in the loss: same loss and gradients, ~6x less head work.
            Under sequence parallelism the sequence is all-gathered before the head.
        init_seed: seed of the layout-independent weight initialization.
        fused_optimizer: torch's fused Adam/AdamW kernel (CPU and CUDA): one pass over all
            parameters instead of a loop (docs/benchmarks.md, "Figures behind the code").
        compile: ``torch.compile`` each transformer layer (regional compilation: one compiled
            region per layer, reused by every layer of the same shapes); equal to eager within fp32
            tolerance (tests/test_compile.py). The first steps pay the compilation.
        activation: the MLP activation ("gelu" exact, "gelu_tanh", "relu", "silu").
        lm_head_activation: the LM head's activation; None: ``activation``. Megatron-LM models trained
            with ``--bias-gelu-fusion`` need ``activation=gelu_tanh lm_head_activation=gelu``.
        init_from: start from pretrained weights (any layout): a lightning_megatron checkpoint
            directory, a Hugging Face BERT / MegatronBERT folder, or a Megatron-LM checkpoint
            (legacy ``model_optim_rng.pt`` or ``torch_dist``); see docs/interop.md. Ignored when a
            checkpoint is resumed (``ckpt_path``), which restores its own weights.
        optimizer_class: any ``torch.optim`` optimizer by name (``torch.optim.SGD``, ``NAdam``...),
            replacing ``optimizer``; built on the same parameter groups (no weight decay on biases
            and norms) with ``lr``, ``weight_decay`` and ``optimizer_kwargs`` (``{"momentum": 0.9,
            "nesterov": True}``). The Megatron callbacks (fp32 main params, clipping, the lr schedule)
            wrap it like the built-in ones. The CLI sets both from ``--optimizer torch.optim.SGD
            --optimizer.momentum 0.9`` (docs/recipes.md).
        lr_scheduler_class, lr_scheduler_kwargs: a ``torch.optim.lr_scheduler`` scheduler by name and
            its arguments, stepped every optimizer step (CLI: ``--lr_scheduler ...``); not together
            with the OptimizerParamSchedulerCallback, which also sets the lr.
        predict_output: what ``predict_step`` returns per sample: ``"masked_lm"`` (the
            ``predict_top_k`` most likely tokens at every position and their probabilities,
            ``{"ids": [b, s, k], "probs": [b, s, k]}``), ``"pooled"`` (the pooler output, ``[b, h]``)
            or ``"hidden"`` (the encoder output, ``[b, s, h]``). ``lightning-megatron predict``
            writes them to files (:class:`~lightning_megatron.callbacks.PredictionWriter`).

    Training, validation and test run ``forward_step`` through the strategy's microbatch schedule;
    a ``training_step`` override is NOT called under the MegatronStrategy (override
    ``forward_step`` instead), and the strategy warns when it finds one.
    """

    def __init__(
        self,
        *,
        num_layers: int = 2,
        hidden_size: int = 128,
        num_attention_heads: int = 4,
        ffn_hidden_size: int | None = None,
        vocab_size: int | None = None,
        max_sequence_length: int = 128,
        spec: str = "bert_layer_local_spec",
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-12,
        init_method_std: float = 0.02,
        params_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        add_binary_head: bool = True,
        make_vocab_size_divisible_by: int = 128,
        recompute_granularity: Literal["full", "selective"] | None = None,
        recompute_method: Literal["uniform", "block"] | None = None,
        recompute_num_layers: int | None = None,
        num_layers_in_first_pipeline_stage: int | None = None,
        num_layers_in_last_pipeline_stage: int | None = None,
        defer_embedding_wgrad_compute: bool = False,
        attention_backend: Literal["auto", "sdpa", "unfused"] = "auto",
        lm_head_on_masked_only: bool = True,
        init_seed: int = 1234,
        optimizer: Literal["adamw", "adam", "sgd"] = "adamw",
        lr: float = 1e-4,
        weight_decay: float = 0.01,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_eps: float = 1e-8,
        sgd_momentum: float = 0.9,
        fused_optimizer: bool = True,
        compile: bool = False,
        activation: Literal["gelu", "gelu_tanh", "relu", "silu"] = "gelu",
        lm_head_activation: Literal["gelu", "gelu_tanh", "relu", "silu"] | None = None,
        init_from: str | None = None,
        predict_output: Literal["masked_lm", "pooled", "hidden"] = "masked_lm",
        predict_top_k: int = 5,
        optimizer_class: str | None = None,
        optimizer_kwargs: dict[str, Any] | None = None,
        lr_scheduler_class: str | None = None,
        lr_scheduler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if params_dtype not in _DTYPES:
            raise ValueError(f"params_dtype={params_dtype!r} must be one of {sorted(_DTYPES)}")
        if optimizer not in ("adamw", "adam", "sgd"):
            raise ValueError(f"optimizer={optimizer!r} must be 'adamw', 'adam' or 'sgd'")
        if predict_output not in ("masked_lm", "pooled", "hidden"):
            raise ValueError(f"predict_output={predict_output!r} must be 'masked_lm', 'pooled' or 'hidden'")
        if predict_top_k < 1:
            raise ValueError(f"predict_top_k={predict_top_k} must be at least 1")
        self.save_hyperparameters()
        self.init_seed = init_seed
        self.use_optimizer(optimizer_class, optimizer_kwargs)
        self.use_lr_scheduler(lr_scheduler_class, lr_scheduler_kwargs)
        self._config_kwargs = dict(
            num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
            ffn_hidden_size=ffn_hidden_size, hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
            layernorm_epsilon=layernorm_epsilon, init_method_std=init_method_std,
            params_dtype=_DTYPES[params_dtype], recompute_granularity=recompute_granularity,
            recompute_method=recompute_method, recompute_num_layers=recompute_num_layers,
            num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
            defer_embedding_wgrad_compute=defer_embedding_wgrad_compute,
            attention_backend=attention_backend, activation=activation)
        # Validate sizes now (heads, ffn...) with TP=1; TP-dependent checks run in configure_model.
        TransformerConfig(**self._config_kwargs)

    # ------------------------------------------------------------------ model

    def build_chunks(self, ps: ParallelState) -> list[BertModel]:
        hp = self.hparams
        config = TransformerConfig(**self._config_kwargs, tensor_model_parallel_size=ps.tp_size,
                                   sequence_parallel=self.sequence_parallel)
        self.config = config
        self.vocab_size = self.resolved_vocab_size()
        chunks = []
        for place in stage_chunks(config.num_layers, ps.pp_size, ps.pp_rank, ps.vp_size,
                                  num_layers_in_first_pipeline_stage=config.num_layers_in_first_pipeline_stage,
                                  num_layers_in_last_pipeline_stage=config.num_layers_in_last_pipeline_stage):
            chunk = BertModel(
                config, hp.spec, self.vocab_size, hp.max_sequence_length, tp_group=ps.group("tp"),
                add_binary_head=hp.add_binary_head,
                pre_process=place.pre_process, post_process=place.post_process, layer_range=place.layers,
                make_vocab_size_divisible_by=hp.make_vocab_size_divisible_by,
                seed=hp.init_seed, lm_head_activation=hp.get("lm_head_activation"))
            _tag_vocab_parallel(chunk, self.vocab_size)
            if hp.compile:
                chunk.compile_layers()
            chunks.append(chunk)
        return chunks

    @override
    def on_chunks_built(self) -> None:
        self.eval_metrics = pretraining_metrics(self.vocab_size, self.parallel_state)  # val/test: whole split, over DP

    # ------------------------------------------------------------------ weights from elsewhere

    interop = BertInterop()  # Hugging Face BERT / MegatronBERT folders, Megatron-LM checkpoints, export hf
    architecture_keys = ARCHITECTURE_KEYS
    missing_tensors_hint = MISSING_TENSORS_HINT

    @classmethod
    @override
    def architecture_conflicts(cls, hparams: dict[str, Any], source: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """As the base, and a missing ``ffn_hidden_size`` is ``4 * hidden_size``, a missing
        ``lm_head_activation`` the ``activation``, a ``None`` vocabulary is checked on the tensors."""
        from lightning_megatron.models.bert.interop import architecture_conflicts

        return architecture_conflicts(hparams, source)

    def sharded_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under layout-independent names: global layer numbers, no chunk index."""
        assert self.model_chunks is not None
        for chunk in self.model_chunks:
            start = chunk.encoder.layer_range.start
            for name, p in chunk.named_parameters():
                m = re.match(r"encoder\.layers\.(\d+)\.(.*)", name)
                if m:
                    name = f"encoder.layers.{start + int(m.group(1))}.{m.group(2)}"
                elif name.startswith("encoder.final_layernorm"):
                    name = name  # only on the last chunk: unique
                yield name, p

    def training_flops(self, batch: dict[str, torch.Tensor], data_parallel_size: int) -> float | torch.Tensor:
        """FLOPs of a training step (:func:`~lightning_megatron.transformer.config.training_flops`); the
        LM head counts only the masked tokens with ``lm_head_on_masked_only`` (a device tensor: no sync)."""
        tokens = batch["tokens"]
        total = tokens.numel() * data_parallel_size
        head: int | torch.Tensor = total
        if self.hparams.lm_head_on_masked_only and "loss_mask" in batch:
            head = (batch["loss_mask"] > 0).sum().double() * data_parallel_size
        return training_flops(self.config, total, tokens.size(-1), head, self.vocab_size)

    @classmethod
    def estimate_shape(cls, model: dict[str, Any], data: dict[str, Any], *, micro_batch_size: int,
                       global_batch_size: int) -> Any:
        """The sizes ``check --estimate-memory`` / ``--estimate-time`` compute with (``EstimatesCost``),
        from this module's arguments and BertDataModule's; unset ones at their defaults."""
        from pathlib import Path

        from lightning_megatron.check.memory import ModelShape

        vocab = model.get("vocab_size")
        if vocab is None:
            vocab_file = data.get("vocab_file")
            vocab = 30522 if vocab_file is None else sum(1 for _ in Path(vocab_file).open(encoding="utf-8"))
        spec = str(model.get("spec", "bert_layer_local_spec"))
        return ModelShape(
            num_layers=int(model.get("num_layers", 2)), hidden_size=int(model.get("hidden_size", 128)),
            num_attention_heads=int(model.get("num_attention_heads", 4)), ffn_hidden_size=model.get("ffn_hidden_size"),
            vocab_size=int(vocab), make_vocab_size_divisible_by=int(model.get("make_vocab_size_divisible_by", 128)),
            max_sequence_length=int(model.get("max_sequence_length", 128)),
            seq_length=int(data.get("max_seq_length", 128)), micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size, masked_lm_prob=float(data.get("masked_lm_prob", 0.15)),
            params_dtype=str(model.get("params_dtype", "float32")), optimizer=str(model.get("optimizer", "adamw")),
            post_norm="post_norm" in spec, rmsnorm="rmsnorm" in spec,
            recompute=model.get("recompute_granularity") == "full",
            attention_backend=str(model.get("attention_backend", "auto")),
            hidden_dropout=float(model.get("hidden_dropout", 0.0)),
            attention_dropout=float(model.get("attention_dropout", 0.0)))

    def pipeline_tensor_shape(self, microbatch: dict[str, torch.Tensor]) -> tuple[int, int, int]:
        """[s, b, h] exchanged between stages ([s/t, b, h] under sequence parallelism)."""
        b, s = microbatch["tokens"].shape
        if self.config.sequence_parallel:
            s //= self.config.tensor_model_parallel_size
        return (s, b, self.config.hidden_size)

    # ------------------------------------------------------------------ steps

    def forward_step(self, batch: dict[str, torch.Tensor], chunk: BertModel):
        """Megatron's forward-step: run ``chunk``; on the last chunk return the loss function too.

        While predicting, the last chunk's loss function logs ``predictions`` (see ``predict_output``),
        which the strategy concatenates over the microbatches."""
        if self._trainer is not None and self.trainer.predicting:
            return self._predict_forward(batch, chunk)
        selective = chunk.post_process and self.hparams.lm_head_on_masked_only
        positions = batch["loss_mask"] > 0 if selective else None
        mask = None if batch.get(NO_PADDING) is True else batch["attention_mask"]
        out = chunk(batch["tokens"], mask, batch.get("token_types"), lm_positions=positions)
        if not chunk.post_process:
            return out, None
        lm_logits, binary_logits = out
        tp_group = self.parallel_state.group("tp") if self.parallel_state else None
        labels, loss_mask = batch["lm_labels"], batch["loss_mask"]
        if selective:  # logits [n, V/t] of the masked tokens only
            labels, loss_mask = labels[positions], loss_mask[positions]
        lm_loss_per_token = vocab_parallel_cross_entropy(lm_logits, labels, tp_group=tp_group,
                                                         vocab_size=self.vocab_size)
        total, stats = bert_loss(lm_loss_per_token, loss_mask, binary_logits, batch.get("binary_labels"))
        with torch.no_grad():
            preds = vocab_parallel_argmax(lm_logits, tp_group, self.vocab_size)
            masked = loss_mask > 0
            target = labels.masked_fill(~masked, -100)
            num_masked = masked.sum()
            stage = _eval_stage(self)
            if stage:  # whole-split metrics (torchmetrics), logged at the end of the epoch
                metrics = on_device(self.eval_metrics[stage], preds.device)
                metrics["mlm_accuracy"].update(preds, target)
                metrics["perplexity"].update(stats["lm_loss"].detach().float(), num_masked)
            else:  # this step's: tensor ops only (no host sync), correct masked predictions / masked tokens
                stats["mlm_accuracy"] = ((preds == target) & masked).sum().float() / num_masked.clamp(min=1).float()
            stats["num_masked_tokens"] = num_masked.float()

        def loss_func(output: torch.Tensor):
            return output, {"loss": output.detach(), **stats}

        return total, loss_func

    @override
    def on_validation_epoch_end(self) -> None:
        log_epoch_metrics(self, self.eval_metrics["val"], "val", self.parallel_state, self.model_chunks[-1].post_process)

    @override
    def on_test_epoch_end(self) -> None:
        log_epoch_metrics(self, self.eval_metrics["test"], "test", self.parallel_state, self.model_chunks[-1].post_process)

    def _predict_forward(self, batch: dict[str, torch.Tensor], chunk: BertModel):
        """Predictions of one microbatch (:mod:`~lightning_megatron.models.bert.predict`); the loss
        function logs them as ``predictions``, which the strategy concatenates over the microbatches."""
        from lightning_megatron.models.bert.predict import predict_outputs

        if not chunk.post_process:
            return chunk(batch["tokens"], batch.get("attention_mask"), batch.get("token_types")), None
        out = predict_outputs(chunk, batch, self.hparams.get("predict_output", "masked_lm"),
                              tp_group=self.parallel_state.group("tp") if self.parallel_state else None,
                              vocab_size=self.vocab_size, top_k=self.hparams.get("predict_top_k", 5))

        def loss_func(output: Any):
            return torch.zeros((), device=batch["tokens"].device), {"predictions": out}

        return out, loss_func

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """The ``predict_output`` of the batch (without pipelining; with it the strategy runs
        ``forward_step`` over the microbatches and returns the same on the last stage)."""
        assert self.model_chunks is not None and len(self.model_chunks) == 1
        out, _ = self._predict_forward(batch, self.model_chunks[0])
        return out

    @override
    def predict_dataloader(self):
        """Used when the datamodule has none: ``BertDataModule``'s test split."""
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "test_dataloader"):
            raise ValueError("predict needs a dataloader: pass dataloaders=... or a datamodule with test_dataloader")
        return dm.test_dataloader()

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


def _tag_vocab_parallel(chunk: BertModel, vocab_size: int) -> None:
    """Mark the vocab-padded tensors so checkpoints store only the real rows (padding depends on TP)."""
    tensors = []
    if chunk.pre_process:
        tensors.append(chunk.embedding.word_embeddings.weight)
    if chunk.post_process:
        if chunk.output_layer.weight is not None:
            tensors.append(chunk.output_layer.weight)
        if chunk.output_layer.bias is not None:
            tensors.append(chunk.output_layer.bias)
    for t in tensors:  # the parallel layers set partition_dim 0 (the vocabulary's dimension)
        set_param_facts(t, real_vocab_size=vocab_size)
