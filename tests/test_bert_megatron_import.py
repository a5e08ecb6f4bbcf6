"""init_from Megatron-LM: a megatron-core BertModel's checkpoints, legacy per-rank and torch_dist, at TP=2.

One spawned run of 2 gloo ranks: megatron-core builds a BertModel (local spec, ``bias_activation_fusion``
= Megatron-LM's ``--bias-gelu-fusion``: tanh GELU in the MLP, exact GELU in the LM head) and writes
- a legacy ``iter_0000001/mp_rank_00/model_optim_rng.pt`` (with ``args`` and NumPy RNG state, as
  Megatron-LM does), and the same weights split into TP=2 x PP=2 rank files;
- a ``torch_dist`` checkpoint with ``megatron.core.dist_checkpointing.save``.
Our model at TP=2 starts from each with the one ``init_from`` reader and must give megatron-core's
logits within 1e-5; with exact GELU in the MLP (the flag ignored) it must not.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dist_utils import run_distributed
from lightning_megatron.parallel_dims import ParallelDims

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (the bench extra)")

VOCAB, PADDED, SEQ = 100, 128, 16


def _megatron_model(binary_head: bool = True):
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            layernorm_epsilon=1e-5, bias_activation_fusion=True, masked_softmax_fusion=False,
                            persist_layer_norm=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False)
    torch.manual_seed(0)
    model = BertModel(config=cfg, num_tokentypes=2 if binary_head else 0, transformer_layer_spec=bert_layer_local_spec,
                      vocab_size=PADDED, max_sequence_length=SEQ, add_binary_head=binary_head, parallel_output=True,
                     share_embeddings_and_output_weights=True).eval()  # as pretrain_bert.py builds it
    with torch.no_grad():  # O(1) GELU inputs (a fresh init gives ~0.1), where tanh and exact GELU differ
        for layer in model.encoder.layers:
            layer.mlp.linear_fc1.weight.mul_(30)
        model.lm_head.dense.weight.mul_(30)
    return model


def _split_legacy(sd: dict, root, args) -> None:
    """The TP=1 state dict as Megatron-LM would save it at TP=2 x PP=2 (stage-local layer numbers)."""
    from lightning_megatron.models.bert.hf import _shard

    for pp in range(2):
        for tp in range(2):
            part = {}
            for k, v in sd.items():
                if k.startswith("encoder.layers."):
                    i = int(k.split(".")[2])
                    if i // 2 != pp:
                        continue
                    k = f"encoder.layers.{i % 2}." + k.split(".", 3)[3]
                elif k.startswith("embedding.") and pp != 0 or not k.startswith(("embedding.", "encoder.")) and pp != 1:
                    continue
                part[k] = v if k.endswith("_extra_state") else _shard(k, v, tp, 2)
            if pp == 1:
                part["output_layer.weight"] = _shard("output_layer.weight", sd["embedding.word_embeddings.weight"], tp, 2)
            d = root / "tp2pp2" / "iter_0000001" / f"mp_rank_{tp:02d}_{pp:03d}"
            d.mkdir(parents=True)
            torch.save({"model": part, "args": args, "iteration": 1, "checkpoint_version": 3.0}, d / "model_optim_rng.pt")
    (root / "tp2pp2" / "latest_checkpointed_iteration.txt").write_text("1")


def write_megatron_checkpoints(root: str) -> None:
    """In a fresh (non-daemonic) single process: megatron-core's model, its logits and its checkpoints."""
    import argparse
    import contextlib
    import datetime
    import os
    from pathlib import Path

    import numpy as np
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel as mtp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29741"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    mps.initialize_model_parallel(1, 1)

    class _CPUBuffer:  # megatron-core's attention scratch buffer is allocated on CUDA: a CPU one here
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tuple(tensor_shape), dtype=dtype)

    mps._GLOBAL_MEMORY_BUFFER = _CPUBuffer()
    # Its CUDA RNG tracker cannot exist without CUDA; dropout is off, so no stream is drawn from.
    mtp.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    root = Path(root)
    mc = _megatron_model()
    tokens, mask, types = _inputs()
    with torch.no_grad():
        ref_logits, ref_binary = mc(tokens, mask, tokentype_ids=types)
    torch.save({"ref": ref_logits[..., :VOCAB].clone(), "ref_binary": ref_binary.clone()}, root / "reference.pt")
    args = argparse.Namespace(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                              max_position_embeddings=SEQ, norm_epsilon=1e-5, bias_gelu_fusion=True,
                              tensor_model_parallel_size=1, params_dtype=torch.float32)
    d = root / "legacy" / "iter_0000001" / "mp_rank_00"
    d.mkdir(parents=True)
    torch.save({"model": mc.state_dict(), "args": args, "iteration": 1, "checkpoint_version": 3.0,
                "rng_state": [{"np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}]},
               d / "model_optim_rng.pt")
    (root / "legacy" / "latest_checkpointed_iteration.txt").write_text("1")
    _split_legacy(mc.state_dict(), root, args)
    # --bert-no-binary-head: no pooler, binary head or token-type embeddings (pretrain_bert.py's num_tokentypes 0)
    bare = _megatron_model(binary_head=False)
    with torch.no_grad():
        ref_bare, _ = bare(tokens, mask, tokentype_ids=None)
    torch.save({"ref": ref_bare[..., :VOCAB].clone()}, root / "reference_no_binary_head.pt")
    d = root / "no_binary_head" / "iter_0000001" / "mp_rank_00"
    d.mkdir(parents=True)
    torch.save({"model": bare.state_dict(), "args": argparse.Namespace(**vars(args), bert_binary_head=False),
                "iteration": 1, "checkpoint_version": 3.0}, d / "model_optim_rng.pt")
    (root / "no_binary_head" / "latest_checkpointed_iteration.txt").write_text("1")
    (root / "torch_dist").mkdir()
    # Its writer synchronizes CUDA and reduces a flag on the CUDA device: CPU in this throwaway process.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    dist_checkpointing.save(mc.sharded_state_dict(), str(root / "torch_dist"))
    dist.destroy_process_group()


def _inputs():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, 10:] = 0
    types = (torch.arange(SEQ) >= 8).long().expand(3, SEQ).contiguous()
    return tokens, mask, types


def _worker(root: str) -> dict:
    from pathlib import Path

    import torch.distributed as dist

    from lightning_megatron.models.bert import BertModel
    from lightning_megatron.models.bert.interop import check_architecture
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.parallel_state import initialize_model_parallel
    from lightning_megatron.saved_model import load_full_state_dict
    from lightning_megatron.transformer import TransformerConfig

    root = Path(root)
    tokens, mask, types = _inputs()
    ps = initialize_model_parallel(ParallelDims(tp=2, pp=1))
    out = torch.load(root / "reference.pt", weights_only=True)
    for name in ("legacy", "tp2pp2", "torch_dist"):
        saved = BertLightningModule.read_pretrained(root / name)
        for exact_mlp in (False, True):
            activation = "gelu" if exact_mlp else "gelu_tanh"
            cfg = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                    hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
                                    tensor_model_parallel_size=2, activation=activation)
            model = BertModel(cfg, "bert_layer_local_spec", VOCAB, SEQ, tp_group=ps.tp_group,
                              lm_head_activation="gelu").eval()  # its vocab-padded tensors carry the real size
            if name == "legacy" and not exact_mlp:
                check_architecture(dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                        spec="bert_layer_local_spec", activation=activation,
                                        lm_head_activation="gelu", layernorm_epsilon=1e-5,
                                        max_sequence_length=SEQ), saved.hparams, name)
            load_full_state_dict([model], list(model.named_parameters()), saved.state_dict,
                                 coordinates=ps.coordinates, sizes=ps.dims.sizes(), num_layers=4, source_name=name)
            with torch.no_grad():
                logits, binary = model(tokens, mask, types)
            parts = [torch.empty_like(logits) for _ in range(2)]
            dist.all_gather(parts, logits.contiguous(), group=ps.tp_group)
            out[f"{name}-exact{exact_mlp}"] = (torch.cat(parts, -1)[..., :VOCAB], binary)
        out[f"{name}-hparams"] = saved.hparams
    # the checkpoint without binary head or token types, through the module at TP=2 (the batch's types left out)
    module = BertLightningModule.from_pretrained(str(root / "no_binary_head"), config=dict(
        vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0))
    module.connect_parallel_state(ps)
    module.configure_model()
    with torch.no_grad():
        logits, binary = module.eval().model_chunks[0](tokens, mask, types)
    parts = [torch.empty_like(logits) for _ in range(2)]
    dist.all_gather(parts, logits.contiguous(), group=ps.tp_group)
    out["no_binary_head"] = (torch.cat(parts, -1)[..., :VOCAB], binary,
                             torch.load(root / "reference_no_binary_head.pt", weights_only=True)["ref"])
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    import os
    import subprocess
    import sys

    from lightning_megatron.check.spawn import free_port

    root = tmp_path_factory.mktemp("megatron")
    here = os.path.dirname(__file__)
    env = dict(os.environ, MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", "import sys, test_bert_megatron_import as t; "
                           "t.write_megatron_checkpoints(sys.argv[1])", str(root)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_distributed(_worker, 2, str(root), timeout=300)


@pytest.mark.parametrize("source", ["legacy", "tp2pp2", "torch_dist"])
def test_init_from_megatron_checkpoint_matches_megatron_core(measured, source):
    # megatron-core also masks padded QUERIES (their outputs are meaningless either way): real tokens only.
    real = _inputs()[1].bool()
    for r in measured:
        logits, binary = r[f"{source}-exactFalse"]
        torch.testing.assert_close(logits[real], r["ref"][real], rtol=0, atol=1e-5)
        torch.testing.assert_close(binary, r["ref_binary"], rtol=0, atol=1e-5)
        # Exact GELU in the MLP (the --bias-gelu-fusion numerics ignored) is measurably different.
        wrong, _ = r[f"{source}-exactTrue"]
        assert (wrong[real] - r["ref"][real]).abs().max() > 1e-4


def test_legacy_args_give_the_bias_gelu_fusion_numerics(measured):
    hp = measured[0]["legacy-hparams"]
    assert hp["activation"] == "gelu_tanh" and hp["lm_head_activation"] == "gelu" and hp["num_layers"] == 4
    assert measured[0]["tp2pp2-hparams"]["num_layers"] == 4


def test_a_checkpoint_trained_without_binary_head_matches_megatron_core(measured):
    """``--bert-no-binary-head`` (no pooler, binary head or token types; refused until 2026-12-07) at TP=2."""
    real = _inputs()[1].bool()
    for r in measured:
        logits, binary, ref = r["no_binary_head"]
        assert binary is None
        torch.testing.assert_close(logits[real], ref[real], rtol=0, atol=1e-5)
