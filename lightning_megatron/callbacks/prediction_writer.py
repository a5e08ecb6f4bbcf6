"""PredictionWriter: ``predict`` outputs as files people load without lightning_megatron.

In ``<trainer.default_root_dir>/predictions/`` (or ``output_dir``), one set of files in input order (sorted by
``index``): the data-parallel replicas' samples are gathered from the first tensor-parallel rank of each replica's
last pipeline stage (the only one returning predictions that others do not repeat) and written by data-parallel
rank 0:

- ``predict_output=masked_lm``: ``predictions.jsonl``, one line per sample,
  ``{"index": i, "line": l, "masked": [{"position": p, "ids": [...], "tokens": [...], "probs": [...], "label": id}]}``
  for every ``[MASK]`` position ``p`` (``label``: the original token, when the data has one);
- ``pooled``: ``pooled.npy`` ``[n, h]`` and ``index.npy`` ``[n]``;
- ``hidden``: ``hidden.npy`` ``[n, s, h]``, ``attention_mask.npy`` ``[n, s]`` and ``index.npy``;
- generation (a decoder's ``predict_step`` returns an integer tensor ``[b, s0 + n]`` that begins with the
  batch's ``tokens`` ``[b, s0]``: the prompts and their continuations, as
  ``GPTLightningModule.predict_step`` does): ``predictions.jsonl``, one line per prompt,
  ``{"index": i, "line": l, "prompt": text, "completion": text, "token_ids": [...]}`` (``token_ids``: the ``n``
  new tokens, which end at the token that ended the sequence when the module stops it (its
  ``predict_stop_rule``: the end-of-document token, ``predict_stop_strings``); ``completion``: their
  detokenized text, without the end-of-document token and cut before a stop string; ``prompt``: the
  ``predict_file`` line, or the detokenized prompt tokens; both texts ``null`` without the datamodule's
  tokenizer);
- sequence classification (the datamodule a
  :class:`~lightning_megatron.datamodules.finetune.FinetuneDataModule`, whose module's ``predict_step``
  returns class probabilities ``[b, c]``, or values ``[b]`` when ``num_classes`` is 1: regression):
  ``predictions.jsonl``, one line per row, ``{"index": i, "text": ..., "label": name, "label_id": id, "probabilities": [...]}``
  (``label``: the datamodule's ``label_names[id]``, else the id; ``label_id``: the argmax of
  ``probabilities``, listed in class order), or ``{"index": i, "text": ..., "value": v}``; ``"text_pair"``
  after ``"text"`` for rows of two texts.

``index`` is the sample's position in the predict dataset (its place among a ``predict_file``'s texts); ``line``
(records of a ``predict_file``'s texts only) is its line of the file, 1-based: blank lines are skipped, so after
one the two differ. The padding samples of the last batch (index -1, :mod:`lightning_megatron.data.predict`) are
dropped. Each index is predicted once (the samplers give every row to one replica): an index two replicas
predicted (a data loader without a distributed sampler whose batches carry no ``SAMPLE_INDEX``) is refused rather
than written twice or dropped. Files are written under a temporary name and renamed when the epoch ends; the files
of an earlier ``predict`` in the folder (another output mode's, the per-replica ``.dp<r>`` files releases before
2026-12-07 wrote) are removed when it starts, so the folder holds one predict's output.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_megatron.data.predict import SAMPLE_INDEX
from lightning_megatron.datamodules.finetune import FinetuneDataModule
from lightning_megatron.datamodules.pretraining import PretrainingDataModule
from lightning_megatron.generation import StopRule, StopsGeneration, TokenizedData
from lightning_megatron.parallel_state import group_rank, group_size, process_group
from lightning_megatron.strategy import MegatronStrategy

__all__ = ["PredictionWriter"]

_OUTPUT_NAME = re.compile(r"(predictions|pooled|hidden|attention_mask|index)(\.dp\d+)?\.(jsonl|npy)")
"""The files the writer publishes (a subclass's own outputs: ``predictions.npy``)."""


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
        self._arrays: dict[str, list[np.ndarray]] = {}
        self._tokenizer: Any = None
        self._stop = StopRule()
        self._generation = False
        self._dp_group: Any = None
        self._texts: list[str] | None = None
        self._lines: list[int] | None = None
        self.written: list[Path] = []
        """The files this rank wrote in the last ``predict`` (``lightning-megatron predict`` names them)."""
        self._classified: FinetuneDataModule | None = None  # the data of a classifier's predictions
        self._records: list[tuple[int, dict[str, Any]]] = []

    @override
    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        ps = strategy.parallel_state if isinstance(strategy, MegatronStrategy) else None
        # one collector per data-parallel replica: its first TP and CP rank on the last stage (every CP rank
        # generates the whole prompts; two wrote, and removed, the same temporary file); DP rank 0's writes
        self._writes = ps is None or (ps.tp_rank == 0 and ps.cp_rank == 0 and ps.is_pipeline_last_stage())
        self._dp_group = ps.dp_group if ps is not None and ps.dp_size > 1 else None
        self._folder = Path(self.output_dir or os.path.join(trainer.default_root_dir, "predictions"))
        self._arrays = {}
        dm = trainer.datamodule
        self._tokenizer = dm.tokenizer if isinstance(dm, (PretrainingDataModule, TokenizedData)) else None
        # A decoder's stop rule (GPTLightningModule.predict_stop_rule: EOD, stop strings): the rule its generation
        # applied, so each sequence is cut where it ended.
        self._stop = pl_module.predict_stop_rule() if isinstance(pl_module, StopsGeneration) else StopRule()
        self._texts = self._lines = None  # the prompts' texts and lines, read at the first batch (the dataloader
        # is built by then)
        self._generation = False
        self._classified = dm if isinstance(dm, FinetuneDataModule) else None
        self._records = []
        self.written = []
        if trainer.is_global_zero:
            self._remove_earlier_predictions()
        trainer.strategy.barrier("prediction_writer")  # removed before any writer publishes
        if self._writes:
            self._folder.mkdir(parents=True, exist_ok=True)

    def _remove_earlier_predictions(self) -> None:
        """The files an earlier ``predict`` wrote into the folder (our names only: another output mode's, another
        data-parallel size's ``.dp<r>`` files), removed: the folder holds one predict's output."""
        if not self._folder.is_dir():
            return
        earlier = sorted(p for p in self._folder.iterdir() if p.is_file() and _OUTPUT_NAME.fullmatch(p.name))
        for path in earlier:
            path.unlink()
        if earlier:
            rank_zero_info(f"PredictionWriter: removed the earlier predictions in {str(self._folder)!r}: "
                           f"{', '.join(p.name for p in earlier)}")

    def _tmp(self, name: str) -> Path:
        return self._folder / f".{name}.partial"

    def _publish(self, tmp: Path, name: str) -> None:
        """The finished ``tmp`` renamed to its final name (atomic), and listed in :attr:`written`."""
        final = self._folder / name
        os.replace(tmp, final)
        self.written.append(final)

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
        if self._classified is not None:
            self._collect_classified(prediction, index, keep)
            return
        if _is_generation(prediction, batch):
            if not self._generation:
                self._generation, self._texts = True, self._prompt_texts(trainer.datamodule)
                self._lines = self._file_lines(trainer.datamodule)
            self._collect_generated(batch["tokens"], prediction, index, keep)
            return
        if isinstance(prediction, dict):
            self._lines = self._file_lines(trainer.datamodule)
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
            i = int(index[row])
            self._records.append((i, {"index": i, **self._line(i), "masked": masked}))

    def _collect_classified(self, prediction: Any, index: torch.Tensor, keep: torch.Tensor) -> None:
        """One record per kept row: its texts (the datamodule's ``predict_rows``), and its class (label
        name, id, probabilities) or value; written in index order when the epoch ends."""
        dm = self._classified
        classes = dm.num_classes
        expected = (index.size(0), classes) if classes > 1 else (index.size(0),)
        if not torch.is_tensor(prediction) or tuple(prediction.shape) != expected:
            got = tuple(prediction.shape) if torch.is_tensor(prediction) else type(prediction).__name__
            raise ValueError(f"PredictionWriter: {type(dm).__name__} has num_classes={classes}: a prediction per "
                             f"batch of {index.size(0)} rows is {'probabilities' if classes > 1 else 'values'} of "
                             f"shape {list(expected)} (BertClassificationModule's predict_step), not {got}")
        values = prediction.detach().float().cpu()
        names = dm.label_names
        for row in torch.nonzero(keep).flatten().tolist():
            i = int(index[row])
            text, pair, _ = dm.predict_rows[i]
            record: dict[str, Any] = {"index": i, "text": text, **({} if pair is None else {"text_pair": pair})}
            if classes == 1:
                record["value"] = float(values[row])
            else:
                label_id = int(values[row].argmax())
                record.update(label=names[label_id] if names is not None else label_id, label_id=label_id,
                              probabilities=values[row].tolist())
            self._records.append((i, record))

    @staticmethod
    def _prompt_texts(dm: Any) -> list[str] | None:
        from lightning_megatron.datamodules.gpt import GPTDataModule
        from lightning_megatron.datamodules.sft import SFTDataModule  # prompts rendered with the chat template

        prompts = isinstance(dm, (GPTDataModule, SFTDataModule)) and dm.predict_dataset is not None
        return dm.predict_dataset.texts if prompts else None

    @staticmethod
    def _file_lines(dm: Any) -> list[int] | None:
        """The line of the ``predict_file`` each sample comes from (None: the samples are not a file's lines)."""
        return getattr(getattr(dm, "predict_dataset", None), "lines", None)

    def _collect_generated(self, tokens: torch.Tensor, prediction: torch.Tensor, index: torch.Tensor,
                           keep: torch.Tensor) -> None:
        """One record per kept row, written sorted by index when the epoch ends."""
        s0, generated = tokens.size(1), prediction.cpu()
        for row in torch.nonzero(keep).flatten().tolist():
            i, new = int(index[row]), generated[row, s0:].tolist()
            prompt = self._texts[i] if self._texts is not None else \
                self._tokenizer.detokenize(generated[row, :s0].tolist()) if self._tokenizer is not None else None
            new = new[: self._stop.end(new)]  # ended: up to the token that ended it, the padding after it dropped
            completion = self._stop.completion(new) if self._stop.detokenize is not None else \
                self._tokenizer.detokenize(new) if self._tokenizer is not None else None  # the text before the stop
            self._records.append((i, {"index": i, **self._line(i), "prompt": prompt, "completion": completion,
                                      "token_ids": new}))

    def _line(self, index: int) -> dict[str, int]:
        """``{"line": n}``: the sample's line of the ``predict_file`` (blank lines are skipped), when it has one."""
        return {} if self._lines is None else {"line": self._lines[index]}

    def _gathered(self, part: Any) -> list[Any] | None:
        """Every replica's ``part`` on data-parallel rank 0 (over the collectors' DP group: every collector is in
        it), in DP rank order; ``None`` on the other replicas (which write nothing)."""
        if self._dp_group is None:
            return [part]
        parts: list[Any] | None = [None] * group_size(self._dp_group) if group_rank(self._dp_group) == 0 else None
        dist.gather_object(part, parts, group=process_group(self._dp_group), group_dst=0)
        return parts

    @staticmethod
    def _check_once(index: np.ndarray) -> None:
        """Each index predicted by one replica once (padding rows were dropped)."""
        twice = np.unique(index[np.nonzero(index[1:] == index[:-1])[0]]) if index.size else index
        if twice.size:
            raise RuntimeError(f"PredictionWriter: rows {twice[:10].tolist()} were predicted more than once (by "
                               f"several data-parallel replicas): the predict sampler must give each row to one "
                               f"replica once, or the batches carry each row's index (SAMPLE_INDEX, "
                               f"lightning_megatron.data.predict)")

    def _write_records(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        """``predictions.jsonl``, one line per record in index order."""
        records = sorted(records, key=lambda r: r[0])
        self._check_once(np.array([i for i, _ in records], dtype=np.int64))
        with open(self._tmp("predictions.jsonl"), "w", encoding="utf-8") as fh:
            for _, record in records:
                fh.write(json.dumps(record) + "\n")
        self._publish(self._tmp("predictions.jsonl"), "predictions.jsonl")

    def _write_arrays(self, parts: list[dict[str, np.ndarray]]) -> None:
        """One ``.npy`` per output (``index.npy`` among them), rows in index order."""
        index = np.concatenate([part["index"] for part in parts])
        order = np.argsort(index, kind="stable")
        self._check_once(index[order])
        for name in parts[0]:
            tmp = self._tmp(f"{name}.npy")
            with open(tmp, "wb") as fh:
                np.save(fh, np.concatenate([part[name] for part in parts])[order])
            self._publish(tmp, f"{name}.npy")

    @override
    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._writes:
            return
        arrays = {name: np.concatenate(parts) for name, parts in self._arrays.items()}
        parts = self._gathered((self._records, arrays))  # one gather, whichever kind of output
        self._records, self._arrays, self._generation = [], {}, False
        if parts is None:
            return
        array_parts = [a for _, a in parts if a]
        if array_parts:  # pooled, hidden, a subclass's own tensors
            self._write_arrays(array_parts)
        else:  # masked-LM, generated or classified records (none at all: an empty predictions.jsonl)
            self._write_records([r for records, _ in parts for r in records])


def _is_generation(prediction: Any, batch: Any) -> bool:
    """An integer ``[b, s0 + n]`` tensor beginning with the batch's ``tokens`` ``[b, s0]``: prompts and
    their continuations (a decoder's ``predict_step``)."""
    if not (torch.is_tensor(prediction) and prediction.dim() == 2 and not prediction.is_floating_point()
            and isinstance(batch, dict) and torch.is_tensor(batch.get("tokens")) and batch["tokens"].dim() == 2):
        return False
    tokens = batch["tokens"]
    return (prediction.size(0) == tokens.size(0) and prediction.size(1) >= tokens.size(1)
            and torch.equal(prediction[:, :tokens.size(1)].cpu(), tokens.cpu()))
