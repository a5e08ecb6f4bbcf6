"""Megatron-LM (megatron-core) BERT and GPT checkpoints -> one full state dict under our names.

GPT checkpoints (``decoder.*`` tensors) are recognised here and their architecture is read by
:mod:`lightning_megatron.models.gpt.megatron_lm`; their SwiGLU ``linear_fc1`` shards are regrouped.

Two formats, any TP/PP (and VP) layout they were saved at:

- legacy per-rank files (``--ckpt-format torch``): ``[iter_XXXXXXX/]mp_rank_TT[_PPP]/model_optim_rng.pt``,
  each rank's ``state_dict()`` of megatron-core's ``BertModel`` (``model``, or ``model0``,
  ``model1``... per virtual stage) with stage-local layer numbers. The TP shards are concatenated
  along their partition dims (qkv rows are already head-major, as ours), layer numbers made global,
  ``_extra_state`` entries dropped. Read with ``torch.load(weights_only=True)``, allowing only
  ``argparse.Namespace``, NumPy's RNG-state arrays and the Megatron-LM enums of ``args`` (read as
  inert :class:`MegatronRecord` s, see :data:`MEGATRON_ARGS_CLASSES`) besides tensors;
- megatron-core's ``torch_dist`` (DCP) format: global tensors, the layers stacked along a leading
  dim under ``encoder.layers.<name>``, read on one process with DCP.

megatron-core's layer names equal ours, except the Transformer-Engine spec's norms fused into the
next linear (``linear_qkv.layer_norm_weight`` -> ``input_layernorm.weight``,
``linear_fc1.layer_norm_weight`` -> ``pre_mlp_layernorm.weight``). Megatron pads its vocabulary:
the padding rows are dropped when loading (``init_from`` keeps the model's ``vocab_size`` rows).
Models trained with ``--bias-gelu-fusion`` need ``activation=gelu_tanh, lm_head_activation=gelu``
(tanh GELU in the MLP, exact GELU in the LM head): the architecture read from ``args`` says so.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.saved_model import SavedModel

__all__ = ["is_megatron_checkpoint", "read_megatron_checkpoint", "read_legacy_checkpoint",
           "read_torch_dist_checkpoint", "normalize_megatron_keys", "read_args", "read_megatron_architecture",
           "MegatronRecord",
           "MEGATRON_ARGS_CLASSES"]

_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_RANK_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?$")


def _iteration_dir(path: Path) -> Path:
    """The directory holding ``mp_rank_*`` dirs or a torch_dist checkpoint (root -> latest iteration)."""
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        it = tracker.read_text().strip()
        return path / ("release" if it == "release" else f"iter_{int(it):07d}")
    return path


def is_megatron_checkpoint(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    if path.is_file():
        return path.name == "model_optim_rng.pt"
    d = _iteration_dir(path)
    return d.is_dir() and (any(_RANK_DIR.match(p.name) for p in d.iterdir())
                           or (d / "metadata.json").is_file() and (d / ".metadata").is_file())


def normalize_megatron_keys(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Drop ``_extra_state`` and non-tensors; rename Transformer-Engine fused norms to ours."""
    out = {}
    for key, value in sd.items():
        if key.endswith("_extra_state") or not torch.is_tensor(value):
            continue
        for fused, ours in _FUSED_NORMS.items():
            if key.endswith(fused):
                key = key[: -len(fused)] + ours
                break
        out[key] = value
    return out


def _tie(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out_w, emb = sd.get("output_layer.weight"), sd.get("embedding.word_embeddings.weight")
    if out_w is not None and emb is not None:
        if not torch.equal(out_w, emb):
            raise ValueError("the Megatron-LM checkpoint has an output layer different from the word embedding "
                             "(untied); BertLightningModule ties them")
        del sd["output_layer.weight"]
    return sd


class MegatronRecord:
    """An inert stand-in for a Megatron-LM object in a checkpoint's ``args`` (an enum member such as
    ``AttnBackend.auto``): the class's full name and the arguments it was pickled with. Nothing of
    Megatron-LM is imported and no code of the file runs."""

    __slots__ = ("name", "args")

    def __init__(self, name: str, args: tuple[Any, ...]) -> None:
        self.name, self.args = name, args

    def __repr__(self) -> str:
        return f"{self.name}{self.args!r}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MegatronRecord) and (self.name, self.args) == (other.name, other.args)

    __hash__ = None  # type: ignore[assignment]


class _Record:
    """The callable the unpickler finds under a known Megatron-LM class name: builds a MegatronRecord."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any) -> MegatronRecord:
        return MegatronRecord(self.name, args)


MEGATRON_ARGS_CLASSES = tuple(f"megatron.core.{name}" for name in (
    "enums.ModelType", "enums.Fp8Recipe", "transformer.enums.ModelType", "transformer.enums.AttnBackend",
    "transformer.enums.AttnMaskType", "transformer.enums.AttnType", "transformer.enums.LayerType",
    "transformer.enums.CudaGraphScope", "rerun_state_machine.RerunMode", "rerun_state_machine.RerunState",
    "rerun_state_machine.RerunDiagnostic", "rerun_state_machine.Caller", "optimizer.optimizer_config.ParamKey"))
"""Megatron-LM classes (enums) that current Megatron-LM pickles in ``args`` and that a legacy checkpoint
may hold: read as :class:`MegatronRecord` s. Any other global is refused."""


def _load_rank_file(path: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` allowing ``argparse.Namespace``, NumPy RNG-state arrays and the
    :data:`MEGATRON_ARGS_CLASSES` (as inert records) besides tensors."""
    import numpy as np

    allowed: list[Any] = [argparse.Namespace, np.ndarray, np.dtype]
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            allowed.append(__import__(name, fromlist=["_reconstruct"])._reconstruct)
            break
        except (ImportError, AttributeError):
            continue
    allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "float32")]
    allowed += [(_Record(name), name) for name in MEGATRON_ARGS_CLASSES]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - name the file, the cause and the way out
        raise ValueError(f"{str(path)!r} cannot be read with torch.load(weights_only=True): {e}. Re-save its model "
                         f"state alone where you trust the file: torch.save({{'model': ckpt['model']}}, path)") from e


def read_args(path: str | os.PathLike[str]) -> argparse.Namespace | None:
    """The ``args`` saved in a legacy rank file (``model_optim_rng.pt``), or None."""
    state = _load_rank_file(Path(path))
    args = state.get("args") if isinstance(state, dict) else None
    return args if isinstance(args, argparse.Namespace) else None


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


def _architecture(args: Any, num_layers: int) -> dict[str, Any]:
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
        raise ValueError(f"the Megatron-LM checkpoint was trained with {', '.join(unsupported)}: BertLightningModule "
                         f"has no equivalent, so its logits would differ")
    hp: dict[str, Any] = {"num_layers": num_layers, "hidden_size": hidden, "num_attention_heads": heads,
                          "ffn_hidden_size": get("ffn_hidden_size") or (4 * hidden if hidden else None),
                          "max_sequence_length": get("max_position_embeddings"),
                          "layernorm_epsilon": get("norm_epsilon", get("layernorm_epsilon", 1e-5)),
                          "spec": "bert_layer_rmsnorm_spec" if normalization == "RMSNorm" else "bert_layer_local_spec"}
    if get("bias_gelu_fusion") or get("bias_activation_fusion"):
        hp.update(activation="gelu_tanh", lm_head_activation="gelu")
    else:
        hp.update(activation="gelu", lm_head_activation=None)
    return {k: v for k, v in hp.items() if v is not None or k == "lm_head_activation"}


def read_legacy_checkpoint(path: str | os.PathLike[str]) -> SavedModel:
    """Merge the per-rank ``model_optim_rng.pt`` files of one iteration (any TP/PP/VP)."""
    path = Path(path)
    if path.is_file():
        files = {(0, 0): path}
    else:
        d = _iteration_dir(path)
        files = {}
        for sub in d.iterdir():
            m = _RANK_DIR.match(sub.name)
            if m and (sub / "model_optim_rng.pt").is_file():
                files[(int(m.group(1)), int(m.group(2) or 0))] = sub / "model_optim_rng.pt"
        if not files:
            raise FileNotFoundError(f"no mp_rank_*/model_optim_rng.pt under {str(d)!r}")
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    if len(files) != tp * pp:
        raise ValueError(f"{str(path)!r}: expected {tp} x {pp} rank files (TP x PP), found {len(files)}")
    args = None
    # stage -> list over virtual chunks of the TP-merged state dict
    stages: dict[int, list[dict[str, torch.Tensor]]] = {}
    for p in range(pp):
        per_tp = [_load_rank_file(files[(t, p)]) for t in range(tp)]
        args = per_tp[0].get("args", args)
        chunk_keys = sorted((k for k in per_tp[0] if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
        if not chunk_keys:
            raise ValueError(f"{str(files[(0, p)])!r} has no 'model' state dict")
        stages[p] = [_merge_tp([normalize_megatron_keys(x[k]) for x in per_tp]) for k in chunk_keys]
    vp = len(stages[0])
    decoder = any(k.startswith("decoder.") for c in stages[0] for k in c)
    layers = "decoder" if decoder else "encoder"
    full: dict[str, torch.Tensor] = {}
    local_layers = [len({int(k.split(".")[2]) for k in c if k.startswith(f"{layers}.layers.")})
                    for p in range(pp) for c in stages[p]]
    per_chunk = local_layers[0]
    if any(n != per_chunk for n in local_layers):
        raise ValueError(f"uneven layers per pipeline chunk {local_layers} are not supported")
    for p in range(pp):
        for c, sd in enumerate(stages[p]):
            offset = (c * pp + p) * per_chunk  # Megatron's (interleaved) layer assignment
            for key, value in sd.items():
                m = re.match(rf"{layers}\.layers\.(\d+)\.(.*)", key)
                if m:
                    key = f"{layers}.layers.{offset + int(m.group(1))}.{m.group(2)}"
                elif key == "output_layer.weight" and "embedding.word_embeddings.weight" in full and not decoder:
                    if not torch.equal(value, full["embedding.word_embeddings.weight"]):
                        raise ValueError("the Megatron-LM checkpoint's last-stage output layer differs from the "
                                         "word embedding (untied); BertLightningModule ties them")
                    continue
                full.setdefault(key, value)
    return _saved_model(full, args, per_chunk * pp * vp, {"tp": tp, "pp": pp, "vp": vp})


def _merge_tp(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The TP shards of one chunk merged; a decoder's SwiGLU ``linear_fc1`` (each rank ``[gate_r; up_r]``:
    twice the rows its ``linear_fc2`` has columns) is regrouped as ``[gate; up]``."""
    from lightning_megatron.models.bert.hf import merge_tp_state_dicts

    if not any(k.startswith("decoder.") for k in shards[0]):
        return merge_tp_state_dicts(shards)
    from lightning_megatron.models.gpt.hf import merge_tp_shards

    fc1 = next((k for k in shards[0] if k.endswith("mlp.linear_fc1.weight")), None)
    gated = fc1 is not None and shards[0][fc1].size(0) == 2 * shards[0][fc1.replace("fc1", "fc2")].size(1)
    return merge_tp_shards(shards, gated_linear_unit=gated)


def _saved_model(full: dict[str, torch.Tensor], args: Any, num_layers: int,
                 layout: dict[str, Any] | None = None) -> SavedModel:
    """BERT's (tied, its ``args`` checked) or the decoder family's
    (:mod:`lightning_megatron.models.gpt.megatron_lm`)."""
    if any(k.startswith("decoder.") for k in full):
        from lightning_megatron.models.gpt.megatron_lm import gpt_saved_model

        return gpt_saved_model(full, args, num_layers, layout or {})
    return SavedModel(state_dict=_tie(full), hparams=_architecture(args, num_layers), layout=layout or {})


def read_torch_dist_checkpoint(path: str | os.PathLike[str]) -> SavedModel:
    """A megatron-core ``torch_dist`` checkpoint's model tensors (global, layers stacked) on one process."""
    from lightning_megatron import dcp_io

    d = _iteration_dir(Path(path))
    metadata = dcp_io.read_metadata(d, allow_bytes=True).state_dict_metadata
    prefixes = ("embedding.", "encoder.", "decoder.", "lm_head.", "output_layer.", "pooler.", "binary_head.")
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in metadata.items()
             if hasattr(md, "size") and k.startswith(prefixes) and not k.endswith("_extra_state")}
    if not state:
        raise ValueError(f"{str(d)!r} holds no model tensors (expected embedding.*, encoder.* / decoder.* ... keys)")
    dcp_io.load(state, d, single_process=True, allow_bytes=True)
    full: dict[str, torch.Tensor] = {}
    num_layers = 0
    for key, value in normalize_megatron_keys(state).items():
        stack = next((p for p in ("encoder.layers.", "decoder.layers.") if key.startswith(p)), None)
        if stack:  # stacked [L, ...]: one tensor per layer
            rest = key[len(stack):]
            num_layers = value.size(0)
            for i in range(value.size(0)):
                full[f"{stack}{i}.{rest}"] = value[i].clone()
        else:
            full[key] = value
    args = None
    if (d / "common.pt").is_file():  # megatron-core saves its args there
        try:
            args = read_args(d / "common.pt")
        except ValueError as e:
            import warnings

            warnings.warn(f"{str(d / 'common.pt')!r}: the training arguments are not read ({e}); the model's "
                          f"architecture arguments are checked against the tensors' shapes only", UserWarning,
                          stacklevel=2)
    return _saved_model(full, args, num_layers)


def read_megatron_architecture(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The module arguments a Megatron-LM checkpoint's ``args`` fix, reading one rank file (legacy)."""
    path = Path(path)
    d = path if path.is_file() else _iteration_dir(path)
    if d.is_dir() and (d / ".metadata").is_file():
        return read_torch_dist_checkpoint(d).hparams
    first = path if path.is_file() else next((sub / "model_optim_rng.pt" for sub in sorted(d.iterdir())
                                              if _RANK_DIR.match(sub.name)), None)
    state = _load_rank_file(first) if first is not None and first.is_file() else {}
    args = state.get("args") if isinstance(state, dict) else None
    decoder = isinstance(state, dict) and any(k.startswith("decoder.") for m in state if re.fullmatch(r"model\d*", m)
                                              for k in state[m])
    if not isinstance(args, argparse.Namespace) or not getattr(args, "num_layers", None) or decoder:
        return read_legacy_checkpoint(path).hparams  # the layers counted from the tensors (a decoder's shapes)
    return _architecture(args, int(args.num_layers))


def read_megatron_checkpoint(path: str | os.PathLike[str]) -> SavedModel:
    path = Path(path)
    d = path if path.is_file() else _iteration_dir(path)
    if d.is_dir() and (d / ".metadata").is_file():
        return read_torch_dist_checkpoint(d)
    return read_legacy_checkpoint(path)
