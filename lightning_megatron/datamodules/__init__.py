"""The LightningDataModules: the Lightning glue over :mod:`lightning_megatron.data` (which imports no Lightning).

- :mod:`~lightning_megatron.datamodules.pretraining`: :class:`PretrainingDataModule` (prefixes and blends,
  splits, consumed-samples samplers, resume state) and :class:`BertDataModule` (MLM + sentence order);
- :mod:`~lightning_megatron.datamodules.gpt`: :class:`GPTDataModule` (decoder pretraining, prompts to predict);
- :mod:`~lightning_megatron.datamodules.finetune`: :class:`FinetuneDataModule` and
  :class:`LabelledTextDataModule` (the user's labelled text, GLUE-shaped);
- :mod:`~lightning_megatron.datamodules.sft`: :class:`SFTDataModule` (decoder instruction tuning: chats
  rendered by the tokenizer's chat template, the loss on the assistant's tokens, packing).

Recipes name them by their module's path (``class_path: lightning_megatron.datamodules.gpt.GPTDataModule``);
the paths they had under ``lightning_megatron.data`` are refused with the new one
(:data:`lightning_megatron.recipes.MOVED_CLASS_PATHS`). See ``docs/data.md``.
"""

from __future__ import annotations

from lightning_megatron.datamodules.finetune import FinetuneDataModule, LabelledTextDataModule
from lightning_megatron.datamodules.gpt import GPTDataModule
from lightning_megatron.datamodules.pretraining import NO_PADDING, BertDataModule, PretrainingDataModule
from lightning_megatron.datamodules.sft import SFTDataModule

__all__ = ["BertDataModule", "FinetuneDataModule", "GPTDataModule", "LabelledTextDataModule", "NO_PADDING",
           "PretrainingDataModule", "SFTDataModule"]
