"""PredictionWriter: ``predict`` outputs as files people load without lightning_megatron.

In ``<trainer.default_root_dir>/predictions/`` (or ``output_dir``), one set of files per data-parallel
rank (``.dp<r>`` before the suffix when there are several), written by the first tensor-parallel rank
of the last pipeline stage (the only one returning predictions that others do not repeat):

- ``predict_output=masked_lm``: ``predictions.jsonl``, one line per sample,
  ``{"index": i, "masked": [{"position": p, "ids": [...], "tokens": [...], "probs": [...], "label": id}]}``
  for every ``[MASK]`` position ``p`` (``label``: the original token, when the data has one);
- ``pooled``: ``pooled.npy`` ``[n, h]`` and ``index.npy`` ``[n]``;
- ``hidden``: ``hidden.npy`` ``[n, s, h]``, ``attention_mask.npy`` ``[n, s]`` and ``index.npy``;
- generation (a decoder's ``predict_step`` returns an integer tensor ``[b, s0 + n]`` that begins with the
  batch's ``tokens`` ``[b, s0]``: the prompts and their continuations, as
  ``GPTLightningModule.predict_step`` does): one ``predictions.jsonl`` (the data-parallel replicas'
  records gathered, written by DP rank 0), one line per prompt in input order,
  ``{"index": i, "prompt": text, "completion": text, "token_ids": [...]}`` (``token_ids``: the ``n``
  new tokens, which end at the first end-of-document token when the module stops there
  (``predict_stop_at_eod``); ``completion``: their detokenized text, without that token; ``prompt``: the
  ``predict_file`` line, or the detokenized prompt tokens; both texts ``null`` without the datamodule's
  tokenizer).

``index`` is the sample's position in the predict dataset (the line of a ``predict_file``); the padding
samples of the last batch (index -1, :mod:`lightning_megatron.data.predict`) are dropped. Files are
written under a temporary name and renamed when the epoch ends.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from lightning_megatron.data.predict import SAMPLE_INDEX
from lightning_megatron.datamodules.pretraining import PretrainingDataModule
from lightning_megatron.parallel_state import group_rank, group_size, process_group
from lightning_megatron.strategy import MegatronStrategy

__all__ = ["PredictionWriter"]


class PredictionWriter(BasePredictionWriter):
    """Write every predicted sample (see the module docstring).

    Args:
        output_dir: the folder; ``None``: ``<trainer.default_root_dir>/predictions``.
        mask_token_id: the ``[MASK]`` id; ``None``: the datamodule's ``tokenizer.mask_id``.
    """

    def __init__(self, output_dir: str | None = None, mask_token_id: int | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir, self.mask_token_id = output_dir, mask_token_id
        self._writes = False
        self._folder: Path | None = None
        self._suffix = ""
        self._jsonl: Any = None
        self._arrays: dict[str, list[np.ndarray]] = {}
        self._tokenizer: Any = None
        self._stop_token: int | None = None
        self._generated: list[tuple[int, dict[str, Any]]] = []
        self._generation = False
        self._dp_group: Any = None
        self._texts: list[str] | None = None

    @override
    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        ps = strategy.parallel_state if isinstance(strategy, MegatronStrategy) else None
        self._writes = ps is None or (ps.tp_rank == 0 and ps.is_pipeline_last_stage())
        self._suffix = f".dp{ps.dp_rank}" if ps is not None and ps.dp_size > 1 else ""
        self._dp_group = ps.dp_group if ps is not None and ps.dp_size > 1 else None
        self._folder = Path(self.output_dir or os.path.join(trainer.default_root_dir, "predictions"))
        self._arrays = {}
        dm = trainer.datamodule
        self._tokenizer = dm.tokenizer if isinstance(dm, PretrainingDataModule) else None
        # A decoder that stops at EOD (GPTLightningModule(predict_stop_at_eod=True)) pads ended sequences with it.
        self._stop_token = int(self._tokenizer.eod) if self._tokenizer is not None and \
            pl_module.hparams.get("predict_stop_at_eod", False) else None
        self._texts = None  # the prompts' texts, read at the first batch (the dataloader is built by then)
        self._generated, self._generation = [], False
        if self._writes:
            self._folder.mkdir(parents=True, exist_ok=True)
            if pl_module.hparams.get("predict_output", "masked_lm") == "masked_lm":
                self._jsonl = open(self._tmp("predictions.jsonl"), "w", encoding="utf-8")  # noqa: SIM115

    def _tmp(self, name: str) -> Path:
        stem, ext = name.rsplit(".", 1)
        return self._folder / f".{stem}{self._suffix}.{ext}.partial"

    def _final(self, name: str) -> Path:
        stem, ext = name.rsplit(".", 1)
        return self._folder / f"{stem}{self._suffix}.{ext}"

    @override
    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any,
                           batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self._writes or prediction is None:
            return
        if SAMPLE_INDEX in batch:
            index = batch[SAMPLE_INDEX].cpu()
        else:
            start = batch_idx * batch["tokens"].size(0)
            index = torch.arange(start, start + batch["tokens"].size(0))
        keep = index >= 0
        if _is_generation(prediction, batch):
            if not self._generation:
                self._generation, self._texts = True, self._prompt_texts(trainer.datamodule)
            self._collect_generated(batch["tokens"], prediction, index, keep)
            return
        if isinstance(prediction, dict):
            self._write_masked(batch, prediction, index, keep)
            return
        mode = pl_module.hparams.get("predict_output")
        name = mode if mode in ("pooled", "hidden") else "predictions"  # a subclass's own outputs: predictions.npy
        self._arrays.setdefault("index", []).append(index[keep].numpy())
        self._arrays.setdefault(name, []).append(prediction[keep.to(prediction.device)].float().cpu().numpy())
        if mode == "hidden":
            self._arrays.setdefault("attention_mask", []).append(batch["attention_mask"][keep].cpu().numpy())

    def _write_masked(self, batch: dict[str, torch.Tensor], prediction: dict[str, torch.Tensor],
                      index: torch.Tensor, keep: torch.Tensor) -> None:
        mask_id = self.mask_token_id if self.mask_token_id is not None else self._tokenizer.mask_id if \
            self._tokenizer is not None else None
        if mask_id is None:
            raise ValueError("PredictionWriter: no [MASK] id: use BertDataModule or PredictionWriter(mask_token_id=...)")
        tokens, ids, probs = batch["tokens"].cpu(), prediction["ids"].cpu(), prediction["probs"].float().cpu()
        labels = batch["lm_labels"].cpu() if "lm_labels" in batch else None
        for row in torch.nonzero(keep).flatten().tolist():
            masked = []
            for p in torch.nonzero(tokens[row] == mask_id).flatten().tolist():
                entry: dict[str, Any] = {"position": p, "ids": ids[row, p].tolist(), "probs": probs[row, p].tolist()}
                if self._tokenizer is not None:
                    entry["tokens"] = self._tokenizer.convert_ids_to_tokens(entry["ids"])
                if labels is not None and labels[row, p] >= 0:
                    entry["label"] = int(labels[row, p])
                masked.append(entry)
            self._jsonl.write(json.dumps({"index": int(index[row]), "masked": masked}) + "\n")

    @staticmethod
    def _prompt_texts(dm: Any) -> list[str] | None:
        from lightning_megatron.datamodules.gpt import GPTDataModule

        return dm.predict_dataset.texts if isinstance(dm, GPTDataModule) and dm.predict_dataset is not None else None

    def _collect_generated(self, tokens: torch.Tensor, prediction: torch.Tensor, index: torch.Tensor,
                           keep: torch.Tensor) -> None:
        """One record per kept row, written sorted by index when the epoch ends."""
        s0, generated = tokens.size(1), prediction.cpu()
        for row in torch.nonzero(keep).flatten().tolist():
            i, new = int(index[row]), generated[row, s0:].tolist()
            prompt = self._texts[i] if self._texts is not None else \
                self._tokenizer.detokenize(generated[row, :s0].tolist()) if self._tokenizer is not None else None
            text = new
            if self._stop_token is not None and self._stop_token in new:  # ended: the stop token kept in the
                end = new.index(self._stop_token)                          # ids, not in the text; the padding
                new, text = new[:end + 1], new[:end]                       # after it dropped
            completion = self._tokenizer.detokenize(text) if self._tokenizer is not None else None
            self._generated.append((i, {"index": i, "prompt": prompt, "completion": completion, "token_ids": new}))

    def _write_generated(self) -> None:
        """One ``predictions.jsonl`` in input order: the data-parallel replicas' records gathered (over the
        writers' DP group: every writer is in it) and written by DP rank 0."""
        if self._jsonl is not None:  # opened for masked_lm by default: not this module's output
            self._jsonl.close()
            self._jsonl = None
            os.remove(self._tmp("predictions.jsonl"))
        records = self._generated
        self._generated, self._generation = [], False
        if self._dp_group is not None:
            parts: list[Any] = [None] * group_size(self._dp_group)
            dist.all_gather_object(parts, records, group=process_group(self._dp_group))
            if group_rank(self._dp_group) != 0:
                return
            records = [r for part in parts for r in part]
        self._suffix = ""
        with open(self._tmp("predictions.jsonl"), "w", encoding="utf-8") as fh:
            for _, record in sorted(records, key=lambda r: r[0]):
                fh.write(json.dumps(record) + "\n")
        os.replace(self._tmp("predictions.jsonl"), self._final("predictions.jsonl"))

    @override
    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._writes:
            return
        if self._generation:
            self._write_generated()
            return
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
            os.replace(self._tmp("predictions.jsonl"), self._final("predictions.jsonl"))
        for name, parts in self._arrays.items():
            tmp = self._tmp(f"{name}.npy")
            with open(tmp, "wb") as fh:
                np.save(fh, np.concatenate(parts))
            os.replace(tmp, self._final(f"{name}.npy"))
        self._arrays = {}


def _is_generation(prediction: Any, batch: Any) -> bool:
    """An integer ``[b, s0 + n]`` tensor beginning with the batch's ``tokens`` ``[b, s0]``: prompts and
    their continuations (a decoder's ``predict_step``)."""
    if not (torch.is_tensor(prediction) and prediction.dim() == 2 and not prediction.is_floating_point()
            and isinstance(batch, dict) and torch.is_tensor(batch.get("tokens")) and batch["tokens"].dim() == 2):
        return False
    tokens = batch["tokens"]
    return (prediction.size(0) == tokens.size(0) and prediction.size(1) >= tokens.size(1)
            and torch.equal(prediction[:, :tokens.size(1)].cpu(), tokens.cpu()))
