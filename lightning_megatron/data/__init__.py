"""Data, Megatron's way: WordPiece and byte-level BPE tokenizers, built-in corpus, memory-mapped indexed dataset,
BERT samples with MLM + sentence-order masking, GPT samples, blends, consumed-samples samplers and their loader,
prediction datasets, and labelled-text readers for fine-tuning (:mod:`~lightning_megatron.data.labelled_text`).

Nothing here imports Lightning (tests/test_import_graph.py holds it to that). The LightningDataModules over
these pieces (``BertDataModule``, ``GPTDataModule``, ``LabelledTextDataModule``) are in
:mod:`lightning_megatron.datamodules`. See ``docs/data.md``.
"""

from __future__ import annotations

from lightning_megatron.data.bert_dataset import BertDataset, create_masked_lm_predictions, get_train_valid_test_split_
from lightning_megatron.data.blended import BlendedDataset, build_blending_indices, parse_data_prefix, split_blends
from lightning_megatron.data.bpe_tokenizer import BPETokenizer, packaged_bpe_tokenizer_file, train_bpe_tokenizer
from lightning_megatron.data.corpus import CorpusStats, default_corpus_documents, read_documents, split_sentences
from lightning_megatron.data.dataset_vocab import (
    DatasetVocab,
    check_dataset_vocab,
    read_dataset_vocab,
    vocab_sha256,
    write_dataset_vocab,
)
from lightning_megatron.data.gpt_dataset import GPTDataset, build_gpt_indices
from lightning_megatron.data.indexed_dataset import CorruptIndexedDatasetError, IndexedDataset, IndexedDatasetBuilder
from lightning_megatron.data.loader import MegatronDataLoader, default_num_workers
from lightning_megatron.data.preprocess import PreprocessStats, preprocess_corpus
from lightning_megatron.data.samples_index import build_samples_mapping, cached_samples_mapping
from lightning_megatron.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler
from lightning_megatron.data.tokenizer import (
    BertTokenizer,
    default_vocab_file,
    load_tokenizer,
    packaged_vocab_file,
    train_wordpiece_tokenizer,
)

__all__ = [
    "BertDataset",
    "BertTokenizer",
    "BlendedDataset",
    "BPETokenizer",
    "CorpusStats",
    "CorruptIndexedDatasetError",
    "DatasetVocab",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronDataLoader",
    "MegatronPretrainingRandomSampler",
    "MegatronPretrainingSampler",
    "PreprocessStats",
    "build_blending_indices",
    "build_gpt_indices",
    "build_samples_mapping",
    "check_dataset_vocab",
    "cached_samples_mapping",
    "create_masked_lm_predictions",
    "default_corpus_documents",
    "default_num_workers",
    "default_vocab_file",
    "packaged_vocab_file",
    "get_train_valid_test_split_",
    "load_tokenizer",
    "packaged_bpe_tokenizer_file",
    "parse_data_prefix",
    "split_blends",
    "preprocess_corpus",
    "read_dataset_vocab",
    "read_documents",
    "split_sentences",
    "train_bpe_tokenizer",
    "train_wordpiece_tokenizer",
    "vocab_sha256",
    "write_dataset_vocab",
]

