"""Packed samples (Megatron's ``reset_attention_mask`` and ``reset_position_ids``): each document of a packed
sample computes what it computes alone. The reference is transformers' ``LlamaForCausalLM`` (rotary positions)
and ``GPT2LMHeadModel`` (learned positions) run on every document separately, on the same weights, read by
``GPTLightningModule.from_pretrained``. The GPT dataset's ids against Megatron-LM's loop:
``tests/test_data_gpt_dataset.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_megatron.data.packing import document_ids, document_positions
from lightning_megatron.models.gpt.module import GPTLightningModule

VOCAB, SEQ, EOD = 61, 20, 0


def _transformers_model(family: str, folder):
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, rope_theta=500.0,
            initializer_range=0.2, bos_token_id=EOD, eos_token_id=EOD))
    else:
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2,
            bos_token_id=EOD, eos_token_id=EOD))
    hf.save_pretrained(folder)
    return hf.eval()


def _packed() -> torch.Tensor:
    """Two samples of SEQ tokens: documents of 6, 1 (a lone EOD), 9 and a 4-token start of one more; and
    of 11 and 9 (the second unfinished)."""
    rng = np.random.default_rng(3)

    def doc(n: int, end: bool = True) -> list[int]:
        return [*rng.integers(1, VOCAB, n - end).tolist(), *([EOD] if end else [])]

    rows = [doc(6) + doc(1) + doc(9) + doc(4, end=False), doc(11) + doc(9, end=False)]
    assert all(len(r) == SEQ for r in rows)
    return torch.tensor(rows)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_document_of_a_packed_sample_gives_transformers_logits_of_it_alone(tmp_path, family):
    hf = _transformers_model(family, tmp_path / "hf")
    module = GPTLightningModule.from_pretrained(str(tmp_path / "hf"))
    module.configure_model()
    module.eval()
    chunk = module.model_chunks[0]
    tokens = _packed()
    documents = torch.from_numpy(np.stack([document_ids(row, EOD) for row in tokens.numpy()]))
    positions = torch.from_numpy(np.stack([document_positions(d) for d in documents.numpy()]))
    with torch.no_grad():
        ours = chunk(tokens, positions, document_ids=documents)[..., :VOCAB]
        unpacked = chunk(tokens)[..., :VOCAB]  # the same sample with attention across documents
        errors, spans = [], 0
        for row in range(len(tokens)):
            for doc in documents[row].unique():
                where = (documents[row] == doc).nonzero().flatten()
                alone = hf(input_ids=tokens[row:row + 1, where]).logits[0]
                errors.append(float((ours[row, where] - alone).abs().max()))
                spans += 1
    assert spans == 6
    assert max(errors) <= 1e-5, f"max |packed - alone in transformers| = {max(errors):.2e}"
    # The check can fail: without the document mask, the later documents see the earlier ones.
    assert float((unpacked[0, 7:] - ours[0, 7:]).abs().max()) > 1e-2
    assert torch.allclose(unpacked[:, :6], ours[:, :6], atol=1e-5)  # the first document is alone either way


def test_packed_training_loss_through_the_module():
    """``loss_forward`` hands the batch's ``position_ids`` and ``document_ids`` to the decoder: the loss of a
    packed batch is the token-weighted mean of its documents' losses, each computed alone."""
    from lightning_megatron.models.gpt.config import GPTConfig
    from lightning_megatron.models.gpt.model import gpt_loss

    torch.manual_seed(0)
    module = GPTLightningModule(config=GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                                 vocab_size=VOCAB, max_sequence_length=SEQ, spec="llama_layer_spec",
                                                 position_embedding_type="rope", hidden_dropout=0.0,
                                                 attention_dropout=0.0))
    module.configure_model()
    module.eval()
    chunk = module.model_chunks[0]
    tokens = _packed()
    labels = torch.roll(tokens, -1, dims=1)
    documents = torch.from_numpy(np.stack([document_ids(row, EOD) for row in tokens.numpy()]))
    positions = torch.from_numpy(np.stack([document_positions(d) for d in documents.numpy()]))
    batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(tokens.shape), "position_ids": positions,
             "document_ids": documents}
    with torch.no_grad():
        loss, _ = module.loss_forward(batch, chunk)
        total, count = 0.0, 0
        for row in range(len(tokens)):
            for doc in documents[row].unique():
                where = (documents[row] == doc).nonzero().flatten()
                per_token = chunk(tokens[row:row + 1, where], labels=labels[row:row + 1, where])
                total += float(per_token.sum())
                count += len(where)
        across = float(gpt_loss(chunk(tokens, labels=labels), torch.ones(tokens.shape)))  # no document mask
    assert abs(float(loss) - total / count) <= 1e-5 * total / count
    assert abs(across - total / count) > 1e-4
