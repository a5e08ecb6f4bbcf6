"""``PretrainingDataModule`` and ``BertDataModule``: tokenizer, indexed dataset, BERT datasets and
consumed-samples samplers (all of :mod:`lightning_megatron.data`) for Lightning.

The batch a training step receives is this data-parallel rank's share of one global batch:
``micro_batch_size * num_microbatches`` samples with ``num_microbatches = global_batch_size //
(micro_batch_size * dp_size)``; the strategy cuts it into micro-batches. The DP coordinates come from
``trainer.strategy.parallel_state`` when the strategy has one, else ``(0, 1)``.

Resuming: the train sampler starts after ``consumed_samples``, which is the value restored from the
checkpoint (``state_dict`` / ``load_state_dict``) or else ``trainer.global_step * global_batch_size``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_megatron.data.bert_dataset import BertDataset, get_train_valid_test_split_, split_weights
from lightning_megatron.data.blended import SPLIT_NAMES, BlendedDataset, blend_num_samples, split_blends
from lightning_megatron.data.corpus import default_corpus_fingerprint
from lightning_megatron.data.dataset_vocab import (TokenizerFamily, check_dataset_vocab, dataset_tokenizer,
                                                   vocab_sidecar_path)
from lightning_megatron.data.indexed_dataset import IndexedDataset, index_file_path
from lightning_megatron.data.loader import count_the_resumed_pass, epoch_steps, trainer_loader
from lightning_megatron.data.preprocess import preprocess_corpus
from lightning_megatron.data.samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    evaluation_coverage,
)
from lightning_megatron.data.tokenizer import default_cache_dir, file_lock

__all__ = ["BertDataModule", "NO_PADDING", "NoEvaluationData", "PretrainingDataModule"]

NO_PADDING = "no_padding"
"""Batch key set on the host by :meth:`BertDataModule.on_before_batch_transfer`: True when no sample of
the batch is padded, so that the model skips the attention mask without a device -> host sync."""


DataPrefix = str | list[str | float] | dict[str, str | list[str | float]] | None
"""A pretraining datamodule's ``data_prefix``: a path, a blend ``[w, path, ...]``, a path or blend per split
(``{train: ..., valid: ..., test: ...}``), or None (the built-in corpus)."""
DEFAULT_SPLITS = "949,50,1"
"""Megatron's default ``splits``."""


class NoEvaluationData(ValueError):
    """``validate`` / ``test`` of a split that holds no sample: raised alike on every rank (they read the same
    data), so the command line says it once."""


class PretrainingDataModule(pl.LightningDataModule):
    """What every pretraining datamodule shares (:class:`BertDataModule`, :class:`~.gpt.GPTDataModule`):
    the data prefixes or blend, the built-in corpus's cache, the vocabulary check, the train/valid/test
    split of the documents, the datasets of each split (blended across prefixes), the consumed-samples
    samplers, the DP coordinates and the resume state.

    A subclass sets the attributes of :meth:`_init_common` and ``vocab_file`` in its ``__init__`` and gives
    its packaged tokenizer (:attr:`default_tokenizer`), the built-in corpus (:meth:`_default_corpus_prefix`,
    :meth:`_preprocess_default_corpus`) and its dataset (:meth:`_make_dataset`).
    """

    default_tokenizer: ClassVar[TokenizerFamily]
    """The packaged tokenizer of the data when neither ``vocab_file`` nor the dataset's record names one."""
    documents_need_eod: ClassVar[bool] = False
    """Whether samples join documents, which an end-of-document id must then end (GPT's)."""
    vocab_file: str | None
    _tokenizer: Any = None

    def _init_common(self, data_prefix: DataPrefix, *, global_batch_size: int,
                     micro_batch_size: int, seed: int, splits: str, train_samples: int | None,
                     eval_samples: int | None, shuffle: str, num_workers: int | None, cache_dir: str | None,
                     samples_cache_dir: str | None) -> None:
        if global_batch_size < 1 or micro_batch_size < 1 or global_batch_size % micro_batch_size:
            raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                             f"micro_batch_size={micro_batch_size}")
        if shuffle not in ("sequential", "random"):
            raise ValueError(f"shuffle={shuffle!r} must be 'sequential' or 'random'")
        split_weights(splits)  # validates the string now, not at setup
        if data_prefix is not None:
            split_blends(data_prefix)  # validates the blend (or the blend of each split) now, not at setup
        if isinstance(data_prefix, Mapping) and splits != DEFAULT_SPLITS:
            raise ValueError(f"splits={splits!r} cuts one data_prefix into splits, and data_prefix names each split's "
                             f"data ({', '.join(data_prefix)}), read whole: leave splits out")
        self.data_prefix = data_prefix
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.splits = splits
        self.train_samples = train_samples
        self.eval_samples = eval_samples
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.samples_cache_dir = samples_cache_dir
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._restored: tuple[int, int] = (0, 0)
        """(consumed_samples, global_step) at the last checkpoint restored."""
        self._restored_order: Any = None
        """The ``order_key`` of the training set the restored checkpoint's run read (None: unrecorded, or an order
        any length keeps)."""
        self._shuffle_key: list[int] | None = None
        """``shuffle: random``: the sampler's ``order_key`` (seed, samples per epoch, buckets), the restored run's
        until the training loader is built, then this run's."""
        self._sources: list[tuple[list[float], list[Path], list[tuple[IndexedDataset, list[range]]]] | None] = []
        """Per split (train, valid, test): the blend's weights, its prefixes and each one opened with the split's
        documents (set-up's); None for a split that a per-split data_prefix does not name."""
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self._no_dataset: dict[str, str] = {}
        """Split -> why it has no dataset: said when a loop asks for it (a run that never tests is not told)."""
        self._left_out: dict[str, str] = {}
        """Split -> the blend's prefixes it leaves out (no documents there): said when the split is read, too."""
        self._coverage_said: set[str] = set()  # the splits whose evaluation's coverage was said

    # --- tokenizer and corpus -------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The tokenizer the data was (or is) tokenized with: :func:`~.dataset_vocab.dataset_tokenizer` of
        ``vocab_file``, the first dataset's ``.vocab.json`` and :attr:`default_tokenizer` (the rule the
        check before launch applies too)."""
        if self._tokenizer is None:
            prefix = self._split_blends()[0][1][0] if self.data_prefix is not None else None  # the train data's
            self._tokenizer = dataset_tokenizer(self.vocab_file, prefix, default=self.default_tokenizer)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Pieces in the vocabulary (the model pads it for tensor parallelism)."""
        return self.tokenizer.vocab_size

    def _split_blends(self) -> list[tuple[list[float], list[Path]] | None]:
        """(weights, prefixes) each split reads (:func:`~lightning_megatron.data.blended.split_blends`): one prefix
        of weight 1 (the built-in corpus's without ``data_prefix``) unless it is a blend; None for a split a
        per-split ``data_prefix`` does not name."""
        if self.data_prefix is None:
            return [([1.0], [self._prefix()])] * len(SPLIT_NAMES)
        return [None if b is None else (b[0], [Path(p) for p in b[1]]) for b in split_blends(self.data_prefix)]

    @property
    def _per_split(self) -> bool:
        """``data_prefix`` names each split's data, read whole (no ``splits`` cut)."""
        return isinstance(self.data_prefix, Mapping)

    def _prefix(self) -> Path:
        """The built-in corpus's entry in the cache (``data_prefix`` null)."""
        return self._default_corpus_prefix()

    def _default_corpus_prefix(self) -> Path:
        """Where the built-in corpus, tokenized for this datamodule, is cached."""
        raise NotImplementedError

    def _preprocess_default_corpus(self, prefix: Path) -> None:
        """Tokenize the built-in corpus into ``prefix`` (called under the cache's file lock)."""
        raise NotImplementedError

    def _make_dataset(self, indexed: IndexedDataset, documents: range, num_samples: int | None) -> Dataset:
        """The dataset of ``documents`` of ``indexed`` with ``num_samples`` samples (None: one epoch)."""
        raise NotImplementedError

    def _build_default_corpus(self) -> None:
        """Preprocess the built-in corpus into the cache (under a file lock: one process builds)."""
        if self.data_prefix is not None:
            return
        prefix = self._prefix()
        with file_lock(prefix.parent / "build.lock"):
            if not index_file_path(prefix).is_file() or not vocab_sidecar_path(prefix).is_file():
                self._preprocess_default_corpus(prefix)

    @override
    def prepare_data(self) -> None:
        """Lightning runs this on one process per node before ``setup``: build the cache there."""
        self._build_default_corpus()

    # --- parallel layout --------------------------------------------------------------------------

    def num_microbatches(self, dp_size: int) -> int:
        """``global_batch_size // (micro_batch_size * dp_size)``; raises when it does not divide."""
        if dp_size < 1 or self.global_batch_size % (self.micro_batch_size * dp_size):
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size="
                             f"{self.micro_batch_size} * data_parallel_size={dp_size}")
        return self.global_batch_size // (self.micro_batch_size * dp_size)

    def _dp_coordinates(self) -> tuple[int, int]:
        trainer = self._trainer_or_none()
        state = getattr(trainer.strategy, "parallel_state", None) if trainer is not None else None
        return (int(state.dp_rank), int(state.dp_size)) if state is not None else (0, 1)

    def _trainer_or_none(self) -> Any:
        return getattr(self, "trainer", None)

    # --- datasets ---------------------------------------------------------------------------------

    @override
    def setup(self, stage: str | None = None) -> None:
        """Build the cache if ``prepare_data`` did not (rank 0 of the node, others wait at a
        barrier), open the indexed dataset and build the train/valid/test datasets."""
        if self.train_dataset is not None:
            return
        trainer = self._trainer_or_none()
        if trainer is None:
            self._build_default_corpus()
        else:
            if trainer.local_rank == 0:
                self._build_default_corpus()
            trainer.strategy.barrier("lightning_megatron.data.build")
        blends = self._split_blends()
        if self._per_split:  # each split's datasets whole
            self._sources = [None if blend is None else (*blend, [self._open(p, whole=split) for p in blend[1]])
                             for split, blend in enumerate(blends)]
        else:  # one blend, each dataset's documents cut by splits: opened once for every split
            weights, prefixes = blends[0]
            opened = [self._open(prefix) for prefix in prefixes]
            self._sources = [(weights, prefixes, opened)] * len(SPLIT_NAMES)
        self.train_dataset = self._split_dataset(0, self._samples_to_read(), "train")
        self.val_dataset = self._split_dataset(1, self.eval_samples, "valid")
        self.test_dataset = self._split_dataset(2, self.eval_samples, "test")

    def _split_dataset(self, split: int, num_samples: int | None, name: str) -> Dataset | None:
        """The dataset of one split (0 train, 1 valid, 2 test) of the opened prefixes, blended when there are
        several: ``num_samples`` samples (``None``: one epoch)."""
        assert self._sources, "setup() opens the prefixes"
        if self._sources[split] is None:
            return None  # a per-split data_prefix without this split: none, as asked
        weights, prefixes, splits = self._sources[split]
        if len(prefixes) == 1:
            indexed, split_docs = splits[0]
            return self._dataset(indexed, split_docs[split], num_samples, name)
        return self._blended(weights, prefixes, splits, split, num_samples, name)

    def _samples_to_read(self) -> int | None:
        """``train_samples``, else the samples the run reads by ``trainer.max_steps``: those consumed when it was
        restored plus ``global_batch_size`` per step left (``max_steps x global_batch_size`` for a run from the
        start, more when it resumes with a smaller global batch than it was trained with); None without
        ``max_steps`` (one epoch)."""
        if self.train_samples is not None:
            return self.train_samples
        trainer = self._trainer_or_none()
        if trainer is None or (trainer.max_steps or -1) <= 0:
            return None
        base_samples, base_step = self._restored
        return base_samples + max(0, trainer.max_steps - base_step) * self.global_batch_size

    def _open(self, prefix: Path, whole: int | None = None) -> tuple[IndexedDataset, list[range]]:
        """The indexed dataset at ``prefix``, checked (not empty, same vocabulary as the tokenizer,
        ids within the model's vocabulary), and its train/valid/test document ranges: cut by ``splits``, or
        (``whole``: a split's index) every document in that split, none in the others."""
        indexed = IndexedDataset(prefix)
        if indexed.num_documents == 0:
            raise ValueError(f"dataset {str(prefix)!r} holds no documents: preprocess it again from inputs that "
                             f"hold text")
        check_dataset_vocab(prefix, self.tokenizer, self._model_vocab_size(), needs_eod=self.documents_need_eod)
        if whole is not None:
            n = indexed.num_documents
            return indexed, [range(n) if i == whole else range(0) for i in range(len(SPLIT_NAMES))]
        bounds = get_train_valid_test_split_(self.splits, indexed.num_documents)
        return indexed, [range(bounds[i], bounds[i + 1]) for i in range(3)]

    def _blended(self, weights: list[float], prefixes: list[Path], splits: list[tuple[IndexedDataset, list[range]]],
                 split: int, size: int | None, name: str) -> BlendedDataset | None:
        """Megatron's blend of one split of every prefix: ``size`` samples (``None``: one epoch of
        each prefix's split, at least one global batch), each prefix built with the samples the
        blend takes from it."""
        parts = [(w, p, indexed, docs[split]) for w, p, (indexed, docs) in zip(weights, prefixes, splits)]
        empty = [str(p) for _, p, _, docs in parts if len(docs) == 0]
        if empty and name == "train":
            raise ValueError(f"splits={self.splits!r} leaves no training documents in {empty}; give train a "
                             f"weight or use more text")
        if empty:
            self._left_out[name] = f"the {name} blend leaves out {empty}: no {name} documents there"
            parts = [part for part in parts if str(part[1]) not in empty]
            if not parts:
                return None
        if size is None:
            one_epoch = [self._make_dataset(indexed, docs, None) for _, _, indexed, docs in parts]
            size = max(sum(len(d) for d in one_epoch), self.global_batch_size)
        total = sum(w for w, *_ in parts)  # what is left of the blend (a prefix left out): its weights, normalized
        counts = blend_num_samples([w / total for w, *_ in parts] if empty else [w for w, *_ in parts], size)
        datasets = [self._make_dataset(indexed, docs, count) for (_, _, indexed, docs), count in zip(parts, counts)]
        cache = Path(self.samples_cache_dir) if self.samples_cache_dir is not None else self.cache_dir / "blends"
        return BlendedDataset(datasets, [w for w, *_ in parts], size, cache_dir=cache,
                              names=[str(p) for _, p, _, _ in parts])

    def _model_vocab_size(self) -> int:
        """The vocabulary the model will have: its ``vocab_size`` (or ``hparams.vocab_size``) when set,
        else this tokenizer's (which the model then takes)."""
        trainer = self._trainer_or_none()
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        for source in (module, getattr(module, "hparams", None)):
            value = getattr(source, "vocab_size", None) if source is not None else None
            if isinstance(value, int):
                return value
        return self.tokenizer.vocab_size

    def _dataset(self, indexed: IndexedDataset, documents: range, num_samples: int | None,
                 name: str) -> Dataset | None:
        if len(documents) == 0:
            if name == "train":
                raise ValueError(f"splits={self.splits!r} leaves no training documents; give train a weight")
            if split_weights(self.splits)[("train", "valid", "test").index(name)] > 0:  # weight 0: none, as asked
                n = indexed.num_documents
                self._no_dataset[name] = (f"splits={self.splits!r} gives it none of the corpus's {n} "
                                          f"document{'s' if n != 1 else ''} (preprocess makes a document of each "
                                          f"JSON line, and of a .txt file's text between blank lines): give it more "
                                          f"documents, or weight 0 to run without it")
            return None
        try:
            dataset = self._make_dataset(indexed, documents, num_samples)
        except ValueError as error:
            if name == "train":
                raise ValueError(f"dataset {str(indexed.prefix)!r}, its train split ({len(documents)} of "
                                 f"{indexed.num_documents} documents, splits={self.splits!r}): {error}") from None
            self._no_dataset[name] = str(error)
            return None
        if num_samples is None and len(dataset) < self.global_batch_size:
            dataset = self._make_dataset(indexed, documents, self.global_batch_size)
        return dataset

    # --- loaders ----------------------------------------------------------------------------------

    @property
    def consumed_samples(self) -> int:
        """Training samples consumed so far: the count restored from a checkpoint plus
        ``global_batch_size`` per optimizer step taken since (exact even if the global batch
        size changed between runs)."""
        base_samples, base_step = self._restored
        trainer = self._trainer_or_none()
        if trainer is None:
            return base_samples
        return base_samples + (int(trainer.global_step) - base_step) * self.global_batch_size

    def _loader(self, dataset: Any, sampler: Any) -> DataLoader:
        return trainer_loader(dataset, sampler, self._trainer_or_none(), self.num_workers)

    @override
    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        needed = self._samples_to_read()
        if self.train_samples is None and needed is not None and needed > len(self.train_dataset):
            # set-up (before the checkpoint's state was restored) built max_steps x global_batch_size samples; a
            # run resumed with a smaller global batch reads past them, and the sampler's next pass starts at 0
            rank_zero_info(f"training data: {needed} samples ({self._restored[0]} consumed by step "
                           f"{self._restored[1]}, then {self.global_batch_size} a step to max_steps), not the "
                           f"{len(self.train_dataset)} built at set-up")
            self.train_dataset = self._split_dataset(0, needed, "train")
        order = getattr(self.train_dataset, "order_key", None)
        if self._restored_order is not None and order is not None and order != self._restored_order:
            rank_zero_warn(f"the training samples are in another order than the checkpoint's run read them "
                           f"({_epochs(self._restored_order)} -> {_epochs(order)} of the data): megatron-core's "
                           f"shuffle permutes the samples of all the epochs together, so this run reads on from sample "
                           f"{self._restored[0]} of its own order, some samples again and others not at all. To "
                           f"extend a run exactly, give data.train_samples the samples of the whole run from its "
                           f"start (its epochs then stay)")
            self._restored_order = None  # said once
        dp_rank, dp_size = self._dp_coordinates()
        common = dict(total_samples=len(self.train_dataset), consumed_samples=self.consumed_samples,
                      micro_batch_size=self.micro_batch_size, data_parallel_rank=dp_rank,
                      data_parallel_size=dp_size, num_microbatches=self.num_microbatches(dp_size))
        common["pass_steps"] = epoch_steps(self._trainer_or_none(), len(self.train_dataset) // self.global_batch_size)
        if self.shuffle != "random":
            sampler = MegatronPretrainingSampler(**common)
            return self._loader(self.train_dataset, count_the_resumed_pass(self._trainer_or_none(), sampler))
        # The run's order is its first DP size's buckets: resumed at another DP size, it reads the same global batches.
        restored = self._shuffle_key
        buckets = restored[2] if restored and self.global_batch_size % restored[2] == 0 else None
        sampler = count_the_resumed_pass(self._trainer_or_none(), MegatronPretrainingRandomSampler(
            seed=self.seed, buckets=buckets, run_consumed_samples=lambda: self.consumed_samples, **common))
        self._shuffle_key = list(sampler.order_key)
        if restored is not None and restored != self._shuffle_key:
            (seed, epoch, parts), now = restored, self._shuffle_key
            rank_zero_warn(f"data.shuffle='random': the training samples are in another order than the checkpoint's "
                           f"run read them (seed {seed}, an epoch of {epoch} samples in {parts} buckets -> seed "
                           f"{now[0]}, {now[1]} samples in {now[2]} buckets): this run reads on from sample "
                           f"{self._restored[0]} of its own order, some samples of the epoch again and others not at "
                           f"all. An epoch is data.train_samples (null: max_steps x global_batch_size) rounded down "
                           f"to whole global batches: a run goes on exactly with its seed, global batch and epoch")
        return self._loader(self.train_dataset, sampler)

    def _eval_loader(self, dataset: Dataset | None, name: str) -> DataLoader | list:
        if dataset is None:
            command = {"valid": "validate", "test": "test"}[name]
            fn = getattr(getattr(self._trainer_or_none(), "state", None), "fn", None)
            if fn is not None and getattr(fn, "value", fn) == command and name in self._no_dataset:
                # the command reads this split whole: nothing to read is its failure (it exited 0 having tested
                # nothing), not a note; during fit an evaluation split without samples is left out
                raise NoEvaluationData(f"`{command}` has no {name} dataset to read: {self._no_dataset[name]}")
            if fn is not None and getattr(fn, "value", fn) == command and self._per_split:
                raise NoEvaluationData(f"`{command}` has no {name} dataset to read: data_prefix names none (its "
                                       f"splits: {', '.join(self.data_prefix)}); add data_prefix.{name}")
            if name in self._no_dataset:  # every rank has the same data: said once
                rank_zero_warn(f"no {name} dataset: {self._no_dataset.pop(name)}")
            return []
        if name in self._left_out:
            rank_zero_warn(self._left_out.pop(name))
        dp_rank, dp_size = self._dp_coordinates()
        sampler = MegatronPretrainingSampler(
            total_samples=len(dataset), consumed_samples=0, micro_batch_size=self.micro_batch_size,
            data_parallel_rank=dp_rank, data_parallel_size=dp_size, num_microbatches=self.num_microbatches(dp_size))
        self._say_coverage(len(dataset), name)
        return self._loader(dataset, sampler)

    def _say_coverage(self, samples: int, name: str) -> None:
        """Once a split: what its evaluation scores when not the whole split (:func:`evaluation_coverage`: a
        limit on the batches, or the samples past its last whole global batch, which Megatron-LM's evaluation
        does not read either)."""
        limit = getattr(self._trainer_or_none(), "limit_val_batches" if name == "valid" else "limit_test_batches", None)
        said = evaluation_coverage(name, samples, self.global_batch_size, limit, padded=False,
                                   step=self.micro_batch_size * self._dp_coordinates()[1])
        if said is not None and name not in self._coverage_said:
            self._coverage_said.add(name)
            (rank_zero_warn if said[1] else rank_zero_info)(said[0])

    @override
    def val_dataloader(self) -> DataLoader | list:
        if self.train_dataset is None:
            self.setup("validate")
        return self._eval_loader(self.val_dataset, "valid")

    @override
    def test_dataloader(self) -> DataLoader | list:
        if self.train_dataset is None:
            self.setup("test")
        return self._eval_loader(self.test_dataset, "test")

    # --- checkpointing ----------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer_or_none()
        step = int(trainer.global_step) if trainer is not None else self._restored[1]
        state = {"consumed_samples": self.consumed_samples, "global_step": step}
        order = getattr(self.train_dataset, "order_key", None)
        if order is not None:
            state["train_order"] = order
        if self.shuffle == "random" and self._shuffle_key is not None:
            state["train_shuffle"] = self._shuffle_key
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = (int(state_dict["consumed_samples"]), int(state_dict.get("global_step", 0)))
        self._restored_order = state_dict.get("train_order")
        shuffle = state_dict.get("train_shuffle")
        known = isinstance(shuffle, (list, tuple)) and len(shuffle) == 3
        self._shuffle_key = [int(v) for v in shuffle] if known else None


class BertDataModule(PretrainingDataModule):
    """BERT pretraining data, Megatron's way (tokenizer: WordPiece, the packaged ``vocab.txt`` by default).

    Args:
        data_prefix: prefix of a preprocessed indexed dataset (``<prefix>.bin``/``.idx``, see
            ``lightning-megatron preprocess``); or a weighted blend ``[0.3, prefix_a, 0.7, prefix_b]``
            (Megatron's blending, :mod:`~lightning_megatron.data.blended`; each prefix is split into
            train/valid/test by ``splits`` on its own); or one of them per split, ``{train: ..., valid: ...,
            test: ...}``, each read whole by its split (Megatron-LM's ``--train-data-path`` ...; ``splits`` left
            out); ``None``: the built-in corpus, preprocessed once and cached under ``cache_dir``.
        vocab_file: WordPiece ``vocab.txt`` or ``tokenizer.json``; ``None``: the vocabulary the dataset
            was preprocessed with, as its ``<prefix>.vocab.json`` records it (the default vocabulary
            for the built-in corpus, :func:`~lightning_megatron.data.tokenizer.default_vocab_file`).
            Must be the vocabulary the dataset was preprocessed with.
        max_seq_length: tokens per sample, ``[CLS] A [SEP] B [SEP]`` plus padding.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        micro_batch_size: samples per forward/backward pass on one rank.
        seed: seed of the samples mapping, of every sample's masking and of the random sampler.
        masked_lm_prob: fraction of non-special tokens selected for MLM.
        short_seq_prob: probability of a sample with a shorter random target length.
        binary_head: ``"sop"`` (sentence order, Megatron's default), ``"nsp"`` (next sentence) or ``None``.
        whole_word_masking: mask all ``##`` pieces of a word together.
        max_ngrams: longest n-gram (in words) masked as one unit.
        splits: document split weights ``"train,valid,test"``, Megatron's ``"949,50,1"`` style.
        train_samples: length of the training set; ``None``: ``trainer.max_steps * global_batch_size``
            when a trainer with ``max_steps`` is attached (a resumed run: the samples consumed by its step plus
            ``global_batch_size`` per step left), else one epoch of the training documents.
        eval_samples: length of the validation and test sets; ``None``: one epoch of their documents
            (at least one global batch).
        shuffle: ``"sequential"`` (the samples mapping is already shuffled; Megatron's default) or
            ``"random"`` (additionally shuffled per epoch, in buckets of the run's first DP size: Megatron's per-rank
            buckets, kept when the run resumes at another DP size).
        num_workers: DataLoader worker processes (building and masking samples off the training
            process); ``None``: :func:`~lightning_megatron.data.loader.default_num_workers`
            (``min(4, cores per device - 1)`` where a device has 4 cores or more, else 0).
        cache_dir: where the built-in corpus is cached; ``None``: ``$LIGHTNING_MEGATRON_CACHE`` or
            ``~/.cache/lightning_megatron``.
        samples_cache_dir: where the samples mappings are cached (memory-mapped ``.npy``, one per
            split and configuration); ``None``: next to the dataset, or the default cache directory
            (``samples/``) when that directory is not writable.
        predict_file: what ``predict`` reads: ``None``, the test split; else a raw text file (one
            text per line) or a ``.jsonl`` file (its ``predict_json_key`` field), ``[MASK]`` allowed
            (:mod:`~lightning_megatron.data.predict`).
        predict_json_key: the JSONL field holding the text.
    """

    default_tokenizer = "wordpiece"

    def __init__(self, data_prefix: str | list[str | float] | dict[str, str | list[str | float]] | None = None,
                 vocab_file: str | None = None, *,
                 max_seq_length: int = 128, global_batch_size: int = 32, micro_batch_size: int = 8,
                 seed: int = 1234, masked_lm_prob: float = 0.15, short_seq_prob: float = 0.1,
                 binary_head: Literal["sop", "nsp"] | None = "sop", whole_word_masking: bool = True,
                 max_ngrams: int = 1, splits: str = "949,50,1", train_samples: int | None = None,
                 eval_samples: int | None = None, shuffle: Literal["sequential", "random"] = "sequential",
                 num_workers: int | None = None, cache_dir: str | None = None,
                 samples_cache_dir: str | None = None, predict_file: str | None = None,
                 predict_json_key: str = "text") -> None:
        super().__init__()
        if binary_head not in ("sop", "nsp", None):
            raise ValueError(f"binary_head={binary_head!r} must be 'sop', 'nsp' or None")
        if max_seq_length < 5:
            raise ValueError(f"max_seq_length={max_seq_length} cannot hold [CLS] A [SEP] B [SEP] with a token in "
                             f"each segment; use at least 5 (BERT recipes use 128 or 512)")
        self._init_common(data_prefix, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                          seed=seed, splits=splits, train_samples=train_samples, eval_samples=eval_samples,
                          shuffle=shuffle, num_workers=num_workers, cache_dir=cache_dir,
                          samples_cache_dir=samples_cache_dir)
        self.save_hyperparameters()
        self.vocab_file = vocab_file
        self.max_seq_length = max_seq_length
        self.predict_file, self.predict_json_key = predict_file, predict_json_key
        self._dataset_kwargs: dict[str, Any] = dict(
            max_seq_length=max_seq_length, seed=seed, masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob,
            binary_head=binary_head, whole_word_masking=whole_word_masking, max_ngrams=max_ngrams,
            samples_cache_dir=samples_cache_dir)

    # --- tokenizer and corpus -------------------------------------------------------------------

    @override
    def _default_corpus_prefix(self) -> Path:
        """Keyed by the corpus fingerprint, the vocabulary's contents and ``max_seq_length`` (long
        sentences are split to fit it)."""
        vocab_hash = hashlib.sha256(Path(self.tokenizer.vocab_file).read_bytes()).hexdigest()[:12]
        key = f"{default_corpus_fingerprint()}-{vocab_hash}-s{self.max_seq_length}"
        return self.cache_dir / f"default-corpus-{key}" / "corpus"

    @override
    def _preprocess_default_corpus(self, prefix: Path) -> None:
        preprocess_corpus(None, prefix, self.tokenizer, max_seq_length=self.max_seq_length)

    @override
    def _make_dataset(self, indexed: IndexedDataset, documents: range, num_samples: int | None) -> BertDataset:
        return BertDataset(indexed, self.tokenizer, documents=documents, num_samples=num_samples,
                           **self._dataset_kwargs)

    @override
    def predict_dataloader(self) -> DataLoader:
        """The test split, or ``predict_file``'s texts, every sample once in full global batches (the last
        padded with ``sample_index = -1``, which the PredictionWriter drops)."""
        from lightning_megatron.data.predict import IndexedSamples, PredictBatchSampler, TextPredictionDataset

        self.predict_dataset = None
        if self.predict_file is not None:
            dataset: Any = TextPredictionDataset(self.predict_file, self.tokenizer, self.max_seq_length,
                                                 self.predict_json_key)
            self.predict_dataset = dataset  # its texts' lines (the PredictionWriter's records name them)
            if dataset.cut_warning is not None:
                rank_zero_warn(dataset.cut_warning, category=UserWarning)
        else:
            if self.train_dataset is None:
                self.setup("predict")
            dataset = self.test_dataset
            if dataset is None and self._per_split:
                raise ValueError(f"data_prefix names no test dataset to predict ({', '.join(self.data_prefix)}): add "
                                 f"data_prefix.test or pass --data.predict_file")
            if dataset is None:
                raise ValueError(f"splits={self.splits!r} leaves no test documents to predict: give test a weight "
                                 f"or pass --data.predict_file")
            if "test" in self._left_out:
                rank_zero_warn(self._left_out.pop("test"))
        dp_rank, dp_size = self._dp_coordinates()
        sampler = PredictBatchSampler(total_samples=len(dataset), data_parallel_rank=dp_rank,
                                      data_parallel_size=dp_size,
                                      local_batch_size=self.micro_batch_size * self.num_microbatches(dp_size))
        return self._loader(IndexedSamples(dataset), sampler)

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # On the host, before the batch moves to the device: does any sample have padding? Answered here
        # (the data's hook, not the model's: Lightning warns when a model hook meets a datamodule), the
        # forward needs no device -> host sync to skip the attention mask.
        if isinstance(batch, dict) and "attention_mask" in batch:
            batch = {**batch, NO_PADDING: bool(batch["attention_mask"].all())}
        return batch


def _epochs(order: Any) -> str:
    """``3 epochs`` of an ``order_key`` (a GPT dataset's ``[epochs, separate_at]``; a blend's: each part's)."""
    if isinstance(order, list) and order and isinstance(order[0], int):
        return f"{order[0]} epoch{'s' if order[0] != 1 else ''}"
    return "epochs " + ", ".join(str(k[0]) if isinstance(k, list) and k else "-" for k in order)

