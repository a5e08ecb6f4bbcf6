"""BertDataModule: DP shares of the global batch, num_microbatches, and exact resume (also through Lightning)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from data_testing import data_cache_dir

from lightning_megatron.datamodules.pretraining import BertDataModule
from dist_utils import accelerator


def _fake_trainer(dp_rank=0, dp_size=1, global_step=0, max_steps=-1):
    state = SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size)
    strategy = SimpleNamespace(parallel_state=state, barrier=lambda name=None: None)
    return SimpleNamespace(strategy=strategy, global_step=global_step, max_steps=max_steps, local_rank=0)


def _datamodule(trainer=None, **kwargs) -> BertDataModule:
    kwargs = {"max_seq_length": 64, "global_batch_size": 8, "micro_batch_size": 2, "cache_dir": str(data_cache_dir()),
              **kwargs}
    dm = BertDataModule(**kwargs)
    dm.trainer = trainer
    return dm


def _first_batches(loader, n):
    return [batch for batch, _ in zip(loader, range(n))]


def test_dp1_and_dp2_together_cover_the_same_samples():
    dp1 = _datamodule(_fake_trainer())
    dp1.setup("fit")
    assert dp1.num_microbatches(1) == 4 and dp1.vocab_size == 30522
    reference = _first_batches(dp1.train_dataloader(), 3)
    assert all(b["tokens"].shape == (8, 64) for b in reference)
    ranks = []
    for rank in range(2):
        dm = _datamodule(_fake_trainer(dp_rank=rank, dp_size=2))
        dm.setup("fit")
        assert dm.num_microbatches(2) == 2
        ranks.append(_first_batches(dm.train_dataloader(), 3))
    for step in range(3):
        for key in reference[step]:
            assert torch.equal(torch.cat([ranks[0][step][key], ranks[1][step][key]]), reference[step][key])
    assert not torch.equal(reference[0]["tokens"], reference[1]["tokens"])


def test_num_microbatches_must_divide():
    dm = _datamodule()
    with pytest.raises(ValueError, match="global_batch_size=8 is not divisible by micro_batch_size=2 "
                                         r"\* data_parallel_size=3"):
        dm.num_microbatches(3)
    with pytest.raises(ValueError, match="global_batch_size=10 must be a positive multiple of micro_batch_size=4"):
        BertDataModule(global_batch_size=10, micro_batch_size=4)


def test_splits_and_sequence_length_are_checked_when_built():
    from lightning_megatron.datamodules.pretraining import BertDataModule

    with pytest.raises(ValueError, match=r"splits='100,0,0,5' has 4 weights; give at most three"):
        BertDataModule(splits="100,0,0,5")
    with pytest.raises(ValueError, match="max_seq_length=2 cannot hold"):
        BertDataModule(max_seq_length=2)


def test_consumed_samples_from_global_step_and_state_dict():
    uninterrupted = _datamodule(_fake_trainer())
    uninterrupted.setup("fit")
    stream = _first_batches(uninterrupted.train_dataloader(), 5)

    at_step3 = _datamodule(_fake_trainer(global_step=3))
    at_step3.setup("fit")
    assert torch.equal(next(iter(at_step3.train_dataloader()))["tokens"], stream[3]["tokens"])
    state = at_step3.state_dict()
    assert state == {"consumed_samples": 24, "global_step": 3}

    # A resumed run whose global batch was 4 before: the restored count wins over step * batch.
    resumed = _datamodule(_fake_trainer(global_step=6))
    resumed.load_state_dict({"consumed_samples": 24, "global_step": 6})
    resumed.setup("fit")
    assert resumed.consumed_samples == 24
    assert torch.equal(next(iter(resumed.train_dataloader()))["tokens"], stream[3]["tokens"])
    resumed.trainer.global_step = 7
    assert resumed.state_dict() == {"consumed_samples": 32, "global_step": 7}


def test_a_shuffled_run_resumed_at_another_dp_size_reads_its_global_batches():
    """``shuffle: random``: a run at DP=2 saved after 2 steps and resumed at DP=1 and DP=4 (the same global batch of 8)
    reads, step by step, the samples the DP=2 run read next, across the ranks in order: the checkpoint records the
    order (seed, epoch, buckets), which the DP size does not change. A resume whose epoch changed (train_samples
    null and a larger max_steps: the epoch is the whole run) is in another order, and says so once."""

    def run(dp_size, global_step=0, state=None, steps=3, max_steps=12, micro=2):
        ranks = []
        for rank in range(dp_size):
            dm = _datamodule(_fake_trainer(rank, dp_size, global_step, max_steps), shuffle="random",
                             micro_batch_size=micro)
            if state is not None:
                dm.load_state_dict(state)
            dm.setup("fit")
            ranks.append(_first_batches(dm.train_dataloader(), steps))
        return dm, [torch.cat([r[step]["tokens"] for r in ranks]) for step in range(steps)]

    dm, full = run(2, steps=5)
    dm.trainer.global_step = 2
    state = dm.state_dict()
    assert state == {"consumed_samples": 16, "global_step": 2, "train_shuffle": [1234, 96, 2]}
    for dp, micro in ((1, 2), (4, 2), (4, 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same order: nothing to say
            _, resumed = run(dp, 2, state, micro=micro)
        assert all(torch.equal(a, b) for a, b in zip(resumed, full[2:])), (dp, micro)
    with pytest.warns(UserWarning, match=r"another order .* an epoch of 96 samples in 2 buckets -> seed 1234, 160 "
                                         r"samples in 2 buckets\): this run reads on from sample 16"):
        dm, _ = run(2, 2, state, steps=1, max_steps=20)
    assert dm.state_dict()["train_shuffle"] == [1234, 160, 2]


class _Recorder(pl.LightningModule):
    """Consumes batches without learning anything; records the first token of each sample."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["tokens"][:, :8].tolist())
        return (self.weight * batch["loss_mask"].sum()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(max_steps, tmp_path, ckpt_path=None, **data):
    model = _Recorder()
    dm = _datamodule(splits="100,0,0", **data)
    trainer = pl.Trainer(max_steps=max_steps, accelerator=accelerator(), devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, model


def test_lightning_resume_continues_the_sample_stream(tmp_path):
    _, full = _fit(5, tmp_path / "full")
    trainer, first = _fit(2, tmp_path / "first")
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    assert torch.load(tmp_path / "step2.ckpt", weights_only=False)["BertDataModule"]["consumed_samples"] == 16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, second = _fit(5, tmp_path / "second", ckpt_path=tmp_path / "step2.ckpt")
    assert not [w for w in caught if "not resumable" in str(w.message)]
    assert len(full.seen) == 5 and first.seen + second.seen == full.seen
    # Resumed with a smaller global batch (4, from 8): the training set is the samples the run reads by max_steps
    # (16 consumed + 3 steps x 4), not max_steps x 4 = 20, so it goes on with samples 16..27 of the stream (the
    # mapping's first rows are the same for any length): it read samples 16..19, then 0..7 again, unsaid
    trainer, smaller = _fit(5, tmp_path / "smaller", ckpt_path=tmp_path / "step2.ckpt", global_batch_size=4)
    stream = [sample for batch in full.seen for sample in batch]
    assert [sample for batch in smaller.seen for sample in batch] == stream[16:28], smaller.seen
    assert trainer.datamodule.state_dict() == {"consumed_samples": 28, "global_step": 5}


def test_a_resume_with_a_larger_global_batch_or_in_a_later_pass_continues_the_stream(tmp_path):
    """Resumed from the checkpoints a ModelCheckpoint saved at a step's end (the CLI's). With a larger global batch
    (4 steps of 4 samples, then 8 a step): Lightning counted the interrupted epoch in the checkpoint's batches and
    ended it at 6 of 6 steps of 8, two early, then read the next pass from sample 0: samples 16..23 again and 40..47
    never, unsaid. In the second pass of a training set smaller than the run (16 samples, 8 a step), the sampler
    started at sample 24 of 16 and read nothing of the pass (an epoch-bounded fit resumed there ended at once,
    status 0), and under limit_train_batches the resumed pass started past the epoch's samples. Each reads on from
    where it stopped now, as the uninterrupted run does."""
    epochs = []  # each fit's epoch and batch index at its end

    def fit(max_steps, root, ckpt_path=None, every=None, limit=None, **data):
        model = _Recorder()
        saves = [pl.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1)] if every else []
        trainer = pl.Trainer(max_steps=max_steps, accelerator=accelerator(), devices=1, logger=False, callbacks=saves,
                             enable_checkpointing=bool(every), enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=root, num_sanity_val_steps=0, limit_train_batches=limit)
        trainer.fit(model, datamodule=_datamodule(splits="100,0,0", **data), ckpt_path=ckpt_path)
        epochs.append((trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx))
        return [sample for batch in model.seen for sample in batch]

    stream = fit(12, tmp_path / "full", global_batch_size=4, train_samples=48)
    assert fit(4, tmp_path / "first", every=4, global_batch_size=4, train_samples=48) == stream[:16]
    step4 = tmp_path / "first" / "epoch=0-step=4.ckpt"
    assert fit(8, tmp_path / "larger", ckpt_path=step4, global_batch_size=8, train_samples=48) == stream[16:48]
    passes = fit(5, tmp_path / "passes", train_samples=16)
    assert passes[:16] == passes[16:32] and passes[32:] == passes[:8]  # 2 steps a pass, the same each pass
    assert fit(3, tmp_path / "pass2", every=3, train_samples=16) == passes[:24]
    step3 = tmp_path / "pass2" / "epoch=1-step=3.ckpt"
    assert fit(5, tmp_path / "pass2_resumed", ckpt_path=step3, train_samples=16) == passes[24:]
    # limit_train_batches=2 of 6 steps a pass: each epoch reads the pass's first 2 steps, a resumed one too (it read
    # on from sample 24 of the pass)
    assert fit(5, tmp_path / "limited", every=3, limit=2, train_samples=48) == passes
    step3 = tmp_path / "limited" / "epoch=1-step=3.ckpt"
    assert fit(5, tmp_path / "limited_resumed", ckpt_path=step3, limit=2, train_samples=48) == passes[24:]
    # shuffled, with DataLoader workers, under that limit: the workers drew batches past the epoch's 2 steps, and the
    # sampler's count of them made the uninterrupted run's next epoch skip the ones never trained on; a resumed run,
    # counting steps, read them
    shuffled = dict(limit=2, shuffle="random", train_samples=48, num_workers=2)
    stream = fit(5, tmp_path / "shuffled", every=3, **shuffled)
    step3 = tmp_path / "shuffled" / "epoch=1-step=3.ckpt"
    assert fit(5, tmp_path / "shuffled_resumed", ckpt_path=step3, **shuffled) == stream[24:]
    assert epochs[-1] == epochs[-2], epochs  # its epochs the uninterrupted run's: 2 steps each, not the sampler's 6


def test_reading_batches_leaves_the_global_rng_alone():
    """Dropout on a CPU draws from torch's global generator, which a DataLoader without a generator of its own
    draws each iterator's base seed from: an evaluation (a new iterator) shifted the next training step's dropout,
    and a resumed run (a new iterator after the checkpoint's RNG states were restored) never matched the
    uninterrupted one. The datamodules' loaders draw from their own."""
    dm = _datamodule(_fake_trainer())
    dm.setup("fit")
    state = torch.get_rng_state()
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.val_dataloader()):
        next(iter(loader))
    assert torch.equal(torch.get_rng_state(), state)


def test_eval_loaders_repeat_the_same_batches():
    dm = _datamodule(_fake_trainer(dp_rank=1, dp_size=2))
    dm.setup("validate")
    loader = dm.val_dataloader()
    first, second = list(loader), list(loader)
    assert len(first) == len(loader) >= 1 and all(b["tokens"].shape == (4, 64) for b in first)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(first, second))
    assert len(dm.test_dataset) >= dm.global_batch_size  # a tiny split still gives one global batch


def test_an_evaluation_says_the_samples_past_its_last_whole_global_batch_are_not_scored(caplog):
    """Validation and test read whole global batches (Megatron-LM's evaluation): of a split of 111 samples, global
    batch 8, 104 are scored. With the whole split asked for (``limit_val_batches`` 1.0, the default) that is said
    once (the audit measured a GPT val_loss 0.0019 off the whole split's, unsaid, while the docs said "the whole
    split"); with the batches limited, how many are scored is said instead (0.5 scored 1 of 3 GPT batches,
    unsaid)."""
    import logging
    import warnings

    caplog.set_level(logging.INFO)
    for limit, said in ((1.0, True), (13, False), (14, True), (0.5, False), (2, False)):
        caplog.clear()
        trainer = _fake_trainer(dp_rank=0, dp_size=2)
        trainer.limit_val_batches = limit
        dm = _datamodule(trainer)
        dm.setup("validate")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = dm.val_dataloader()
            dm.val_dataloader()  # every validation of a fit asks again: said once
        assert len(dm.val_dataset) == 111 and len(loader) == 13, (len(dm.val_dataset), len(loader))
        messages = [str(w.message) for w in caught]
        assert messages == ([
            "the valid split's 111 samples are read in whole global batches of 8, as Megatron-LM's evaluation reads "
            "them: 104 are scored and the last 7 are not; a global batch that divides 111 scores them all"]
            if said else []), (limit, messages)
        infos = [r.getMessage() for r in caplog.records if "split" in r.getMessage()]
        scored = {0.5: 6, 2: 2}.get(limit)
        assert infos == ([f"the valid split: limit_val_batches={limit} scores {scored} of its 13 global batches of 8 "
                          f"({scored * 8} of 111 samples)"] if scored else []), (limit, infos)


def test_short_seq_prob_reaches_the_samples():
    """short_seq_prob=0.0: every sample targets the full max_num_tokens (= max_seq_length - 3); 1.0: every
    target is a random shorter one (uniform in [2, max_num_tokens]) and the samples the datamodule's
    loader yields are no longer than it (the default 0.1 of every other test would not show it)."""
    lengths, targets = {}, {}
    for prob in (0.0, 1.0):
        dm = _datamodule(_fake_trainer(), short_seq_prob=prob, train_samples=128)
        dm.setup("fit")
        batches = _first_batches(dm.train_dataloader(), 128 // 8)
        lengths[prob] = torch.cat([b["attention_mask"].sum(-1) for b in batches])
        targets[prob] = torch.as_tensor(dm.train_dataset.samples_mapping[:128, 2].astype("int64"))
    full = 64 - 3
    assert (targets[0.0] == full).all(), targets[0.0]
    assert (targets[1.0] < full).float().mean() > 0.9 and len(set(targets[1.0].tolist())) > 20, targets[1.0]
    assert (targets[1.0] >= 2).all()
    # the loader's samples in order: [CLS] A [SEP] B [SEP] truncated to the target
    assert (lengths[1.0] <= targets[1.0] + 3).all() and (lengths[0.0] <= 64).all()
    assert lengths[1.0].float().mean() < 0.75 * lengths[0.0].float().mean(), (lengths[0.0], lengths[1.0])


def test_a_split_too_small_for_a_document_says_so_where_validation_asks():
    """A corpus too small to give the validation split one document (a preprocessed text without blank lines is
    one document) ran no validation, with only Lightning's "Total length of `list` across ranks is zero". The
    loader says why, once; a split given no weight is not validated, as asked, and says nothing."""
    dm = _datamodule(_fake_trainer(), splits="1000000,1,0")
    dm.setup("fit")
    with pytest.warns(UserWarning, match=r"no valid dataset: splits='1000000,1,0' gives it none of the corpus's "
                                         r"\d+ documents"):
        assert dm.val_dataloader() == []
    quiet = _datamodule(_fake_trainer(), splits="100,0,0")
    quiet.setup("fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quiet.val_dataloader() == []


@pytest.mark.parametrize("rank", [0, 1])
def test_predict_texts_cut_to_the_sequence_are_said_once_by_rank_0(tmp_path, monkeypatch, rank):
    """A predict_file whose texts are longer than max_seq_length is said once per run: by rank 0 (each rank
    builds the dataset; at TP=2 the warning came twice)."""
    from lightning.pytorch.utilities import rank_zero_only

    texts = tmp_path / "texts.txt"
    texts.write_text("a short text\n" + " ".join(["word"] * 100) + "\n")
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    dm = _datamodule(_fake_trainer(), predict_file=str(texts))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.predict_dataloader()
    said = [str(w.message) for w in caught if "are longer than max_seq_length" in str(w.message)]
    assert said == ([f"1 of the 2 texts of {str(texts)!r} are longer than max_seq_length=64 tokens with [CLS] and "
                     f"[SEP]: their ends are cut"] if rank == 0 else []), said
