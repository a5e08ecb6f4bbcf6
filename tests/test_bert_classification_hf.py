"""Our fine-tuning model is transformers' ``BertForSequenceClassification``: same weights, same logits.

A random-init tiny ``BertForSequenceClassification`` (post-norm, as our ``bert_layer_post_norm_spec``)
is saved with ``save_pretrained``; our ``BertClassificationModule`` loads it with ``init_from`` (the
encoder and the pooler) and takes its classifier. In fp32 eval mode the logits of padded token pairs
agree to 1e-5 absolute (they are O(1)). The pooler (dense + tanh on the first token) is part of the
path: skipping it, or pooling another position, moves the logits by ~0.1 (checked below too).
Regression (``num_labels=1``, our ``num_classes=1``) gives the same value and the same MSE loss.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

HF = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
          max_position_embeddings=32, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
OURS = dict(config=dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=120,
                        max_sequence_length=32, hidden_dropout=0.0, attention_dropout=0.0,
                        spec="bert_layer_post_norm_spec", layernorm_epsilon=1e-12),
            classifier_dropout=0.0)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 120, (6, 16), generator=g)
    mask = torch.ones(6, 16, dtype=torch.long)
    mask[1, 10:] = 0
    mask[4, 5:] = 0
    types = torch.zeros(6, 16, dtype=torch.long)
    types[:, 7:] = 1  # a second text from position 7
    return {"tokens": tokens * mask, "attention_mask": mask, "token_types": types * mask}


def _pair(tmp_path, num_labels: int):
    from lightning_megatron.models.bert.classification import BertClassificationModule

    torch.manual_seed(0)
    theirs = transformers.BertForSequenceClassification(transformers.BertConfig(**HF, num_labels=num_labels)).eval()
    with torch.no_grad():  # a pooler far from its init, so that skipping it shows
        theirs.bert.pooler.dense.weight.normal_(0.0, 0.5)
        theirs.bert.pooler.dense.bias.normal_(0.0, 0.5)
    theirs.save_pretrained(tmp_path / "hf")
    ours = BertClassificationModule(**OURS, num_classes=num_labels, init_from=str(tmp_path / "hf"))
    ours.configure_model()
    chunk = ours.model_chunks[0]
    with torch.no_grad():  # the classifier is the fine-tuning head: init_from leaves it at its own init
        chunk.classifier.weight.copy_(theirs.classifier.weight)
        chunk.classifier.bias.copy_(theirs.classifier.bias)
    return theirs, ours.eval()


def _ours(ours, batch) -> torch.Tensor:
    chunk = ours.model_chunks[0]
    pooled = chunk(batch["tokens"], batch["attention_mask"], batch["token_types"], return_pooled=True)
    return ours._classify(chunk, pooled)


def test_classification_logits_equal_transformers(tmp_path):
    theirs, ours = _pair(tmp_path, num_labels=3)
    batch = _batch()
    with torch.no_grad():
        expected = theirs(input_ids=batch["tokens"], attention_mask=batch["attention_mask"],
                          token_type_ids=batch["token_types"]).logits
        got = _ours(ours, batch)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        # The same through the module's forward_step (what training and evaluation run).
        labels = torch.tensor([0, 1, 2, 2, 1, 0])
        loss, _ = ours.forward_step({**batch, "labels": labels}, ours.model_chunks[0])
        torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(expected, labels), atol=1e-5, rtol=0)
        # Without the pooler (classifier on the raw first token) the logits are far off: the check can fail.
        chunk = ours.model_chunks[0]
        hidden = chunk(batch["tokens"], batch["attention_mask"], batch["token_types"], return_hidden_states=True)
        unpooled = chunk.classifier(hidden[0])
        assert (unpooled - expected).abs().max() > 1e-2


def test_regression_equals_transformers_num_labels_1(tmp_path):
    theirs, ours = _pair(tmp_path, num_labels=1)
    batch = _batch()
    scores = torch.tensor([0.5, 4.0, 2.2, 3.1, 0.0, 5.0])
    with torch.no_grad():
        out = theirs(input_ids=batch["tokens"], attention_mask=batch["attention_mask"],
                     token_type_ids=batch["token_types"], labels=scores)
        assert theirs.config.problem_type == "regression"
        torch.testing.assert_close(_ours(ours, batch), out.logits, atol=1e-5, rtol=0)
        loss, _ = ours.forward_step({**batch, "labels": scores}, ours.model_chunks[0])
        torch.testing.assert_close(loss, out.loss, atol=1e-5, rtol=1e-5)
    assert os.path.isfile(tmp_path / "hf" / "config.json")


@pytest.mark.parametrize("spec, num_labels", [("bert_layer_post_norm_spec", 1), ("bert_layer_local_spec", 3)])
def test_the_export_of_a_classifier_is_transformers_sequence_classifier(tmp_path, spec, num_labels):
    """The other direction (``export hf`` of a fine-tuned classifier, through the adapter it runs): our classifier's
    weights give transformers' ``BertForSequenceClassification`` (post-norm) / ``MegatronBertForSequenceClassification``
    (pre-norm) with the same logits, regression included; the class names recorded become ``id2label``."""
    from lightning_megatron.interop.hf_folder import hf_model_from_saved
    from lightning_megatron.models.bert.classification import BertClassificationModule
    from lightning_megatron.saved_model import SavedModel

    torch.manual_seed(0)
    ours = BertClassificationModule(**{**OURS, "config": {**OURS["config"], "spec": spec}}, num_classes=num_labels)
    ours.configure_model()
    with torch.no_grad():  # a classifier and a pooler far from their init: a head left out or fresh shows
        for name, p in ours.sharded_named_parameters():
            if name.startswith(("classifier.", "pooler.")):
                p.normal_(0.0, 0.5)
    ours.eval()
    names = ["contradiction", "neutral", "entailment"][:num_labels] if num_labels > 1 else None
    unpadded = {n: p.detach()[:HF["vocab_size"]] if n in ("embedding.word_embeddings.weight", "output_layer.bias")
                else p.detach() for n, p in ours.sharded_named_parameters()}  # as a checkpoint holds them
    saved = SavedModel(state_dict=unpadded, hparams=BertClassificationModule.flat_hparams(dict(ours.hparams)),
                       module_hparams=dict(ours.hparams), label_names=names)
    (tmp_path / "vocab.txt").write_text("".join(f"{p}\n" for p in [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"[unused{i}]" for i in range(HF["vocab_size"] - 5))]))
    theirs, _ = hf_model_from_saved(saved, BertClassificationModule.interop, tokenizer=tmp_path / "vocab.txt")
    theirs.eval()
    prefix = "MegatronBert" if spec == "bert_layer_local_spec" else "Bert"
    assert type(theirs).__name__ == prefix + "ForSequenceClassification"
    assert theirs.config.problem_type == ("regression" if num_labels == 1 else "single_label_classification")
    if names:
        assert theirs.config.id2label == dict(enumerate(names))
    batch = _batch()
    with torch.no_grad():
        expected = _ours(ours, batch)
        got = theirs(input_ids=batch["tokens"], attention_mask=batch["attention_mask"],
                     token_type_ids=batch["token_types"]).logits
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("setting, said", [
    ({"add_bias_linear": False}, "add_bias_linear=False (linear layers without biases)"),
    ({"kv_channels": 16}, "kv_channels=16 (not hidden_size / num_attention_heads = 8)"),
    ({"num_query_groups": 2}, "num_query_groups=2 (grouped-query attention)"),
    ({"gated_linear_unit": True}, "gated_linear_unit=True (a gated MLP)"),
    ({"qk_layernorm": True}, "qk_layernorm=True (norms of the queries and keys)"),
    ({"add_qkv_bias": True, "add_bias_linear": False}, "add_bias_linear=False (linear layers without biases)"),
])
def test_an_export_transformers_bert_cannot_compute_is_refused_by_its_setting(setting, said):
    """Settings the CLI trains and transformers' BERT lacks ended ``export hf`` in a KeyError or a size mismatch
    (a wall of text): refused by name, before any tensor is converted."""
    from lightning_megatron.models.bert.classification import BertClassificationModule
    from lightning_megatron.saved_model import SavedModel

    hparams = {"spec": "bert_layer_local_spec", "hidden_size": 32, "num_attention_heads": 4, **setting}
    with pytest.raises(ValueError, match=r"transformers' BERT has no equivalent") as refused:
        BertClassificationModule.interop.hf_config(SavedModel(state_dict={}, hparams=hparams))
    assert said in str(refused.value), refused.value
