"""``GPTDataModule``: decoder pretraining data (:mod:`~lightning_megatron.data.gpt_dataset`) for Lightning.

The same prefixes / blends, splits, batch sizes, samplers, resume state and vocabulary check as
:class:`~lightning_megatron.datamodules.pretraining.BertDataModule` (their shared base,
:class:`~lightning_megatron.datamodules.pretraining.PretrainingDataModule`). A training step receives this
data-parallel rank's share of one global batch: ``tokens`` / ``labels`` int64 ``[b, s]`` and
``loss_mask`` float32 ``[b, s]``. ``predict`` reads prompts (``predict_file``) and yields their tokens,
batched by length (:class:`~lightning_megatron.data.predict.LengthGroupedBatchSampler`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_megatron.data.corpus import default_corpus_fingerprint
from lightning_megatron.data.gpt_dataset import GPTDataset, check_documents_end_with_eod
from lightning_megatron.data.indexed_dataset import IndexedDataset
from lightning_megatron.data.predict import IndexedSamples, LengthGroupedBatchSampler, PromptDataset
from lightning_megatron.data.preprocess import preprocess_corpus
from lightning_megatron.data.tokenizer import BertTokenizer
from lightning_megatron.datamodules.pretraining import PretrainingDataModule

__all__ = ["GPTDataModule"]

_DEFAULT_CORPUS_MAX_SEQ_LENGTH = 512
"""How preprocess cuts over-long sentences of the built-in corpus (transparent to GPT samples, which
join the items of a document again)."""


class GPTDataModule(PretrainingDataModule):
    """GPT pretraining data, Megatron's way: documents (each ending with EOD) joined into one token
    stream, ``seq_length + 1``-token samples, shuffled
    (:class:`~lightning_megatron.data.gpt_dataset.GPTDataset`).

    Args:
        data_prefix: prefix of an indexed dataset preprocessed with ``--append-eod``; or a weighted
            blend ``[0.3, prefix_a, 0.7, prefix_b]``; or one of them per split, ``{train: ..., valid: ...,
            test: ...}``, each read whole by its split (Megatron-LM's ``--train-data-path`` ...; ``splits`` left
            out); ``None``: the built-in corpus, tokenized with the tokenizer below, EOD appended, cached under
            ``cache_dir``.
        vocab_file: the tokenizer's vocabulary; ``None``: the one the dataset's ``<prefix>.vocab.json``
            records, else the packaged byte-level BPE (the built-in corpus's). Its ``eod`` id ends the documents.
        seq_length: tokens per sample (the model's sequence length).
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        micro_batch_size: samples per forward/backward pass on one rank.
        seed: seed of the document orders, the sample shuffle and the random sampler.
        eod_mask_loss: no loss where the input token is EOD (Megatron's ``--eod-mask-loss``).
        reset_position_ids: positions restart after every EOD (Megatron's ``--reset-position-ids``).
        reset_attention_mask: a token attends only to its own document of the packed sample (Megatron's
            ``--reset-attention-mask``); with ``reset_position_ids``, each document of a sample computes
            what it computes alone (docs/long_context.md).
        splits: document split weights ``"train,valid,test"``, Megatron's ``"949,50,1"`` style (one
            ``data_prefix`` cut into the splits).
        train_samples: length of the training set; ``None``: ``trainer.max_steps * global_batch_size``
            when a trainer with ``max_steps`` is attached (a resumed run: the samples consumed by its step plus
            ``global_batch_size`` per step left), else one epoch of the training documents.
        eval_samples: length of the validation and test sets; ``None``: one epoch of their documents
            (at least one global batch).
        shuffle: ``"sequential"`` (the shuffle index already shuffles; Megatron's default) or
            ``"random"`` (additionally shuffled per epoch, in buckets of the run's first DP size: Megatron's per-rank
            buckets, kept when the run resumes at another DP size).
        num_workers: DataLoader worker processes; ``None``:
            :func:`~lightning_megatron.data.loader.default_num_workers`.
        cache_dir: where the built-in corpus is cached; ``None``: ``$LIGHTNING_MEGATRON_CACHE`` or
            ``~/.cache/lightning_megatron``.
        samples_cache_dir: where the document / sample / shuffle indices are cached; ``None``: next
            to the dataset, or the default cache directory when that is not writable.
        predict_file: the prompts ``predict`` continues: a text file (one prompt per non-empty line)
            or a ``.jsonl`` file (its ``predict_json_key`` field); tokenized with the tokenizer, no EOD.
            Batches hold prompts of one length (generation pads nothing): each global batch comes
            from one length group, the last of a group padded with copies marked ``sample_index=-1``.
        predict_json_key: the JSONL field holding the prompt.
    """

    default_tokenizer = "bpe"
    documents_need_eod = True

    def __init__(self, data_prefix: str | list[str | float] | dict[str, str | list[str | float]] | None = None,
                 vocab_file: str | None = None, *,
                 seq_length: int = 1024, global_batch_size: int = 32, micro_batch_size: int = 8,
                 seed: int = 1234, eod_mask_loss: bool = False, reset_position_ids: bool = False,
                 reset_attention_mask: bool = False, splits: str = "949,50,1",
                 train_samples: int | None = None, eval_samples: int | None = None,
                 shuffle: Literal["sequential", "random"] = "sequential", num_workers: int | None = None,
                 cache_dir: str | None = None, samples_cache_dir: str | None = None,
                 predict_file: str | None = None, predict_json_key: str = "text") -> None:
        super().__init__()
        if seq_length < 2:
            raise ValueError(f"seq_length={seq_length} must be at least 2 (GPT recipes use 1024-4096)")
        self._init_common(data_prefix, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                          seed=seed, splits=splits, train_samples=train_samples, eval_samples=eval_samples,
                          shuffle=shuffle, num_workers=num_workers, cache_dir=cache_dir,
                          samples_cache_dir=samples_cache_dir)
        self.save_hyperparameters()
        self.vocab_file = vocab_file
        self.seq_length = seq_length
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids, self.reset_attention_mask = reset_position_ids, reset_attention_mask
        self.predict_file, self.predict_json_key = predict_file, predict_json_key
        self.predict_dataset: PromptDataset | None = None
        """The prompts of the last ``predict_dataloader`` (their texts: ``predict_dataset.texts``)."""

    @override
    def _default_corpus_prefix(self) -> Path:
        """Keyed by the corpus fingerprint and the vocabulary's contents."""
        vocab_hash = hashlib.sha256(Path(self.tokenizer.vocab_file).read_bytes()).hexdigest()[:12]
        return self.cache_dir / f"default-corpus-{default_corpus_fingerprint()}-{vocab_hash}-eod" / "corpus"

    @override
    def _preprocess_default_corpus(self, prefix: Path) -> None:
        preprocess_corpus(None, prefix, self.tokenizer, max_seq_length=_DEFAULT_CORPUS_MAX_SEQ_LENGTH,
                          append_eod=True)

    @override
    def _open(self, prefix: Path, whole: int | None = None) -> tuple[IndexedDataset, list[range]]:
        """The base's checks, and that the documents end with the tokenizer's EOD."""
        indexed, splits = super()._open(prefix, whole)
        check_documents_end_with_eod(indexed, self.tokenizer.eod, wordpiece=isinstance(self.tokenizer, BertTokenizer))
        return indexed, splits

    @override
    def _make_dataset(self, indexed: IndexedDataset, documents: range, num_samples: int | None) -> GPTDataset:
        return GPTDataset(indexed, documents=documents, num_samples=num_samples, seq_length=self.seq_length,
                          seed=self.seed, eod_id=self.tokenizer.eod, eod_mask_loss=self.eod_mask_loss,
                          samples_cache_dir=self.samples_cache_dir, vocab_size=self.tokenizer.vocab_size,
                          reset_position_ids=self.reset_position_ids, reset_attention_mask=self.reset_attention_mask)

    @override
    def predict_dataloader(self) -> DataLoader:
        """``predict_file``'s prompts, every one once: full global batches of one prompt length (the
        last of each length padded with copies whose ``sample_index`` is -1)."""
        if self.predict_file is None:
            raise ValueError("GPTDataModule: predict continues prompts: pass --data.predict_file (one prompt per "
                             "line, or a .jsonl file with --data.predict_json_key)")
        dataset = PromptDataset(self.predict_file, self.tokenizer, self.predict_json_key, max_length=self.seq_length)
        self.predict_dataset = dataset
        dp_rank, dp_size = self._dp_coordinates()
        sampler = LengthGroupedBatchSampler(dataset.lengths, data_parallel_rank=dp_rank, data_parallel_size=dp_size,
                                            local_batch_size=self.micro_batch_size * self.num_microbatches(dp_size))
        return self._loader(IndexedSamples(dataset), sampler)
