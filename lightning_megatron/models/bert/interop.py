"""BERT's state-dict adapter (:class:`BertInterop`): what the generic readers and writers of
:mod:`lightning_megatron.interop` need to know of our BertModel. ``BertLightningModule.interop`` declares it.

- Hugging Face folders of ``bert`` (post-norm: ``spec=bert_layer_post_norm_spec``) and ``megatron-bert``
  (pre-norm: ``bert_layer_local_spec``), the names mapped by :mod:`.hf`; an encoder-only model
  (transformers' ``BertModel``, e.g. MiniLM) leaves the heads it lacks to start fresh (``SavedModel.fresh``);
- Megatron-LM BERT checkpoints: the architecture from ``args`` (``--bias-gelu-fusion`` -> ``activation
  gelu_tanh``, ``lm_head_activation gelu``; settings BertModel lacks refused by name), the tied output
  layer's copy checked and dropped;
- export: ``bert_layer_post_norm_spec`` -> ``BertForPreTraining`` (``BertForMaskedLM`` without a binary
  head), ``bert_layer_local_spec`` with LayerNorm -> ``MegatronBertForPreTraining``
  (``MegatronBertForMaskedLM``); a fine-tuned classifier (``classifier.*``) -> ``*ForSequenceClassification`` with
  the class names its checkpoint records; with the WordPiece tokenizer the model was trained with.

:func:`architecture_conflicts` / :func:`check_architecture`: the module arguments a source fixes
(:data:`ARCHITECTURE_KEYS`) compared with the module's, every difference listed with the flag to set.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.interop.hf_folder import tokenizer_size_problem
from lightning_megatron.interop.tp import TPLayout
from lightning_megatron.models.bert.hf import (
    BERT_TP_LAYOUT,
    bert_config_from_hf,
    bert_model_kwargs_from_hf,
    bert_state_dict_and_unread_from_hf,
    hf_state_dict_from_bert,
)
from lightning_megatron.saved_model import SavedModel, refuse_architecture

__all__ = ["BertInterop", "ARCHITECTURE_KEYS", "MISSING_TENSORS_HINT", "HF_ACTIVATION_NAMES", "architecture_conflicts",
           "check_architecture"]

ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "spec", "activation",
                     "lm_head_activation", "layernorm_epsilon", "max_sequence_length", "vocab_size", "num_tokentypes",
                     "add_binary_head")
"""Module arguments a source fixes (checked by :func:`check_architecture`)."""

MISSING_TENSORS_HINT = ("is the spec right (post-norm Hugging Face BERT needs --model.config.spec "
                        "bert_layer_post_norm_spec)?")

HF_ACTIVATION_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}
"""Our ``activation`` -> transformers' ``hidden_act``."""

_HF_TO_OURS_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                   "silu": "silu", "swish": "silu"}
_HF_HEADS = ("lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layer_norm.weight", "lm_head.layer_norm.bias",
             "output_layer.bias", "pooler.dense.weight", "pooler.dense.bias", "binary_head.weight", "binary_head.bias")

# Megatron-LM arguments whose other values change the computation in ways BertModel does not have:
# name -> (accepted values, what to say).
_UNSUPPORTED_ARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    "position_embedding_type": (("learned_absolute", None), "only learned absolute positions convert"),
    "apply_residual_connection_post_layernorm": ((False, None), "residuals taken after the norm"),
    "add_bias_linear": ((True, None), "linear layers without biases"),
    "swiglu": ((False, None), "a SwiGLU MLP"),
    "squared_relu": ((False, None), "a squared-ReLU MLP"),
    "openai_gelu": ((False, None), "the openai_gelu activation"),
    "group_query_attention": ((False, None), "grouped-query attention"),
    "qk_layernorm": ((False, None), "query/key norms"),
    "apply_layernorm_1p": ((False, None), "zero-centred norm weights (apply_layernorm_1p)"),
    "layernorm_zero_centered_gamma": ((False, None), "zero-centred norm weights"),
    "num_experts": ((None, 0, 1), "mixture-of-experts layers"),
    "untie_embeddings_and_output_weights": ((False, None), "an output layer untied from the embedding"),
}


class BertInterop:
    """:class:`~lightning_megatron.interop.StateDictAdapter` of the BERT family."""

    hf_model_types = ("bert", "megatron-bert")
    megatron_prefixes = ("embedding.", "encoder.", "lm_head.", "output_layer.", "pooler.", "binary_head.")

    # ------------------------------------------------------------------ Hugging Face -> ours

    def architecture_from_hf(self, config: Any) -> dict[str, Any]:
        """The module arguments a transformers BERT / MegatronBERT config fixes; another number of token types
        than our two (segments A and B) refused."""
        ours, kwargs = bert_config_from_hf(config), bert_model_kwargs_from_hf(config)
        if kwargs["num_tokentypes"] != 2:
            raise ValueError(f"type_vocab_size={kwargs['num_tokentypes']}: BertLightningModule has 2 token types "
                             f"(segments A and B), so the folder's token type embeddings do not fit it; import a "
                             f"BERT with type_vocab_size 2")
        return dict(num_layers=ours.num_layers, hidden_size=ours.hidden_size,
                    num_attention_heads=ours.num_attention_heads, ffn_hidden_size=ours.ffn_hidden_size,
                    spec=kwargs["spec"], activation=_HF_TO_OURS_ACT[config.hidden_act], lm_head_activation=None,
                    layernorm_epsilon=ours.layernorm_epsilon, max_sequence_length=kwargs["max_sequence_length"],
                    vocab_size=kwargs["vocab_size"],
                    # suggested, not fixed (a flag wins): the dropouts the folder trains with in transformers
                    hidden_dropout=ours.hidden_dropout, attention_dropout=ours.attention_dropout)

    def state_dict_from_hf(self, hf_state_dict: dict[str, torch.Tensor], config: Any, architecture: dict[str, Any],
                           *, source: str) -> SavedModel:
        hf_sd = hf_state_dict
        keys = {k.removeprefix("bert.") for k in hf_sd}
        heads = "cls.predictions.bias" in keys
        binary = "cls.seq_relationship.weight" in keys
        word = hf_sd.get("bert.embeddings.word_embeddings.weight", hf_sd.get("embeddings.word_embeddings.weight"))
        if word is not None and word.size(0) != config.vocab_size:
            raise ValueError(f"{source!r} says vocab_size={config.vocab_size} but the word embeddings have "
                             f"{word.size(0)} rows: the config does not belong to these weights (fix vocab_size in "
                             f"config.json)")
        decoder = hf_sd.get("cls.predictions.decoder.weight")
        if heads and (getattr(config, "tie_word_embeddings", True) is False or
                      (decoder is not None and word is not None and not torch.equal(decoder, word))):
            raise ValueError(f"{source!r}: its masked-LM decoder (cls.predictions.decoder.weight) is not the word "
                             f"embedding (tie_word_embeddings={getattr(config, 'tie_word_embeddings', True)}): "
                             f"BertLightningModule ties them, so its masked-LM logits would differ; import a folder "
                             f"whose output layer is tied to its word embeddings")
        sd, unread = bert_state_dict_and_unread_from_hf(hf_sd, bert_config_from_hf(config), 0, 1,
                                                        post_process=heads, add_binary_head=binary,
                                                        make_vocab_size_divisible_by=1)
        if not heads:  # a transformers BertModel: its pooler, if saved
            for key in ("pooler.dense.weight", "pooler.dense.bias"):
                src = hf_sd.get(key, hf_sd.get("bert." + key))
                if src is not None:
                    sd[key] = src.clone()
                    unread.remove(key)
        if config.model_type == "megatron-bert" and not heads:
            for ours_key, theirs in (("encoder.final_layernorm.weight", "encoder.ln.weight"),
                                     ("encoder.final_layernorm.bias", "encoder.ln.bias")):
                src = hf_sd.get(theirs, hf_sd.get("bert." + theirs))
                if src is not None:
                    sd[ours_key] = src.clone()
                    unread.remove(theirs)
        self._refuse_unread_hf(unread, hf_sd, heads=heads, source=source)
        # An encoder-only model (transformers' BertModel, e.g. MiniLM) or one without the binary head: the
        # heads it lacks start fresh.
        fresh = [k for k in _HF_HEADS if k not in sd and (not heads or k.startswith(("binary_head.", "pooler.")))]
        return SavedModel(state_dict=sd, hparams=architecture, fresh=tuple(fresh))

    @staticmethod
    def _refuse_unread_hf(unread: list[str], hf_sd: Mapping[str, torch.Tensor], *, heads: bool, source: str) -> None:
        """A tensor of the folder the conversion did not read is refused when the model computes where it sits
        (embeddings, encoder, pooler, the pretraining heads): the folder's outputs would differ from the model's
        (a layer beyond ``num_hidden_layers``, a bias). Buffers, the tied decoder's copies and another task's
        head (``classifier.*`` of a ``BertForSequenceClassification``) are not weights of our model: the last
        are said in a warning."""
        def tensor(name: str) -> torch.Tensor | None:
            return hf_sd.get(name, hf_sd.get("bert." + name))

        copies = {"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight",  # tied: checked above
                  "cls.predictions.decoder.bias": "cls.predictions.bias"}
        ours = ("embeddings.", "encoder.", "pooler.", "cls.") if heads else ("embeddings.", "encoder.", "pooler.")
        refused, other_task = [], []
        for name in unread:
            if name in ("embeddings.position_ids", "embeddings.token_type_ids"):  # buffers older transformers saved
                continue
            if name in copies and tensor(copies[name]) is not None and torch.equal(tensor(name), tensor(copies[name])):
                continue
            (refused if name.startswith(ours) else other_task).append(name)
        if refused:
            raise ValueError(f"{source!r}: the folder has {len(refused)} tensors the conversion does not read, e.g. "
                             f"{refused[:4]}: the folder's model computes with them and ours would not (a layer "
                             f"beyond num_hidden_layers? a tensor another architecture has?)")
        if other_task and not (torch.distributed.is_available() and torch.distributed.is_initialized()
                               and torch.distributed.get_rank() != 0):  # every rank reads the folder: said once
            import warnings

            folder = source.removesuffix("/config.json")
            warnings.warn(f"{folder!r}: {other_task} are not read (another task's head, no weight of ours: a "
                          f"classifier fine-tune starts its own head fresh)", UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ Megatron-LM -> ours

    def architecture_from_megatron(self, args: argparse.Namespace | None, num_layers: int) -> dict[str, Any]:
        """The BertLightningModule arguments a checkpoint's ``args`` fix; refuses what our model lacks."""
        if not isinstance(args, argparse.Namespace):
            return {"num_layers": num_layers}
        get = lambda k, d=None: getattr(args, k, d)  # noqa: E731
        unsupported = [f"{k}={get(k)!r} ({what})" for k, (ok, what) in _UNSUPPORTED_ARGS.items() if get(k) not in ok]
        heads, hidden = get("num_attention_heads"), get("hidden_size")
        if get("kv_channels") and heads and hidden and get("kv_channels") * heads != hidden:
            unsupported.append(f"kv_channels={get('kv_channels')} (not hidden_size / num_attention_heads)")
        normalization = get("normalization", "LayerNorm")
        if normalization not in ("LayerNorm", "RMSNorm"):
            unsupported.append(f"normalization={normalization!r}")
        if unsupported:
            raise ValueError(f"the Megatron-LM checkpoint was trained with {', '.join(unsupported)}: "
                             f"BertLightningModule has no equivalent, so its logits would differ")
        hp: dict[str, Any] = {"num_layers": num_layers, "hidden_size": hidden, "num_attention_heads": heads,
                              "ffn_hidden_size": get("ffn_hidden_size") or (4 * hidden if hidden else None),
                              "max_sequence_length": get("max_position_embeddings"),
                              "layernorm_epsilon": get("norm_epsilon", get("layernorm_epsilon", 1e-5)),
                              "spec": "bert_layer_rmsnorm_spec" if normalization == "RMSNorm"
                              else "bert_layer_local_spec"}
        if get("bert_binary_head") is False:  # --bert-no-binary-head: no pooler, binary head or token types
            hp.update(add_binary_head=False, num_tokentypes=0)
        if get("bias_gelu_fusion") or get("bias_activation_fusion"):
            hp.update(activation="gelu_tanh", lm_head_activation="gelu")
        else:
            hp.update(activation="gelu", lm_head_activation=None)
        return {k: v for k, v in hp.items() if v is not None or k == "lm_head_activation"}

    def state_dict_from_megatron(self, state_dict: dict[str, torch.Tensor],
                                 architecture: dict[str, Any]) -> dict[str, torch.Tensor]:
        """BertModel ties the output layer to the word embedding: a copy of it (the last stage's) is checked
        equal and dropped."""
        sd = dict(state_dict)
        out_w, emb = sd.get("output_layer.weight"), sd.get("embedding.word_embeddings.weight")
        if out_w is not None and emb is not None:
            if not torch.equal(out_w, emb):
                raise ValueError("the Megatron-LM checkpoint has an output layer different from the word embedding "
                                 "(untied); BertLightningModule ties them")
            del sd["output_layer.weight"]
        return sd

    def tp_layout(self, state_dict: Mapping[str, torch.Tensor]) -> TPLayout:
        return BERT_TP_LAYOUT

    # ------------------------------------------------------------------ ours -> Hugging Face

    def hf_config(self, saved: SavedModel) -> Any:
        """``BertConfig`` (post-norm) or ``MegatronBertConfig`` (pre-norm): ``*ForSequenceClassification`` when a
        classifier is saved, ``*ForPreTraining`` when the binary head is, else ``*ForMaskedLM``."""
        from lightning_megatron.interop.hf_folder import import_transformers

        transformers = import_transformers("a transformers config")

        hp, sd = saved.hparams, saved.state_dict
        spec = hp.get("spec", "bert_layer_local_spec")
        if spec == "bert_layer_post_norm_spec":
            megatron = False
        elif spec == "bert_layer_local_spec" and hp.get("normalization", "LayerNorm") == "LayerNorm":
            megatron = True
        else:
            raise ValueError(f"spec={spec!r} has no transformers equivalent: export supports "
                             f"'bert_layer_post_norm_spec' (BertForPreTraining) and 'bert_layer_local_spec' with "
                             f"LayerNorm (MegatronBertForPreTraining)")
        unsupported = _hf_unsupported(hp)
        if unsupported:
            raise ValueError(f"the checkpoint's model has {', '.join(unsupported)}: transformers' BERT has no "
                             f"equivalent, so an export would not compute the same logits")
        activation = hp.get("activation", "gelu")
        head_activation = hp.get("lm_head_activation") or activation
        if head_activation != activation:
            raise ValueError(f"activation={activation!r} but lm_head_activation={head_activation!r}: transformers' "
                             f"BERT uses one hidden_act for the MLP and the LM head, so the export would not compute "
                             f"the same logits")
        if "embedding.tokentype_embeddings.weight" not in sd:
            raise ValueError("the checkpoint has no token-type embeddings; transformers' BERT needs them")
        word = sd["embedding.word_embeddings.weight"]
        layers = {int(k.split(".")[2]) for k in sd if k.startswith("encoder.layers.")}
        kwargs = dict(
            vocab_size=word.size(0), hidden_size=word.size(1), num_hidden_layers=max(layers) + 1 if layers else 0,
            num_attention_heads=int(hp.get("num_attention_heads", 4)),
            intermediate_size=sd["encoder.layers.0.mlp.linear_fc1.weight"].size(0),
            hidden_act=HF_ACTIVATION_NAMES[activation],
            hidden_dropout_prob=float(hp.get("hidden_dropout", 0.1)),
            attention_probs_dropout_prob=float(hp.get("attention_dropout", 0.1)),
            max_position_embeddings=sd["embedding.position_embeddings.weight"].size(0),
            type_vocab_size=sd["embedding.tokentype_embeddings.weight"].size(0),
            initializer_range=float(hp.get("init_method_std", 0.02)),
            layer_norm_eps=float(hp.get("layernorm_epsilon", 1e-12)),
            pad_token_id=0,
        )
        classifier = sd.get("classifier.weight")
        if classifier is not None:  # a fine-tuned classifier: transformers' sequence classifier, labels named
            kwargs.update(_classifier_config(saved, classifier.size(0), megatron))
        config = (transformers.MegatronBertConfig if megatron else transformers.BertConfig)(**kwargs)
        prefix = "MegatronBert" if megatron else "Bert"
        head = ("ForSequenceClassification" if classifier is not None
                else "ForPreTraining" if "binary_head.weight" in sd else "ForMaskedLM")
        config.architectures = [prefix + head]
        return config

    def state_dict_to_hf(self, saved: SavedModel, config: Any) -> dict[str, torch.Tensor]:
        from lightning_megatron.transformer import TransformerConfig

        ours = TransformerConfig(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                                 num_attention_heads=config.num_attention_heads,
                                 ffn_hidden_size=config.intermediate_size)
        model_type = "Bert" + config.architectures[0].removeprefix("MegatronBert").removeprefix("Bert")
        return hf_state_dict_from_bert(saved.state_dict, ours, config.vocab_size, model_type=model_type,
                                       megatron=config.model_type == "megatron-bert")

    def hf_tokenizer(self, saved: SavedModel, config: Any,
                     tokenizer: str | os.PathLike[str] | None) -> Callable[[Path], None]:
        """The WordPiece ``vocab.txt`` (``tokenizer``; None: the datamodule's ``vocab_file`` saved in the
        checkpoint, else the default vocabulary), its size equal to the model's vocabulary."""
        from lightning_megatron.data.tokenizer import BertTokenizer

        vocab, lowercase = _vocab_file(saved, tokenizer)
        # read as the run's tokenizer read it: a vocab.txt, a WordPiece tokenizer.json or a folder with either (a
        # tokenizer.json's lines were counted as pieces), cased or not
        ours = BertTokenizer(vocab, lowercase=lowercase)
        problem = tokenizer_size_problem(saved, ours.vocab_size, config.vocab_size, vocab, "--vocab_file")
        if problem is not None:
            raise ValueError(problem)
        config.pad_token_id = ours.pad_id  # the vocabulary's [PAD] (transformers' padding_idx): 0 was assumed
        pieces = ours.convert_ids_to_tokens(list(range(ours.vocab_size)))
        # a fine-tuned classifier's texts are cut where its run cut them (the datamodule's max_seq_length), so that a
        # pipeline's truncation is `finetune predict`'s; else the model's positions
        length = saved.datamodule_hparams.get("max_seq_length")
        fine_tuned = ("classifier.weight" in saved.state_dict and isinstance(length, int)
                      and not isinstance(length, bool))
        max_length = min(length, config.max_position_embeddings) if fine_tuned else config.max_position_embeddings
        return lambda folder: _save_tokenizer(pieces, folder, lowercase=ours.lowercase, max_length=max_length)


def _hf_unsupported(hp: Mapping[str, Any]) -> list[str]:
    """The settings of a saved BertModel (``hp``: flat hyper-parameters) transformers' BERT cannot compute."""
    heads, hidden = hp.get("num_attention_heads"), hp.get("hidden_size")
    found = []
    if hp.get("add_bias_linear") is False:
        found.append("add_bias_linear=False (linear layers without biases)")
    kv = hp.get("kv_channels")
    if kv is not None and heads and hidden and kv * heads != hidden:
        found.append(f"kv_channels={kv} (not hidden_size / num_attention_heads = {hidden // heads})")
    groups = hp.get("num_query_groups")
    if groups is not None and heads and groups != heads:
        found.append(f"num_query_groups={groups} (grouped-query attention)")
    if hp.get("gated_linear_unit"):
        found.append("gated_linear_unit=True (a gated MLP)")
    if hp.get("qk_layernorm"):
        found.append("qk_layernorm=True (norms of the queries and keys)")
    return found


def _classifier_config(saved: SavedModel, num_labels: int, megatron: bool) -> dict[str, Any]:
    """The config entries of transformers' ``*ForSequenceClassification`` for a classifier of ``num_labels``
    outputs: ``problem_type`` (one output: regression, as ``num_classes=1`` trained), the class names the checkpoint
    records (else transformers' ``LABEL_0``, ...) and the dropout before the classifier (BERT's
    ``classifier_dropout``; MegatronBERT's classifier takes ``hidden_dropout_prob``, which only training sees)."""
    names = saved.label_names if saved.label_names and len(saved.label_names) == num_labels else None
    out: dict[str, Any] = {"num_labels": num_labels,
                           "problem_type": "regression" if num_labels == 1 else "single_label_classification"}
    if names is not None and num_labels > 1:
        out.update(id2label=dict(enumerate(names)), label2id={name: i for i, name in enumerate(names)})
    if not megatron and saved.module_hparams.get("classifier_dropout") is not None:
        out["classifier_dropout"] = float(saved.module_hparams["classifier_dropout"])
    return out


def _vocab_file(saved: SavedModel, vocab_file: str | os.PathLike[str] | None) -> tuple[Path, bool | None]:
    """(the WordPiece vocabulary, lowercase or None: as the vocabulary says) the model was trained with: ``vocab_file``,
    else the run's data's (:func:`~lightning_megatron.data.dataset_vocab.trained_vocabulary`), else the packaged."""
    from lightning_megatron.data.dataset_vocab import trained_vocabulary

    lowercase = None
    if vocab_file is None:
        vocab_file, lowercase = trained_vocabulary(saved.datamodule_hparams)
    if vocab_file is None:
        from lightning_megatron.data.tokenizer import default_vocab_file

        vocab_file = default_vocab_file()
    vocab_file = Path(vocab_file)
    if not vocab_file.exists():
        raise FileNotFoundError(f"vocab file {str(vocab_file)!r} not found: pass --vocab_file with the vocabulary "
                                f"the model was trained with")
    return vocab_file, lowercase


def _save_tokenizer(pieces: list[str], out: Path, *, lowercase: bool, max_length: int) -> None:
    """WordPiece tokenizer files transformers 4.x and 5.x load with ``AutoTokenizer`` (``pieces`` in id order),
    plus ``vocab.txt``."""
    import inspect
    import tempfile

    from lightning_megatron.interop.hf_folder import import_transformers

    transformers = import_transformers("writing a transformers tokenizer")

    kwargs = dict(do_lower_case=lowercase, model_max_length=max_length)
    text = "".join(p + "\n" for p in pieces)
    if "vocab" in inspect.signature(transformers.BertTokenizer.__init__).parameters:  # transformers >= 5
        tokenizer = transformers.BertTokenizer(vocab={p: i for i, p in enumerate(pieces)}, **kwargs)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "vocab.txt").write_text(text, encoding="utf-8")
            tokenizer = transformers.BertTokenizerFast(vocab_file=str(Path(tmp) / "vocab.txt"), **kwargs)
    tokenizer.save_pretrained(out)
    if not (out / "vocab.txt").is_file():
        (out / "vocab.txt").write_text(text, encoding="utf-8")


def architecture_conflicts(hparams: dict[str, Any], source: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, the module's value, the source's)`` for every argument of ``hparams`` the source fixes
    otherwise (a missing ``ffn_hidden_size`` is ``4 * hidden_size``, a missing ``lm_head_activation`` the
    ``activation``; a ``None`` vocabulary on either side is read from the data and checked on the tensors; a model
    without the binary head may start from a source with one)."""
    wrong = []
    for key in ARCHITECTURE_KEYS:
        if key not in source or key not in hparams:
            continue
        want, have = source[key], hparams.get(key)
        if want is None and key != "lm_head_activation":
            continue  # the source does not fix it (a checkpoint saved with vocab_size=None read the datamodule's)
        if key == "ffn_hidden_size" and have is None:
            have = 4 * hparams["hidden_size"]
        if key == "lm_head_activation":
            want, have = want or source.get("activation"), have or hparams.get("activation")
        if key == "vocab_size" and have is None:
            continue  # read from the datamodule: checked against the tensors' shapes
        if key == "add_binary_head" and not have:
            continue  # a model without the pooler and binary head starts from a source with them (left unread)
        if isinstance(want, float) and isinstance(have, (int, float)):
            if abs(want - have) <= 1e-12 * max(abs(want), 1e-30):
                continue
        elif want == have:
            continue
        wrong.append((key, have, want))
    return wrong


def check_architecture(hparams: dict[str, Any], source: dict[str, Any], source_name: str) -> None:
    """Raise listing every module argument that differs from what the source needs."""
    refuse_architecture(architecture_conflicts(hparams, source), source_name, flag_prefix="--model.config.")
