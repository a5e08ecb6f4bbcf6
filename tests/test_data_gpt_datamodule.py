"""GPTDataModule: the built-in corpus with EOD, batches of the decoder contract, exact resume, blends, and
the checks that refuse a dataset without EOD or made with another vocabulary."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from data_testing import data_cache_dir

from lightning_megatron.data.blended import BlendedDataset
from lightning_megatron.data.bpe_tokenizer import BPETokenizer
from lightning_megatron.datamodules.gpt import GPTDataModule
from lightning_megatron.data.gpt_dataset import GPTDataset
from lightning_megatron.data.dataset_vocab import write_dataset_vocab
from lightning_megatron.data.indexed_dataset import IndexedDataset
from lightning_megatron.data.preprocess import preprocess_corpus


def _trainer(global_step=0, dp_rank=0, dp_size=1):
    state = SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size)
    strategy = SimpleNamespace(parallel_state=state, barrier=lambda name=None: None)
    return SimpleNamespace(strategy=strategy, global_step=global_step, max_steps=-1, local_rank=0)


def _corpus(path, topic: str, n: int):
    path.write_text("\n\n".join(f"{topic} document {d} begins here. It goes on about {topic} for a while. "
                                f"Document {d} ends." for d in range(n)) + "\n")
    return path


def _prefix(tmp_path, name, n, append_eod=True):
    prefix = tmp_path / name / "ds"
    preprocess_corpus([_corpus(tmp_path / f"{name}.txt", name, n)], prefix, BPETokenizer(), max_seq_length=64,
                      append_eod=append_eod)
    return str(prefix)


def _datamodule(data_prefix, step=0, state=None, **kwargs):
    kwargs = dict(seq_length=32, global_batch_size=8, micro_batch_size=2, cache_dir=str(data_cache_dir()), **kwargs)
    dm = GPTDataModule(data_prefix, **kwargs)
    dm.trainer = _trainer(global_step=step)
    if state is not None:
        dm.load_state_dict(state)
    dm.setup("fit")
    return dm


def test_builtin_corpus_gives_batches_of_the_decoder_contract():
    dm = _datamodule(None, train_samples=64)
    assert isinstance(dm.tokenizer, BPETokenizer) and dm.vocab_size == 8192 and dm.tokenizer.eod == 0
    indexed = dm.train_dataset.indexed_dataset
    ends = np.cumsum(indexed.sizes)[np.asarray(indexed.doc_idx[1:]) - 1]
    assert np.all(indexed._data[ends - 1] == dm.tokenizer.eod), "every document ends with EOD"
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"tokens", "labels", "loss_mask"}
    assert batch["tokens"].shape == batch["labels"].shape == batch["loss_mask"].shape == (8, 32)
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1]) and bool(batch["loss_mask"].all())
    assert (batch["tokens"] == dm.tokenizer.eod).any(), "samples cross document ends"
    assert len(dm.train_dataset) == 64 and len(dm.val_dataset) >= 8


def test_resume_and_eod_mask_loss(tmp_path):
    prefix = _prefix(tmp_path, "alpha", 120)
    dm = _datamodule(prefix, splits="100,0,0", train_samples=80, eod_mask_loss=True)
    assert isinstance(dm.train_dataset, GPTDataset) and dm.val_dataset is None
    stream = [b for b, _ in zip(dm.train_dataloader(), range(6))]
    eod = stream[0]["tokens"] == dm.tokenizer.eod
    assert eod.any() and torch.equal(stream[0]["loss_mask"] == 0, eod)
    resumed = _datamodule(prefix, step=9, state={"consumed_samples": 32, "global_step": 9}, splits="100,0,0",
                          train_samples=80, eod_mask_loss=True)
    assert resumed.consumed_samples == 32
    after = [b for b, _ in zip(resumed.train_dataloader(), range(2))]
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(after, stream[4:6]))


def test_blend_of_two_prefixes(tmp_path):
    prefixes = [_prefix(tmp_path, "alpha", 60), _prefix(tmp_path, "beta", 40)]
    dm = _datamodule([0.3, prefixes[0], 0.7, prefixes[1]], splits="8,1,1", train_samples=100)
    train = dm.train_dataset
    assert isinstance(train, BlendedDataset) and len(train) == 100
    assert [list(d.documents) for d in train.datasets] == [list(range(48)), list(range(32))]
    for i in (0, 1, 50, 99):
        record = train.index[i]
        assert torch.equal(train[i]["tokens"], train.datasets[int(record["dataset"])][int(record["sample"])]["tokens"])


def test_refuses_data_without_eod_or_from_another_vocabulary(tmp_path):
    no_eod = _prefix(tmp_path, "plain", 30, append_eod=False)
    with pytest.raises(ValueError, match="was preprocessed without --append-eod: GPT samples join documents"):
        _datamodule(no_eod)  # its record says so
    write_dataset_vocab(no_eod, BPETokenizer())  # a record that does not say (another tool's data): read the ends
    with pytest.raises(ValueError, match="does not end with the end-of-document id 0.*append-eod"):
        _datamodule(no_eod)
    other_vocab = tmp_path / "vocab.txt"
    other_vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghij")) + "\n")
    with pytest.raises(ValueError, match="tokenized with another vocabulary"):
        _datamodule(_prefix(tmp_path, "alpha", 30), vocab_file=str(other_vocab))
    with pytest.raises(ValueError, match="seq_length=1"):
        GPTDataModule(seq_length=1)
    # the train split too short for one sample (the whole dataset is not): named with its split
    short = _prefix(tmp_path, "short", 30)
    tokens = IndexedDataset(short).num_tokens
    with pytest.raises(ValueError, match=rf"dataset '{short}', its train split \(15 of 30 documents, "
                                         rf"splits='50,50,0'\): the documents hold \d+ tokens, fewer than "
                                         rf"seq_length \+ 1 = {tokens - 1}"):
        dm = GPTDataModule(short, seq_length=tokens - 2, splits="50,50,0", global_batch_size=8, micro_batch_size=2,
                           cache_dir=str(data_cache_dir()))
        dm.trainer = _trainer(global_step=0)
        dm.setup("fit")
    assert IndexedDataset(no_eod).num_documents == 30


def test_validate_or_test_of_a_split_without_samples_is_an_error(tmp_path):
    """`lightning-megatron test` of data whose test split holds no sample (the built-in corpus's 42 tokens at
    seq_length 128) warned "no test dataset" and exited 0 having tested nothing: a script checking the exit status
    took it for a pass. `validate` / `test` raise, naming the split and why; during `fit`, an evaluation split
    without samples is still left out with the warning."""
    from lightning.pytorch.trainer.states import TrainerFn

    prefix = _prefix(tmp_path, "alpha", 30)
    for fn, loader, name in ((TrainerFn.TESTING, "test_dataloader", "test"),
                             (TrainerFn.VALIDATING, "val_dataloader", "valid")):
        dm = GPTDataModule(prefix, seq_length=32, global_batch_size=8, micro_batch_size=2, splits="96,2,2",
                           cache_dir=str(data_cache_dir()))
        dm.trainer = _trainer()
        dm.trainer.state = SimpleNamespace(fn=fn)
        dm.setup(fn.value)
        with pytest.raises(ValueError, match=rf"`{fn.value}` has no {name} dataset to read: the documents hold "
                                             rf"\d+ tokens, fewer than seq_length \+ 1 = 33"):
            getattr(dm, loader)()
    dm.trainer.state = SimpleNamespace(fn=TrainerFn.FITTING)
    with pytest.warns(UserWarning, match="no valid dataset"):
        assert dm.val_dataloader() == []


def test_a_resume_that_reorders_the_samples_says_so(tmp_path):
    """megatron-core's GPT shuffle permutes the samples of all the epochs together: a run resumed with more epochs
    (a raised max_steps, here train_samples) reads on in another order, some samples again. Said once at the resume;
    more samples within the same epochs keep the order (the resumed batches are the first run's) and say nothing."""
    import warnings

    prefix = _prefix(tmp_path, "alpha", 120)
    first = _datamodule(prefix, splits="100,0,0", train_samples=40)
    epoch = GPTDataset(first.train_dataset.indexed_dataset, documents=first.train_dataset.documents, seq_length=32,
                       seed=first.seed, eod_id=0, samples_cache_dir=False, num_epochs=1)
    assert len(epoch) > 48, len(epoch)  # one epoch holds the first run and the longer one below
    stream = [b for b, _ in zip(first.train_dataloader(), range(4))]
    first.trainer.global_step = 2
    state = first.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = _datamodule(prefix, step=2, state=state, splits="100,0,0", train_samples=48)
        after = [b for b, _ in zip(same.train_dataloader(), range(2))]
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(after, stream[2:4]))
    longer = _datamodule(prefix, step=2, state=state, splits="100,0,0", train_samples=3 * len(epoch))
    with pytest.warns(UserWarning, match=r"the training samples are in another order than the checkpoint's run read "
                                         r"them \(1 epoch -> 3 epochs of the data\)"):
        longer.train_dataloader()


def test_a_dataset_per_split_is_read_whole_by_its_split(tmp_path):
    """``data_prefix: {train: ..., valid: ..., test: ...}`` (Megatron-LM's --train-data-path / --valid-data-path /
    --test-data-path; NeMo's per-split data_prefix): each split reads its own path or blend whole, and no other's. The
    texts tell which dataset a sample came from: every training sample decodes to the training corpora's words only,
    every validation sample to the held-out text's. A split without an entry has no dataset (`validate` says so);
    misspelled keys, a missing train entry and `splits` beside a per-split prefix are refused by name, as is a path
    the pre-launch check cannot find; the tokenizer is the train data's."""
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_megatron.data_checks import data_files_problems
    from lightning_megatron.datamodules.pretraining import NoEvaluationData

    alpha, beta = _prefix(tmp_path, "alpha", 60), _prefix(tmp_path, "beta", 40)
    held, final = _prefix(tmp_path, "held", 12), _prefix(tmp_path, "final", 10)
    dm = _datamodule({"train": [0.3, alpha, 0.7, beta], "valid": held, "test": final}, train_samples=100)
    assert isinstance(dm.train_dataset, BlendedDataset) and len(dm.train_dataset) == 100
    assert [list(d.documents) for d in dm.train_dataset.datasets] == [list(range(60)), list(range(40))]

    def words(dataset):
        return {w for i in range(len(dataset)) for w in ("alpha", "beta", "held", "final")
                if w in dm.tokenizer.detokenize(dataset[i]["tokens"].tolist())}

    assert words(dm.train_dataset) == {"alpha", "beta"}
    assert words(dm.val_dataset) == {"held"} and words(dm.test_dataset) == {"final"}
    assert sorted(dm.val_dataset.documents) == list(range(12)) and sorted(dm.test_dataset.documents) == list(range(10))
    assert len(dm.val_dataset) >= 8  # one epoch of the held-out text, at least a global batch

    only_train = _datamodule({"train": alpha}, train_samples=16)
    assert only_train.val_dataset is None and only_train.test_dataset is None
    only_train.trainer.state = SimpleNamespace(fn=TrainerFn.FITTING)
    assert only_train.val_dataloader() == []  # none, as asked: no warning
    only_train.trainer.state = SimpleNamespace(fn=TrainerFn.VALIDATING)
    with pytest.raises(NoEvaluationData, match=r"`validate` has no valid dataset to read: data_prefix names none "
                                               r"\(its splits: train\)"):
        only_train.val_dataloader()
    with pytest.raises(ValueError, match=r"data_prefix: 'validation' is not a split: use train, valid and test"):
        GPTDataModule({"train": alpha, "validation": held})
    with pytest.raises(ValueError, match=r"data_prefix per split needs a train entry"):
        GPTDataModule({"valid": held})
    with pytest.raises(ValueError, match=r"splits='90,5,5' cuts one data_prefix into splits.*leave splits out"):
        GPTDataModule({"train": alpha, "valid": held}, splits="90,5,5")
    # before launch: every split's files, and the split a command reads whole
    d = {"data_prefix": {"train": alpha, "valid": str(tmp_path / "nope")}, "seq_length": 32}
    (problem,) = data_files_problems(d, {}, data_class=GPTDataModule)
    assert f"data_prefix={str(tmp_path / 'nope')!r}" in problem and "not found" in problem, problem
    d["data_prefix"] = {"train": alpha, "valid": held}
    assert data_files_problems(d, {}, data_class=GPTDataModule, split="valid") == []
    (problem,) = data_files_problems(d, {}, data_class=GPTDataModule, split="test")
    assert "data_prefix names no test dataset" in problem and "`test` would have nothing to read" in problem, problem
    d["data_prefix"]["test"], d["seq_length"] = final, 400  # the test text holds fewer tokens than a sample
    problems = data_files_problems(d, {}, data_class=GPTDataModule, split="test")
    assert any(p.startswith("data data_prefix.test gives the test split 10 of the 10 documents") and
               "fewer than one sample's seq_length + 1 = 401" in p for p in problems), problems
    from lightning_megatron.data.dataset_vocab import trained_vocabulary

    assert trained_vocabulary({"data_prefix": {"train": [0.5, alpha, 0.5, beta], "valid": held}}) == \
        trained_vocabulary({"data_prefix": alpha})  # the run's vocabulary: its training data's record
