"""init_from megatron-core's own GPTModel checkpoints (needs megatron-core: the ``bench`` extra).

In a throwaway process (CPU shims as in ``test_bert_megatron_import.py``), megatron-core's ``GPTModel``
with its local spec in the Llama shape (RMSNorm, 4 heads / 2 query groups, SwiGLU, rope base 5000, no
biases, untied output layer, vocabulary padded to 128) computes reference logits and saves its
``state_dict()`` as a legacy ``model_optim_rng.pt`` (with Megatron-LM-style ``args``) and its
``sharded_state_dict()`` with ``dist_checkpointing.save`` (``torch_dist``). ``GPTLightningModule``
started from each (``init_from``, one process) gives megatron-core's logits within 1e-5 (fp32).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (the bench extra)")

VOCAB, PADDED, SEQ = 100, 128, 16
OURS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,  # GPTConfig fields
            vocab_size=VOCAB, max_sequence_length=SEQ, spec="llama_layer_spec", activation="silu",
            gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope", rotary_base=5000.0,
            untie_embeddings_and_output_weights=True, layernorm_epsilon=1e-5, hidden_dropout=0.0,
            attention_dropout=0.0)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(4))


def write_megatron_checkpoints(root: str) -> None:
    """megatron-core's GPTModel, its logits and its two checkpoint formats (a fresh single process)."""
    import contextlib
    import datetime
    import os
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel as mtp
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29743"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    mps.initialize_model_parallel(1, 1)

    class _CPUBuffer:  # megatron-core's attention scratch buffer is allocated on CUDA: a CPU one here
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tuple(tensor_shape), dtype=dtype)

    mps._GLOBAL_MEMORY_BUFFER = _CPUBuffer()
    mtp.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # dropout is off
    # Its rotary embedding moves its frequencies to the current CUDA device, its checkpoint writer
    # synchronizes CUDA: CPU in this throwaway process.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    root = Path(root)
    for qk in (False, True):  # the Llama shape; with norms of each head's queries and keys (Qwen3's, qk_layernorm)
        _write_one(root / "qk" if qk else root, qk, TransformerConfig, GPTModel, get_gpt_layer_local_spec,
                   dist_checkpointing)
    dist.destroy_process_group()


def _write_one(root, qk, TransformerConfig, GPTModel, get_gpt_layer_local_spec, dist_checkpointing) -> None:
    import argparse

    import torch.nn.functional as F

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, gated_linear_unit=True, activation_func=F.silu,
                            normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            init_method_std=0.2, bias_activation_fusion=False, masked_softmax_fusion=False,
                            persist_layer_norm=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
                            apply_rope_fusion=False, qk_layernorm=qk)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk)
    model = GPTModel(config=cfg, transformer_layer_spec=spec,
                     vocab_size=PADDED, max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=5000).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms away from 1, so a misplaced norm shows
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
        tokens = _tokens()
        position_ids = torch.arange(SEQ).expand_as(tokens)
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
        logits = model(tokens, position_ids, causal)  # its default causal mask is built on CUDA
    root.mkdir(parents=True, exist_ok=True)
    torch.save({"ref": logits[..., :VOCAB].clone()}, root / "reference.pt")
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                              num_query_groups=2, ffn_hidden_size=48, swiglu=True, normalization="RMSNorm",
                              norm_epsilon=1e-5, add_bias_linear=False, position_embedding_type="rope",
                              rotary_base=5000, rotary_percent=1.0, untie_embeddings_and_output_weights=True,
                              max_position_embeddings=SEQ, kv_channels=8, padded_vocab_size=PADDED, qk_layernorm=qk)
    d = root / "legacy" / "iter_0000001" / "mp_rank_00"
    d.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "args": args, "iteration": 1, "checkpoint_version": 3.0},
               d / "model_optim_rng.pt")
    (root / "legacy" / "latest_checkpointed_iteration.txt").write_text("1")
    (root / "torch_dist").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(root / "torch_dist"))


@pytest.fixture(scope="module")
def megatron_root(tmp_path_factory):
    import os
    import subprocess
    import sys

    from lightning_megatron.check.spawn import free_port

    root = tmp_path_factory.mktemp("megatron_gpt")
    here = os.path.dirname(__file__)
    env = dict(os.environ, MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", "import sys, test_gpt_megatron_core as t; "
                           "t.write_megatron_checkpoints(sys.argv[1])", str(root)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


@pytest.mark.parametrize("qk", [False, True], ids=["llama", "qk_layernorm"])
@pytest.mark.parametrize("source", ["legacy", "torch_dist"])
def test_init_from_megatron_core_gpt_gives_its_logits(megatron_root, source, qk):
    """(With ``qk_layernorm``, refused until 2026-12-07.)"""
    from lightning_megatron.models.gpt.module import GPTLightningModule

    megatron_root = megatron_root / "qk" if qk else megatron_root
    ours = {**OURS, "qk_layernorm": qk}
    if source == "legacy":  # its args give the architecture
        module = GPTLightningModule.from_pretrained(str(megatron_root / source), config=dict(
            vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0))
        assert {k: module.hparams["config"][k] for k in ours} == ours
    else:  # no args saved beside it here: the architecture given, checked against the tensors
        module = GPTLightningModule(ours, init_from=str(megatron_root / source))
    module.configure_model()
    with torch.no_grad():
        ours = module.eval().model_chunks[0](_tokens())[..., :VOCAB]
    ref = torch.load(megatron_root / "reference.pt", weights_only=True)["ref"]
    err = float((ours - ref).abs().max())
    assert err <= 1e-5, f"max |ours - megatron-core| = {err:.2e} (largest logit {float(ref.abs().max()):.2f})"
