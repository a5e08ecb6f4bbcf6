"""Sequence classification on the same BertModel, at every TP x PP x VP x DP layout.

:class:`BertClassificationModule` is a :class:`BertLightningModule` whose last chunk carries a
classifier (``classifier``: [h] -> [num_classes], replicated across TP like the pooler) on the
pooled first token. It keeps the strategy protocol (``forward_step``, ``pipeline_tensor_shape``,
``sharded_named_parameters``), so checkpoints, fp32 main params, clipping and the schedules work
unchanged; ``init_from`` loads a pretrained encoder (and pooler) from any source the pretraining
module reads, leaving the classifier at its seeded initialization.

``num_classes=1`` is regression (one output, mean-squared error), as transformers' ``num_labels=1``.

Batches: ``tokens`` [b, s], ``attention_mask`` [b, s] (1 = real token), optional ``token_types``,
and ``labels`` [b] (class ids; float values for regression). Logged: ``loss`` (and, when
training, the batch ``accuracy``) per step; validation/test log the torchmetrics of the whole split
(:mod:`~lightning_megatron.models.bert.metrics`: accuracy, F1, Matthews correlation; Pearson,
Spearman and MSE for regression), synchronised over the data-parallel group.

``predict`` (``predict_step``, and ``forward_step`` under the MegatronStrategy): per row the class
probabilities ``softmax(logits)`` [b, num_classes] in fp32 (the label is their argmax), or the predicted
value [b] for regression; no ``labels`` needed. The ``PredictionWriter`` writes them with the rows' texts
and label names (a :class:`~lightning_megatron.datamodules.finetune.FinetuneDataModule`'s).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_megatron.data.predict import SAMPLE_INDEX
from lightning_megatron.models.bert.metrics import eval_stage, finetune_metrics, update_stage
from lightning_megatron.models.bert.model import BertModel
from lightning_megatron.models.bert.module import BertLightningModule
from lightning_megatron.tensor_parallel import init_method_normal, mark_replicated, param_facts
from lightning_megatron.transformer import seeded

__all__ = ["BertClassificationModule"]


class BertClassificationModule(BertLightningModule):
    """BERT sequence classification (fine-tuning), any layout.

    Args:
        num_classes: number of labels; 1: regression (one output, mean-squared error). The
            ``finetune`` CLI takes it from the datamodule (``data.num_classes``).
        classifier_dropout: dropout on the pooled representation before the classifier.
        Others: as :class:`BertLightningModule` (``init_from`` points at the pretrained model; its
            pooler is used when it has one, ``config.add_binary_head`` must stay True for the pooler).
    """

    def __init__(self, *, num_classes: int = 2, classifier_dropout: float = 0.1, **kwargs: Any) -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes={num_classes} must be >= 2 for classification, or 1 for regression")
        super().__init__(**kwargs)  # saves num_classes and classifier_dropout with the rest
        if not self.config.add_binary_head:
            raise ValueError("BertClassificationModule pools with the pretraining pooler: keep "
                             "config.add_binary_head=True")

    @override
    def on_chunks_built(self) -> None:
        # The classifier exists before the base loads ``init_from`` (which leaves it at its initialization).
        last = self.model_chunks[-1]
        if last.post_process:
            with seeded(self.hparams.init_seed, "classifier"):
                last.classifier = nn.Linear(self.config.hidden_size, self.hparams.num_classes,
                                            dtype=self.config.params_dtype)
                init_method_normal(self.config.init_method_std)(last.classifier.weight.data)
                nn.init.zeros_(last.classifier.bias.data)
            mark_replicated(last.classifier.parameters())  # replicated across TP, like the pooler
            last.classifier_dropout = nn.Dropout(self.hparams.classifier_dropout)
        self.eval_metrics = finetune_metrics(self.hparams.num_classes, self.parallel_state)

    @classmethod
    @override
    def estimate_shape(cls, model: Any, data: Any, *, micro_batch_size: int, global_batch_size: int) -> Any:
        """BERT's sizes without the LM head's work: the classifier runs on the pooled first token (the LM head's
        parameters are held, not run; ``check --estimate-memory`` predicted its logits, twice the activations)."""
        from dataclasses import replace

        shape = super().estimate_shape(model, data, micro_batch_size=micro_batch_size,
                                       global_batch_size=global_batch_size)
        return replace(shape, masked_lm_prob=0.0)

    fine_tuning_heads = ("classifier.",)  # init_from never loads it: evaluation needs the fine-tuned checkpoint
    optional_pretrained = ("pooler.",)  # as transformers does, a source without a pooler gets a fresh one
    unread_pretrained = ("classifier.", "lm_head.", "binary_head.", "output_layer.")  # heads of pretraining or
    # of a classifier checkpoint: this fine-tune starts its own head

    @override
    def pretrained_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The encoder, embeddings and pooler: the pretraining heads (LM, binary) are not used here,
        so a source without them (a transformers ``BertModel``) loads too."""
        unused = ("classifier.", "lm_head.", "binary_head.", "output_layer.bias")
        return [(n, p) for n, p in self.sharded_named_parameters()
                if not n.startswith(unused) and not (n == "output_layer.weight"
                                                     and not param_facts(p).shared_embedding)]

    @override
    def forward_step(self, batch: dict[str, torch.Tensor], chunk: BertModel):
        tokens, mask = batch["tokens"], batch["attention_mask"]
        if not chunk.post_process:
            return chunk(tokens, mask, batch.get("token_types")), None
        logits = self._classify(chunk, chunk(tokens, mask, batch.get("token_types"), return_pooled=True))
        trainer = self._trainer
        if trainer is not None and trainer.predicting:
            preds = self._predictions(logits.detach())
            return logits, lambda output: (torch.zeros((), device=tokens.device), {"predictions": preds})
        labels = batch["labels"].view(-1)
        stage = eval_stage(self)
        if stage is not None:
            return self._eval_loss(logits, labels, batch.get(SAMPLE_INDEX), stage)
        if self.hparams.num_classes == 1:
            loss = F.mse_loss(logits.float().view(-1), labels.float())
            stats = {}
        else:
            loss = F.cross_entropy(logits.float(), labels)
            with torch.no_grad():
                stats = {"accuracy": (logits.argmax(-1) == labels).float().mean()}

        def loss_func(output: torch.Tensor):
            return output, {"loss": output.detach(), **stats}

        return loss, loss_func

    def _eval_loss(self, logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor | None, stage: str):
        """Validation/test: every metric, the loss included, is the split's over its real rows (the
        padding of the last global batch, ``sample_index`` -1, left out), logged once per epoch by
        :func:`~lightning_megatron.models.bert.metrics.log_epoch_metrics`; nothing per step."""
        keep = slice(None) if index is None else index.view(-1) >= 0
        logits, labels = logits.detach()[keep], labels[keep]
        if self.hparams.num_classes == 1:
            values = logits.float().view(-1)
            rows = (values - labels.float()) ** 2
            update_stage(self.eval_metrics, stage, values.double(), labels.double(), rows.double())
        else:
            rows = F.cross_entropy(logits.float(), labels, reduction="none")
            update_stage(self.eval_metrics, stage, logits.argmax(-1), labels, rows)
        return rows.sum(), lambda output: (output, {})

    def _predictions(self, logits: torch.Tensor) -> torch.Tensor:
        """Class probabilities ``softmax(logits)`` [b, c] (fp32), or the predicted values [b] for regression."""
        return logits.float().view(-1) if self.hparams.num_classes == 1 else logits.float().softmax(-1)

    def _classify(self, chunk: BertModel, pooled: torch.Tensor) -> torch.Tensor:
        """The logits [b, c] of the pooler's output [b, h] (``chunk(..., return_pooled=True)``)."""
        return chunk.classifier(chunk.classifier_dropout(pooled))

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """One process: the probabilities [b, c] (regression: values [b]) of the batch's rows."""
        chunk = self.model_chunks[0]
        pooled = chunk(batch["tokens"], batch["attention_mask"], batch.get("token_types"), return_pooled=True)
        return self._predictions(self._classify(chunk, pooled))
