"""BertLightningModule: BERT pretraining as a LightningModule for the MegatronStrategy.

A :class:`~lightning_megatron.language.module.LanguageLightningModule` (the language-model half every
family shares: the record in the hyper-parameters, chunks per virtual stage, global parameter names,
the [s, b, h] pipeline tensor, the default optimizer; on the model-agnostic
:class:`~lightning_megatron.module.MegatronLightningModule`). What is BERT's own:

- ``config_class``: :class:`~lightning_megatron.models.bert.config.BertConfig`;
- ``build_chunk``: one :class:`BertModel` per virtual pipeline stage;
- ``loss_forward``: the last chunk's masked-LM + binary loss and its logged statistics (MLM accuracy,
  whole-split perplexity and accuracy at validation and test);
- ``predict_forward``: masked-LM top-k, the pooled output or the hidden states (``predict_output``);
- the architecture keys of its sources, ``training_flops``, ``estimate_shape``.

It also works without the MegatronStrategy (plain single-device Lightning): then one chunk is built
and ``training_step`` computes the loss of the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from typing_extensions import override

from lightning_megatron.datamodules.pretraining import (  # NO_PADDING: set on the host: skip the mask, no sync
    NO_PADDING, BertDataModule)
from lightning_megatron.language.module import LanguageLightningModule
from lightning_megatron.models.bert.config import BertConfig
from lightning_megatron.models.bert.interop import ARCHITECTURE_KEYS, MISSING_TENSORS_HINT, BertInterop
from lightning_megatron.models.bert.metrics import eval_stage as _eval_stage
from lightning_megatron.models.bert.metrics import log_epoch_metrics, on_device, pretraining_metrics
from lightning_megatron.models.bert.model import BertModel, bert_loss, masked_positions
from lightning_megatron.models.bert.predict import vocab_parallel_argmax
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.pipeline.layout import ChunkLayout
from lightning_megatron.transformer.config import training_flops


__all__ = ["BertLightningModule", "vocab_parallel_argmax"]


class BertLightningModule(LanguageLightningModule):
    """BERT masked-LM + sentence-order pretraining (Megatron's BERT), any TP x PP x VP x DP layout.

    Args:
        config: the model (:class:`~lightning_megatron.models.bert.config.BertConfig`: sizes, spec,
            dropout, vocabulary, ...; ``config.vocab_size`` None reads ``trainer.datamodule.vocab_size``).
        lm_head_on_masked_only: run the LM head (dense, norm, [h, V] output layer) only on the
            masked tokens, the only ones in the loss: same loss and gradients, ~6x less head work.
            Under sequence parallelism the sequence is all-gathered before the head.
        predict_output: what ``predict_step`` returns per sample: ``"masked_lm"`` (the
            ``predict_top_k`` most likely tokens at every position and their probabilities,
            ``{"ids": [b, s, k], "probs": [b, s, k]}``), ``"pooled"`` (the pooler output, ``[b, h]``)
            or ``"hidden"`` (the encoder output, ``[b, s, h]``). ``lightning-megatron predict``
            writes them to files (:class:`~lightning_megatron.callbacks.PredictionWriter`).
        Others: as :class:`~lightning_megatron.language.module.LanguageLightningModule` (``init_seed``,
            ``optimizer``, ``lr``, ``weight_decay``, ``adam_*``, ``compile``, ``init_from``: a
            lightning_megatron checkpoint, a Hugging Face BERT / MegatronBERT folder or a Megatron-LM
            checkpoint, docs/interop.md; ``optimizer_class``, ``lr_scheduler_class``, ...).
    """

    config_class = BertConfig
    config: BertConfig

    def __init__(
        self,
        config: BertConfig | None = None,
        *,
        lm_head_on_masked_only: bool = True,
        predict_output: Literal["masked_lm", "pooled", "hidden"] = "masked_lm",
        predict_top_k: int = 5,
        **kwargs: Any,
    ) -> None:
        if predict_output not in ("masked_lm", "pooled", "hidden"):
            raise ValueError(f"predict_output={predict_output!r} must be 'masked_lm', 'pooled' or 'hidden'")
        if predict_top_k < 1:
            raise ValueError(f"predict_top_k={predict_top_k} must be at least 1")
        super().__init__(config, **kwargs)

    # ------------------------------------------------------------------ model

    @override
    def build_chunk(self, config: BertConfig, place: ChunkLayout, parallel_state: ParallelState) -> BertModel:
        return BertModel(config, config.spec, self.vocab_size, config.max_sequence_length,
                         tp_group=parallel_state.group("tp"), add_binary_head=config.add_binary_head,
                         num_tokentypes=config.num_tokentypes,
                         pre_process=place.pre_process, post_process=place.post_process, layer_range=place.layers,
                         make_vocab_size_divisible_by=config.make_vocab_size_divisible_by, seed=self.init_seed,
                         lm_head_activation=config.lm_head_activation)

    @override
    def on_chunks_built(self) -> None:
        self.eval_metrics = pretraining_metrics(self.vocab_size, self.parallel_state)  # val/test: whole split, over DP

    # ------------------------------------------------------------------ weights from elsewhere

    interop = BertInterop()  # Hugging Face BERT / MegatronBERT folders, Megatron-LM checkpoints, export hf
    architecture_keys = ARCHITECTURE_KEYS
    missing_tensors_hint = MISSING_TENSORS_HINT
    unread_pretrained = ("pooler.", "binary_head.", "classifier.")  # heads a model without them leaves: the
    # next-sentence head, a fine-tuned classifier's

    @classmethod
    @override
    def architecture_conflicts(cls, hparams: dict[str, Any], source: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """As the base, and a missing ``ffn_hidden_size`` is ``4 * hidden_size``, a missing
        ``lm_head_activation`` the ``activation``, a ``None`` vocabulary is checked on the tensors."""
        from lightning_megatron.models.bert.interop import architecture_conflicts

        return architecture_conflicts(hparams, source)

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
    def estimate_shape(cls, model: Mapping[str, Any], data: Mapping[str, Any], *, micro_batch_size: int,
                       global_batch_size: int) -> Any:
        """The sizes ``check --estimate-memory`` / ``--estimate-time`` compute with (``EstimatesCost``),
        from this module's arguments (its ``config``) and BertDataModule's; unset ones at their defaults."""
        from lightning_megatron.models.bert.cost import BertCost

        config = cls.config_class.coerce(model.get("config"))
        vocab = config.vocab_size
        if vocab is None:  # the data's tokenizer's, read as the datamodule reads it (a vocab.txt, a WordPiece
            # tokenizer.json or a folder: a folder was opened as a file, a tokenizer.json's lines counted)
            from lightning_megatron.data.tokenizer import BertTokenizer

            vocab_file = data.get("vocab_file")
            vocab = 30522 if vocab_file is None else BertTokenizer(vocab_file).vocab_size
        return BertCost.from_config(
            config, vocab_size=int(vocab), seq_length=int(data.get("max_seq_length", 128)),
            micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
            masked_lm_prob=float(data.get("masked_lm_prob", 0.15)), optimizer=str(model.get("optimizer", "adamw")),
            post_norm="post_norm" in config.spec, rmsnorm="rmsnorm" in config.spec,
            compiled_loss=bool(model.get("compile", False)),
            lm_head_on_masked_only=bool(model.get("lm_head_on_masked_only", True)))

    @override
    def head_tokens(self, microbatch: Any) -> int | None:
        """The masked tokens the LM head runs on (``lm_head_on_masked_only``), else None (every token)."""
        if not self.hparams.lm_head_on_masked_only or "loss_mask" not in microbatch:
            return None
        return int((microbatch["loss_mask"] > 0).sum())

    # ------------------------------------------------------------------ steps

    @override
    def loss_forward(self, batch: dict[str, torch.Tensor], chunk: BertModel):
        """The masked-LM + binary loss of the batch on the last chunk (with the MLM accuracy and the number of
        masked tokens to log; at validation / test the whole split's metrics are updated); the hidden
        states elsewhere."""
        selective = chunk.post_process and self.hparams.lm_head_on_masked_only
        # The masked tokens' flat indices: one read of the device per microbatch, before its forward (gathers
        # by a boolean mask would read it four times, in the middle of the forward and the backward).
        positions = masked_positions(batch["loss_mask"] > 0) if selective else None
        mask = None if batch.get(NO_PADDING) is True else batch["attention_mask"]
        out = chunk(batch["tokens"], mask, batch.get("token_types"), lm_positions=positions)
        if not chunk.post_process:
            return out
        lm_logits, binary_logits = out
        tp_group = self.parallel_state.group("tp")
        labels, loss_mask = batch["lm_labels"], batch["loss_mask"]
        if selective:  # logits [n, V/t] of the masked tokens only
            labels, loss_mask = labels.reshape(-1)[positions], loss_mask.reshape(-1)[positions]
        lm_loss_per_token = chunk.compute_language_model_loss(labels, lm_logits)
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
        return total, stats

    @override
    def on_fit_start(self) -> None:
        """Refuse sentence pairs the model does not match (the CLI's pre-launch rule, for a fit from Python)."""
        super().on_fit_start()
        datamodule = self._datamodule()
        if isinstance(datamodule, BertDataModule):
            from lightning_megatron.data_checks import binary_head_problem

            problem = binary_head_problem({"binary_head": datamodule.hparams["binary_head"]},
                                          {"add_binary_head": self.config.add_binary_head}, type(self), python=True)
            if problem:
                raise ValueError(f"{type(datamodule).__name__} and {type(self).__name__}: {problem}")

    @override
    def on_validation_epoch_end(self) -> None:
        log_epoch_metrics(self, self.eval_metrics["val"], "val", self.parallel_state, self.model_chunks[-1].post_process)

    @override
    def on_test_epoch_end(self) -> None:
        log_epoch_metrics(self, self.eval_metrics["test"], "test", self.parallel_state, self.model_chunks[-1].post_process)

    @override
    def predict_forward(self, batch: dict[str, torch.Tensor], chunk: BertModel):
        """The ``predict_output`` of one microbatch on the last chunk
        (:mod:`~lightning_megatron.models.bert.predict`); the hidden states elsewhere."""
        from lightning_megatron.models.bert.predict import predict_outputs

        if not chunk.post_process:
            return chunk(batch["tokens"], batch.get("attention_mask"), batch.get("token_types"))
        return predict_outputs(chunk, batch, self.hparams.get("predict_output", "masked_lm"),
                               tp_group=self.parallel_state.group("tp"), vocab_size=self.vocab_size,
                               top_k=self.hparams.get("predict_top_k", 5))

    @override
    def predict_dataloader(self):
        """Used when the datamodule has none: ``BertDataModule``'s test split."""
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "test_dataloader"):
            raise ValueError("predict needs a dataloader: pass dataloaders=... or a datamodule with test_dataloader")
        return dm.test_dataloader()
