"""The language-model layer every model family builds on (megatron-core's ``LanguageModule``).

- :mod:`~lightning_megatron.language.config`: :class:`LanguageModelConfig`, a TransformerConfig with the
  vocabulary, positions and layer spec: the record a family's config extends (``BertConfig``, ``GPTConfig``);
- :mod:`~lightning_megatron.language.model`: :class:`LanguageModule`, a pipeline chunk's shared half
  (word embedding, tied / untied padded output layer, vocabulary facts, pipeline hooks) and
  :class:`LanguageModelEmbedding` (no Lightning);
- :mod:`~lightning_megatron.language.module`: ``LanguageLightningModule``, the LightningModule's shared
  half (chunks per stage, global parameter names, the loss and generation hooks, the default optimizer,
  the record in the hyper-parameters and the mapping of older checkpoints'); imported from there (it
  imports Lightning, the chunks do not).

Model families (``models/bert``, ``models/gpt``) import this package and never each other.
"""

from lightning_megatron.language.config import LanguageModelConfig
from lightning_megatron.language.model import LanguageModelEmbedding, LanguageModule

__all__ = ["LanguageModelConfig", "LanguageModelEmbedding", "LanguageModule"]
