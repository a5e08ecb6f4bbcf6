"""A checkpoint records the vocabulary its data was tokenized with, and a run whose data is tokenized with another
vocabulary of the same size is refused: on resume, on evaluation of the checkpoint and on ``init_from`` (an SFT of
a base pretrained on one's own BPE with the recipe's ``tokenizer: null`` trained on valid ids of other pieces, and
nothing else noticed). Through a Lightning ``Trainer`` on one rank, chats from ``SFTDataModule``; the refusal before
launch reads the same record (``check_config``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from megatron_testing import error_of, make_trainer

TINY = dict(num_layers=1, hidden_size=32, num_attention_heads=2, max_sequence_length=32, hidden_dropout=0.0,
            attention_dropout=0.0)


def _swapped_tokenizer(folder: Path) -> Path:
    """The packaged BPE with the ids of two ordinary pieces exchanged: the same size, other meanings."""
    from lightning_megatron.data.bpe_tokenizer import packaged_bpe_tokenizer_file

    spec = json.loads(packaged_bpe_tokenizer_file().read_text())
    vocab = spec["model"]["vocab"]
    a, b = (piece for piece, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def _worker(root: str) -> dict:
    from lightning_megatron.datamodules.sft import SFTDataModule
    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    root_p = Path(root)
    other = str(root_p / "swapped")

    def run(max_steps: int, tokenizer: str | None, seed: int = 1234, **model):
        trainer = make_trainer(MegatronStrategy(micro_batch_size=2), 1, max_steps, limit_val_batches=1)
        data = SFTDataModule(tokenizer=tokenizer, seq_length=32, global_batch_size=2, micro_batch_size=2, seed=seed)
        return trainer, data, GPTLightningModule(dict(TINY), lr=1e-3, **model)

    out: dict = {}
    trainer, data, module = run(1, None)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(root_p / "base.ckpt")
    base = str(root_p / "base.ckpt")
    trainer, data, module = run(2, other)
    out["resume"] = error_of(lambda: trainer.fit(module, datamodule=data, ckpt_path=base))
    trainer, data, module = run(0, other)
    out["validate"] = error_of(lambda: trainer.validate(module, datamodule=data, ckpt_path=base, verbose=False))
    trainer, data, module = run(1, other, init_from=base)
    out["init_from"] = error_of(lambda: trainer.fit(module, datamodule=data))
    trainer, data, module = run(1, None, init_from=base)
    out["init_from_same"] = error_of(lambda: trainer.fit(module, datamodule=data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, data, module = run(2, None)
        out["resume_same"] = error_of(lambda: trainer.fit(module, datamodule=data, ckpt_path=base))
        out["resume_same_data_warnings"] = [str(w.message) for w in caught if "data section" in str(w.message)]
    # another data section on resume (a forgotten --data.data_prefix takes the built-in corpus): said, not refused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, data, module = run(2, None, seed=7)
        out["resume_other_data"] = error_of(lambda: trainer.fit(module, datamodule=data, ckpt_path=base))
        out["resume_other_data_warnings"] = [str(w.message) for w in caught if "data section" in str(w.message)]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("vocabulary")
    _swapped_tokenizer(root / "swapped")
    [out] = run_distributed(_worker, 1, str(root), timeout=600)
    return root, out


def test_the_checkpoint_records_the_pieces_as_our_bpe_reader_hashes_them(checkpoints):
    from lightning_megatron.data.bpe_tokenizer import BPETokenizer, packaged_bpe_tokenizer_file
    from lightning_megatron.data.dataset_vocab import vocabulary_record

    root, _ = checkpoints
    record = torch.load(root / "base.ckpt" / "extra.pt", weights_only=True)["vocabulary"]
    assert record == vocabulary_record(BPETokenizer()), record  # the chat reader and the pretraining reader agree
    assert record["vocab_size"] == 8192 and record["source"] == str(packaged_bpe_tokenizer_file().resolve())


def test_another_vocabulary_of_the_same_size_is_refused_on_every_load_path(checkpoints):
    root, out = checkpoints
    for path in ("resume", "validate", "init_from"):
        error = out[path]
        assert error.startswith("CheckpointError: checkpoint "), (path, error)
        assert "the same ids would be other pieces" in error, (path, error)
        assert str(root / "swapped" / "tokenizer.json") in error and "8192 pieces" in error, (path, error)
    assert out["init_from_same"] == "no error" and out["resume_same"] == "no error", out


def test_another_data_section_on_resume_is_said(checkpoints):
    _, out = checkpoints
    assert out["resume_same_data_warnings"] == [], out["resume_same_data_warnings"]
    assert out["resume_other_data"] == "no error", out["resume_other_data"]
    [said] = out["resume_other_data_warnings"]
    assert said.startswith("the data section differs from the checkpoint's run (seed: checkpoint 1234, this run 7)"), \
        said


def test_the_command_line_refuses_it_before_launch(checkpoints):
    from lightning_megatron.config_checks import check_config
    from lightning_megatron.datamodules.sft import SFTDataModule
    from lightning_megatron.models.gpt.module import GPTLightningModule

    root, _ = checkpoints
    base = str(root / "base.ckpt")
    for model, ckpt_path in (({"init_from": base}, None), ({}, base)):
        data = {"tokenizer": str(root / "swapped"), "seq_length": 32}
        problems = check_config(model, data, data_class=SFTDataModule, model_class=GPTLightningModule,
                                running=False, ckpt_path=ckpt_path)
        assert any("the same ids would be other pieces" in p for p in problems), (model, problems)
        data["tokenizer"] = None
        problems = check_config(model, data, data_class=SFTDataModule, model_class=GPTLightningModule,
                                running=False, ckpt_path=ckpt_path)
        assert not any("other pieces" in p for p in problems), (model, problems)


def test_export_writes_the_recorded_vocabulary_or_refuses(checkpoints, tmp_path, capsys):
    """``export hf --tokenizer`` of another vocabulary of the same size wrote it beside the weights (the folder's ids
    then mean other text); the tokenizer written is read back as transformers reads it and compared with the
    record, before the folder is swapped in."""
    from transformers import AutoTokenizer

    from lightning_megatron.cli import main
    from lightning_megatron.data.bpe_tokenizer import BPETokenizer

    root, _ = checkpoints
    with pytest.raises(SystemExit):
        main(["export", "hf", "--ckpt_path", str(root / "base.ckpt"), "--output", str(tmp_path / "other"),
              "--tokenizer", str(root / "swapped" / "tokenizer.json")])
    error = capsys.readouterr().err
    assert "the tokenizer it would write (8192 pieces) is not the vocabulary the run's data was tokenized with" in error
    assert "--tokenizer" in error and not (tmp_path / "other").exists()
    main(["export", "hf", "--ckpt_path", str(root / "base.ckpt"), "--output", str(tmp_path / "same")])
    sample = "The function returns a list of tensors."
    assert AutoTokenizer.from_pretrained(tmp_path / "same").encode(sample) == BPETokenizer().tokenize(sample)


def test_a_resume_the_ranks_would_refuse_is_refused_before_launch(checkpoints):
    """What the ranks refuse at set-up on ``fit --ckpt_path`` (another optimizer class; an lr schedule the checkpoint
    holds no state of) is read from the checkpoint's ``extra.pt`` before launch, in the same words. ``base.ckpt``
    was written by AdamW (the module's default) without a schedule, at step 1."""
    from lightning_megatron.config_checks import check_config
    from lightning_megatron.datamodules.sft import SFTDataModule
    from lightning_megatron.models.gpt.module import GPTLightningModule

    root, _ = checkpoints
    base = str(root / "base.ckpt")

    def problems(model: dict | None = None, max_steps: int = 10, **kwargs) -> list[str]:
        return check_config(model or {}, {"tokenizer": None, "seq_length": 32}, data_class=SFTDataModule,
                            running=False, model_class=GPTLightningModule, ckpt_path=base,
                            trainer_args={"max_steps": max_steps}, **kwargs)

    [wrong] = problems(optimizer_class="torch.optim.SGD")
    assert wrong.startswith(f"checkpoint {base!r}: optimizer class: checkpoint torch.optim.AdamW, this run "
                            f"torch.optim.SGD"), wrong
    [wrong] = [p for p in problems({"optimizer": "sgd"}) if "optimizer class" in p]  # the module's own choice
    assert "this run torch.optim.SGD" in wrong, wrong
    [restart] = problems(scheduler_args={"max_lr": 1e-3})
    assert "the run resumes at step 1 from a checkpoint that holds no state of this schedule" in restart, restart
    assert problems(scheduler_args={"max_lr": 1e-3, "override_opt_param_scheduler": True,
                                    "use_checkpoint_opt_param_scheduler": False}) == []
    assert problems(optimizer_class="torch.optim.AdamW") == problems() == []
    assert problems(optimizer_class="torch.optim.SGD", fitting=False) == []  # validate loads no optimizer state
    # a resume to a max_steps the checkpoint has reached trained nothing and exited 0
    [done] = problems(max_steps=1)
    assert done == (f"fit --ckpt_path {base!r} resumes at step 1, and trainer.max_steps=1 ends the run there: nothing "
                    f"would be trained; raise --trainer.max_steps above 1"), done
    assert problems(max_steps=1, fitting=False) == []
