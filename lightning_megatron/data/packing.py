"""Documents packed into one sample: which document each token belongs to, and its position in it.

A GPT sample is a window of the documents' stream, so it holds the end of one document, whole ones and
the start of another, each ending with EOD. Megatron-LM's ``--reset-attention-mask`` keeps a token from
attending to the documents before it and ``--reset-position-ids`` restarts the positions after every EOD
(``get_ltor_masks_and_position_ids``). This module gives both as ``[s]`` arrays (a token after an EOD
starts a new document; the EOD itself ends its own); the model turns the document ids into the attention
mask (:func:`lightning_megatron.transformer.attention.document_attention_mask`). No torch, no Lightning.
"""

from __future__ import annotations

import numpy as np

__all__ = ["document_ids", "document_positions"]


def document_ids(tokens: np.ndarray, eod_id: int) -> np.ndarray:
    """``[s]`` int64: 0 for the tokens up to and including the first EOD, 1 up to the second, ..."""
    eod = tokens == eod_id
    return np.cumsum(eod, dtype=np.int64) - eod


def document_positions(documents: np.ndarray) -> np.ndarray:
    """``[s]`` int64: each token's position within its document (0 at a document's first token), from
    :func:`document_ids`."""
    positions = np.arange(len(documents), dtype=np.int64)
    starts = np.flatnonzero(np.diff(documents, prepend=-1))  # first token of each document in the sample
    return positions - starts[documents - documents[0]] if len(documents) else positions
