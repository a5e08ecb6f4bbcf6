"""``SFTDataModule``: instruction tuning (SFT) data for decoders, chats rendered by the tokenizer's chat template.

The Lightning-free part: :mod:`lightning_megatron.data.chat` (records, template, loss mask) and
:mod:`lightning_megatron.data.sft_samples` (truncation, packing, the training order). A training step receives this data-parallel rank's share of one global
batch, the :class:`~lightning_megatron.models.gpt.module.GPTLightningModule` contract: ``tokens`` /
``labels`` int64 and ``loss_mask`` float32 ``[b, s]`` (the loss on the assistant's tokens only), and with
``pack=True`` also ``position_ids`` and ``document_ids`` (attention within each example). The DP
coordinates come from ``trainer.strategy.parallel_state`` when the strategy has one, else the trainer's
ranks.

Resuming: the training order is a stream of seeded per-epoch shuffles and a step starts where
``consumed_samples`` points (the value restored from the checkpoint by ``load_state_dict``, plus
``global_batch_size`` per optimizer step since), so a resumed run sees the batches the uninterrupted one
would have. See ``docs/finetune.md``.
"""

from __future__ import annotations

import random
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_megatron.data.chat import (ChatRecord, ChatTokenizer, encode_chat, encode_prompt, packaged_sample_file,
                                          read_chat_records)
from lightning_megatron.data.sft_samples import (EncodeStats, EpochShuffledBatchSampler, PromptSamples, SFTSamples,
                                                 fit_examples, group_examples)
from lightning_megatron.data.loader import trainer_loader
from lightning_megatron.data.samplers import evaluation_coverage
from lightning_megatron.data.predict import IndexedSamples, LengthGroupedBatchSampler, PredictBatchSampler

__all__ = ["SFTDataModule"]

SPLITS = ("train", "validation", "test")


class SFTDataModule(pl.LightningDataModule):
    """Chats (or prompt/completion pairs) for supervised fine-tuning of a decoder.

    Args:
        train_file: ``.jsonl`` of training records (``{"messages": [...]}`` or ``{"prompt", "completion"}``,
            optionally ``"system"``); ``None``: the packaged sample chats (a few dozen, for tiny recipes).
        validation_file, test_file: ``.jsonl`` files of those splits (``None``: none, or ``val_fraction``).
        predict_file: ``.jsonl`` of prompts ``predict`` continues: ``{"prompt"}`` or messages not ending with
            the assistant's, rendered with the template's generation prompt.
        tokenizer: the model's Hugging Face tokenizer: a folder with ``tokenizer.json`` (its
            ``tokenizer_config.json`` gives the special tokens and the chat template) or a
            ``tokenizer.json``; ``None``: the packaged 8,192-piece BPE the GPT recipes pretrain with. Required.
        chat_template: overrides the tokenizer's: a ``.jinja`` file, a template string, or the name of one of
            the config's templates (see :class:`~lightning_megatron.data.chat.ChatTokenizer`).
        eos_token: overrides the tokenizer's end-of-sequence token (the template's ``eos_token``, where
            ``predict`` stops; e.g. Llama 3's ``<|eot_id|>``).
        seq_length: input tokens per sample (examples of up to ``seq_length + 1`` tokens fit).
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        micro_batch_size: samples per forward/backward pass on one rank.
        val_fraction: share of the training records held out as the validation split (seeded), when there is
            no ``validation_file``.
        seed: seed of the held-out records and of every epoch's shuffle.
        pack: several whole examples per sample (greedy first fit; ``position_ids`` restart and attention
            stays within each example); ``False``: one example per sample, right-padded.
        overlong: an example of more than ``seq_length + 1`` tokens is cut to its first ``seq_length + 1``
            (``"truncate"``; left out when no assistant token remains), left out (``"drop"``), or refused
            (``"error"``). What was cut and left out is counted in :attr:`stats` and warned about.
        prompt_completion: how ``prompt``/``completion`` records are rendered: ``"chat"`` (a user and an
            assistant message through the template) or ``"raw"`` (``prompt + completion``, the tokenizer's
            own special tokens, then EOS; no template).
        num_workers: DataLoader worker processes; ``None``:
            :func:`~lightning_megatron.data.loader.default_num_workers`.
    """

    def __init__(self, train_file: str | None = None, validation_file: str | None = None,
                 test_file: str | None = None, predict_file: str | None = None, *, tokenizer: str | None,
                 chat_template: str | None = None, eos_token: str | None = None, seq_length: int = 2048,
                 global_batch_size: int = 32, micro_batch_size: int = 4, val_fraction: float = 0.0,
                 seed: int = 1234, pack: bool = False, overlong: Literal["truncate", "drop", "error"] = "truncate",
                 prompt_completion: Literal["chat", "raw"] = "chat", num_workers: int | None = None) -> None:
        super().__init__()
        if seq_length < 2:
            raise ValueError(f"seq_length={seq_length} must be at least 2")
        if global_batch_size < 1 or micro_batch_size < 1 or global_batch_size % micro_batch_size:
            raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                             f"micro_batch_size={micro_batch_size}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
        if validation_file is not None and val_fraction:
            raise ValueError(f"validation_file={validation_file!r} and val_fraction={val_fraction}: use one of the two")
        if overlong not in ("truncate", "drop", "error"):
            raise ValueError(f"overlong={overlong!r} must be 'truncate', 'drop' or 'error'")
        if prompt_completion not in ("chat", "raw"):
            raise ValueError(f"prompt_completion={prompt_completion!r} must be 'chat' or 'raw'")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        self.save_hyperparameters()
        self.files = {"train": train_file, "validation": validation_file, "test": test_file}
        self.predict_file = predict_file
        self.tokenizer_path, self.chat_template, self.eos_token = tokenizer, chat_template, eos_token
        self.seq_length, self.global_batch_size, self.micro_batch_size = seq_length, global_batch_size, micro_batch_size
        self.val_fraction, self.seed, self.pack, self.overlong = val_fraction, seed, pack, overlong
        self.raw = prompt_completion == "raw"
        self.num_workers = num_workers
        self.datasets: dict[str, SFTSamples] = {}
        """The samples of each split there is (``train``, ``validation``, ``test``), after ``setup``."""
        self._coverage_said: set[str] = set()  # the splits whose evaluation's limited batches were said
        self.stats: dict[str, EncodeStats] = {}
        """What truncation did to each split's examples."""
        self.predict_dataset: PromptSamples | None = None
        """The prompts of the last ``predict_dataloader`` (their rendered texts: ``predict_dataset.texts``)."""
        self._tokenizer: ChatTokenizer | None = None
        self._restored: tuple[int, int] = (0, 0)
        """(consumed_samples, global_step) at the last checkpoint restored."""

    # --- tokenizer ------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> ChatTokenizer:
        """The :class:`~lightning_megatron.data.chat.ChatTokenizer` (``eod`` = its EOS id)."""
        if self._tokenizer is None:
            from lightning_megatron.data.bpe_tokenizer import packaged_bpe_tokenizer_file

            path = self.tokenizer_path if self.tokenizer_path is not None else packaged_bpe_tokenizer_file()
            self._tokenizer = ChatTokenizer(path, eos_token=self.eos_token, chat_template=self.chat_template)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Ids of the tokenizer (the model takes it when its ``vocab_size`` is None)."""
        return self.tokenizer.vocab_size

    # --- splits ---------------------------------------------------------------------------------

    def read_splits(self) -> dict[str, list[ChatRecord]]:
        """The records of each split given; ``val_fraction`` of the training ones held out (seeded)."""
        found = {}
        for split, file in self.files.items():
            if file is None and split == "train":
                file = str(packaged_sample_file())
            if file is not None:
                found[split] = read_chat_records(file, f"data.{split}_file {file!r}")
        if self.val_fraction:
            train = found["train"]
            order = list(range(len(train)))
            random.Random(self.seed).shuffle(order)
            held = set(order[:max(1, int(len(train) * self.val_fraction))])
            if len(held) == len(train):
                raise ValueError(f"val_fraction={self.val_fraction} of {len(train)} records leaves none to train on")
            found["validation"] = [r for i, r in enumerate(train) if i in held]
            found["train"] = [r for i, r in enumerate(train) if i not in held]
        return found

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read, render, tokenize and fit every split's examples (once), then group them into samples
        (``predict`` reads only its ``predict_file``)."""
        if self.datasets or stage == "predict":
            return
        tokenizer = self.tokenizer
        template = tokenizer.template()
        model_vocab = self._model_vocab_size()
        for split, records in self.read_splits().items():
            encoded = [encode_chat(r, tokenizer, template, raw=self.raw) for r in records]
            examples, stats = fit_examples(encoded, [r.where for r in records], self.seq_length, self.overlong)
            if not examples:
                raise ValueError(f"no {split} example fits seq_length={self.seq_length} ({stats.summary()}): raise "
                                 f"seq_length")
            line = stats.overlong_line(self.seq_length, self.overlong)
            if line is not None:  # every rank reads the same examples: said once
                rank_zero_warn(f"SFT {split} split: {line}; {stats.examples} examples kept, {stats.tokens} tokens, "
                               f"{stats.targets} of them targets")
            largest = max(int(ids.max()) for ids, _ in examples)
            if model_vocab is not None and largest >= model_vocab:
                raise ValueError(f"the {split} data has token id {largest} but the model's vocabulary has "
                                 f"{model_vocab} ids: the tokenizer {self.tokenizer_path!r} is not the model's")
            self.stats[split] = stats
            self.datasets[split] = SFTSamples(examples, group_examples(examples, self.seq_length, self.pack),
                                              seq_length=self.seq_length, pad_id=tokenizer.pad_id, packed=self.pack)

    def _model_vocab_size(self) -> int | None:
        """The attached model's ``vocab_size`` when it has one set (None: it takes this tokenizer's)."""
        module = getattr(self._trainer_or_none(), "lightning_module", None)
        for source in (module, getattr(module, "hparams", None)):
            value = getattr(source, "vocab_size", None) if source is not None else None
            if isinstance(value, int):
                return value
        return None

    # --- parallel layout ------------------------------------------------------------------------

    def num_microbatches(self, dp_size: int) -> int:
        """``global_batch_size // (micro_batch_size * dp_size)``; raises when it does not divide."""
        if dp_size < 1 or self.global_batch_size % (self.micro_batch_size * dp_size):
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size="
                             f"{self.micro_batch_size} * data_parallel_size={dp_size}")
        return self.global_batch_size // (self.micro_batch_size * dp_size)

    def _dp_coordinates(self) -> tuple[int, int]:
        """(rank, size) of the data-parallel group: the strategy's ``parallel_state`` (the MegatronStrategy's),
        else the trainer's ranks, else (0, 1)."""
        trainer = self._trainer_or_none()
        state = getattr(trainer.strategy, "parallel_state", None) if trainer is not None else None
        if state is not None:
            return int(state.dp_rank), int(state.dp_size)
        if trainer is not None:
            return int(getattr(trainer, "global_rank", 0)), int(getattr(trainer, "world_size", 1))
        return 0, 1

    def _trainer_or_none(self) -> Any:
        return getattr(self, "trainer", None)

    # --- loaders --------------------------------------------------------------------------------

    @property
    def consumed_samples(self) -> int:
        """Training samples consumed so far: the count restored from a checkpoint plus ``global_batch_size``
        per optimizer step taken since."""
        base_samples, base_step = self._restored
        trainer = self._trainer_or_none()
        if trainer is None:
            return base_samples
        return base_samples + (int(trainer.global_step) - base_step) * self.global_batch_size

    def _loader(self, dataset: Any, sampler: Any) -> DataLoader:
        return trainer_loader(dataset, sampler, self._trainer_or_none(), self.num_workers)

    def _split(self, split: str) -> SFTSamples | None:
        if not self.datasets:
            self.setup()
        return self.datasets.get(split)

    @override
    def train_dataloader(self) -> DataLoader:
        dataset = self._split("train")
        assert dataset is not None
        rank, size = self._dp_coordinates()
        sampler = EpochShuffledBatchSampler(
            num_samples=len(dataset), local_batch_size=self.micro_batch_size * self.num_microbatches(size),
            data_parallel_rank=rank, data_parallel_size=size, seed=self.seed,
            consumed_samples=lambda: self.consumed_samples)
        return self._loader(dataset, sampler)

    def _eval_loader(self, split: str) -> DataLoader | list:
        """Every sample once, in order, in full global batches (the last padded with samples without loss)."""
        dataset = self._split(split)
        if dataset is None:
            return []
        rank, size = self._dp_coordinates()
        sampler = PredictBatchSampler(total_samples=len(dataset), data_parallel_rank=rank, data_parallel_size=size,
                                      local_batch_size=self.micro_batch_size * self.num_microbatches(size))
        limit = getattr(self._trainer_or_none(), "limit_test_batches" if split == "test" else "limit_val_batches", None)
        said = evaluation_coverage(split, len(dataset), self.global_batch_size, limit, padded=True)
        if said is not None and split not in self._coverage_said:  # a limit on the batches: once a split
            self._coverage_said.add(split)
            rank_zero_info(said[0])
        return self._loader(dataset, sampler)

    @override
    def val_dataloader(self) -> DataLoader | list:
        return self._eval_loader("validation")

    @override
    def test_dataloader(self) -> DataLoader | list:
        return self._eval_loader("test")

    @override
    def read_prompts(self) -> PromptSamples:
        """``predict_file``'s prompts rendered with the generation prompt and tokenized (each at most
        ``seq_length`` tokens): what ``predict`` continues (the pre-launch check reads them too)."""
        if self.predict_file is None:
            raise ValueError("SFTDataModule: predict continues prompts: pass --data.predict_file (.jsonl of "
                             "{\"prompt\": ...} or {\"messages\": [...]} without the final assistant message)")
        template = self.tokenizer.template()
        records = read_chat_records(self.predict_file, f"data.predict_file {self.predict_file!r}", prompts=True)
        texts, ids, lines = [], [], []
        for record in records:
            text, tokens = encode_prompt(record, self.tokenizer, template, raw=self.raw)
            if len(tokens) > self.seq_length:
                raise ValueError(f"{record.where}: the prompt has {len(tokens)} tokens, more than seq_length="
                                 f"{self.seq_length}: shorten it or raise seq_length")
            texts.append(text)
            ids.append(tokens)
            lines.append(record.line)
        return PromptSamples(texts, ids, lines)

    def predict_dataloader(self) -> DataLoader:
        """``predict_file``'s prompts, every one once: full global batches of one prompt length (the last of
        each length padded with copies whose ``sample_index`` is -1)."""
        self.predict_dataset = self.read_prompts()
        rank, size = self._dp_coordinates()
        sampler = LengthGroupedBatchSampler(self.predict_dataset.lengths, data_parallel_rank=rank,
                                            data_parallel_size=size,
                                            local_batch_size=self.micro_batch_size * self.num_microbatches(size))
        return self._loader(IndexedSamples(self.predict_dataset), sampler)

    # --- checkpointing --------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer_or_none()
        step = int(trainer.global_step) if trainer is not None else self._restored[1]
        return {"consumed_samples": self.consumed_samples, "global_step": step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = (int(state_dict["consumed_samples"]), int(state_dict.get("global_step", 0)))
