"""A LoRA checkpoint of a Llama-family decoder -> a PEFT adapter folder (``peft.PeftModel.from_pretrained`` loads it).

Our adapters sit on the fused projections (:mod:`lightning_megatron.transformer.lora`); peft's on transformers'
separate ones. One fused adapter is several peft adapters exactly:

- ``linear_qkv`` (A [r, h], B [(n + 2g) d, r]) -> ``q_proj``, ``k_proj``, ``v_proj``, each with ``lora_A`` = A and
  ``lora_B`` = B's q, k or v rows (the rows of the fused weight, :func:`~.hf.qkv_to_separate`);
- ``linear_fc1`` (SwiGLU, B [2f, r] = [gate; up]) -> ``gate_proj``, ``up_proj``, each with ``lora_A`` = A;
- ``linear_proj`` -> ``o_proj``, ``linear_fc2`` -> ``down_proj`` as they are.

``x W_q^T + s B_q A x`` is the q rows of ``x W_qkv^T + s B A x``: the folder computes our logits.
The folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
``base_model_name_or_path``: the run's ``init_from``) and ``adapter_model.safetensors``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.interop.hf_folder import swap_in_folder
from lightning_megatron.models.gpt.hf import qkv_to_separate
from lightning_megatron.models.gpt.hf_config import hf_model_type
from lightning_megatron.transformer.lora import ADAPTER_IN, ADAPTER_OUT, LoRAConfig

__all__ = ["peft_state_dict", "write_peft_folder", "PEFT_TARGETS"]

PEFT_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
"""Our adapted projection -> the transformers Llama modules its adapter becomes."""
_PLACE = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}
_OURS = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}


def peft_state_dict(adapters: Mapping[str, torch.Tensor], arch: Mapping[str, Any], lora: LoRAConfig
                    ) -> dict[str, torch.Tensor]:
    """peft's saved names (``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight``) -> tensors, from our
    adapters' global tensors. Llama-shaped decoders (Llama, Qwen2, Qwen3) without experts only."""
    model_type = hf_model_type(arch)
    if model_type not in ("llama", "qwen2", "qwen3") or arch.get("num_moe_experts"):
        raise ValueError(f"a PEFT adapter folder is written for Llama-shaped decoders without experts; this model is "
                         f"{model_type!r}: export the merged model (export hf) instead")
    n, g = arch["num_attention_heads"], arch.get("num_query_groups") or arch["num_attention_heads"]
    out: dict[str, torch.Tensor] = {}
    for i in range(int(arch["num_layers"])):
        for ours in lora.target_modules:
            prefix = f"decoder.layers.{i}.{_OURS[ours]}.{ours}."
            a, b = adapters[prefix + ADAPTER_IN], adapters[prefix + ADAPTER_OUT]
            if ours == "linear_qkv":
                bs = qkv_to_separate(b, n, g)
            elif ours == "linear_fc1":
                bs = b.chunk(2, dim=0)
            else:
                bs = (b,)
            for module, b_part in zip(PEFT_TARGETS[ours], bs):
                where = f"base_model.model.model.layers.{i}.{_PLACE[ours]}.{module}."
                out[where + "lora_A.weight"] = a.contiguous().clone()
                out[where + "lora_B.weight"] = b_part.contiguous().clone()
    return out


def write_peft_folder(adapters: Mapping[str, torch.Tensor], arch: Mapping[str, Any], lora: LoRAConfig,
                      out: Path, *, base_model: str | None) -> Path:
    """``out/`` with ``adapter_config.json`` and ``adapter_model.safetensors``, written under a temporary name
    beside it and renamed into place. ``base_model``: the folder the run started from (made absolute where it is a
    folder here: a relative path would name another folder from another working directory), or a hub id."""
    from safetensors.torch import save_file

    if base_model is not None and Path(base_model).is_dir():
        base_model = str(Path(base_model).resolve())
    tensors = peft_state_dict(adapters, arch, lora)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "target_modules": sorted(m for ours in lora.target_modules for m in PEFT_TARGETS[ours]),
              "base_model_name_or_path": base_model, "use_rslora": False, "init_lora_weights": True}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.peft-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        swap_in_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
