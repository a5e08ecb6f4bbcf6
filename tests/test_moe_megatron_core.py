"""The mixture of experts against megatron-core's own (needs megatron-core: the ``bench`` extra; the last tests,
the Megatron-LM MoE arguments and legacy layouts the reader refuses, run without it).

megatron-core runs in throwaway processes (one, or two gloo ranks for EP=2 / TP=2) with CPU shims
(:func:`_megatron_on_cpu`: a CPU scratch buffer, no CUDA RNG fork, no CUDA streams or synchronisation):

- its ``MoELayer`` (the local spec: ``SequentialMLP`` experts, ``moe_grouped_gemm=False``, with gated
  shared experts) and ours (:class:`lightning_megatron.transformer.moe.MoELayer`) on the same router,
  expert and shared-expert weights, in training mode: the output, the weighted load-balancing loss
  (its aux-loss tracker, times the coefficient) and z-loss, and the gradient of every parameter and of
  the input (backward of ``output . g``, the aux losses entering through megatron-core's
  ``MoEAuxLossAutoScaler`` and our ``AuxLossScaler`` at scale 1), fp32, within 1e-5. At EP=1 (its
  ``alltoall`` and ``allgather`` dispatchers; softmax with top-k before or after the softmax, sigmoid,
  ``aux_loss`` / ``seq_aux_loss``, token dropping) and at EP=2 on two gloo processes (each rank its own
  tokens and half of the experts; ours at EP=2 on two gloo processes too);
- its ``GPTModel`` with MoE layers (local spec with ``num_experts``) saved as a legacy
  ``model_optim_rng.pt`` (with Megatron-LM-style ``args``), with ``dist_checkpointing.save``
  (``torch_dist``, its args in ``common.pt``) and with ``singleton_local_shards`` (a tensor per layer and
  expert, no args), at EP=1, at EP=2 (legacy: one file per expert rank, ``mp_rank_00_00E``) and at TP=2
  (expert TP 2: each expert's ``linear_fc1`` split as a SwiGLU one): ``GPTLightningModule`` started from
  each (``init_from``, one process) gives its logits within 1e-5; so do the legacy files with their experts
  renamed as a Transformer-Engine ``TEGroupedMLP`` names them.

How to run it (a separate venv with the ``bench`` extra): docs/moe_megatron_draft.md.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                    or importlib.util.find_spec("megatron.core") is None,
                                    reason="megatron-core is not installed (the bench extra)")

H, FFN, MOE_FFN, SHARED, E, K = 32, 48, 24, 40, 4, 2
SEQ, BATCH = 8, 4
VOCAB, PADDED = 100, 128

LAYER_CASES = {
    # name: (EP size, megatron-core / our config fields)
    "ep1-alltoall-aux_loss": (1, dict(moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
                                      moe_router_pre_softmax=False, moe_shared_expert_gate=True)),
    "ep1-allgather-seq_aux_loss-pre_softmax": (1, dict(moe_token_dispatcher_type="allgather",
                                                       moe_router_load_balancing_type="seq_aux_loss",
                                                       moe_router_pre_softmax=True, moe_shared_expert_gate=True)),
    "ep1-sigmoid-no_shared": (1, dict(moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
                                      moe_shared_expert_intermediate_size=None)),
    "ep1-capacity": (1, dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0,
                             moe_shared_expert_gate=False)),
    "ep2-alltoall": (2, dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_gate=True)),
    "ep2-allgather": (2, dict(moe_token_dispatcher_type="allgather", moe_router_pre_softmax=True,
                              moe_router_load_balancing_type="seq_aux_loss")),
}


def _moe_fields(case: str) -> dict:
    fields = dict(num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=MOE_FFN,
                  moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=False, moe_aux_loss_coeff=1e-2,
                  moe_z_loss_coeff=1e-3, moe_router_load_balancing_type="aux_loss", moe_router_pre_softmax=False,
                  moe_router_score_function="softmax")
    return fields | LAYER_CASES[case][1]


# ---------------------------------------------------------------------------------------------- processes


def _run_ranks(function: str, world: int, *args: str) -> None:
    """``function(*args)`` of this module in ``world`` fresh processes (RANK / WORLD_SIZE / MASTER_PORT set)."""
    from lightning_megatron.check.spawn import free_port

    here = os.path.dirname(__file__)
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", f"import sys, test_moe_megatron_core as t; t.{function}(*sys.argv[1:])", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append(out)
    bad = [(r, p.returncode, out[-4000:]) for r, (p, out) in enumerate(zip(procs, outputs)) if p.returncode]
    assert not bad, "\n".join(f"rank {r} exited {rc}:\n{out}" for r, rc, out in bad)


def _init_process_group() -> tuple[int, int]:
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    return rank, world


def _megatron_on_cpu(ep: int, tp: int = 1) -> None:
    """megatron-core's parallel state at TP=``tp``, PP=1, EP=``ep`` on the gloo world, and its CUDA-only pieces
    made CPU ones (this process only)."""
    import contextlib
    import types

    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel as mtp
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    mps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)

    class _CPUBuffer:  # its scratch buffer (attention, the allgather dispatcher) is allocated on CUDA
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tuple(tensor_shape), dtype=dtype)

    class _Stream:  # its alltoall dispatcher copies its split sizes to the host on a side CUDA stream
        def wait_stream(self, other):
            pass

        def record_event(self):
            return types.SimpleNamespace(synchronize=lambda: None)

    mps._GLOBAL_MEMORY_BUFFER = _CPUBuffer()
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def split_sizes_to_host(tensor, as_numpy=False, record_stream=False):
        # The split sizes of its all-to-all reach the host as NumPy arrays from CUDA only: as from CUDA here.
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = split_sizes_to_host
    if not hasattr(moe_utils, "te_general_gemm"):  # its router's GEMM names it without Transformer Engine
        moe_utils.te_general_gemm = None
    mtp.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # dropout is off
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _Stream
    main_stream = _Stream()
    torch.cuda.current_stream = lambda *a, **k: main_stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def _megatron_config(**fields):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{**dict(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.2, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, moe_grouped_gemm=False), **fields})


# ---------------------------------------------------------------------------------------------- the layer


def _layer_data(case: str, root: Path) -> None:
    """Full weights (global experts), every rank's input and output gradient, in ``root/data.pt``."""
    fields = _moe_fields(case)
    ep = LAYER_CASES[case][0]
    g = torch.Generator().manual_seed(11)
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    data = {"router.weight": w(E, H)}
    for e in range(E):
        data[f"experts.local_experts.{e}.linear_fc1.weight"] = w(2 * MOE_FFN, H)
        data[f"experts.local_experts.{e}.linear_fc2.weight"] = w(H, MOE_FFN)
    if fields["moe_shared_expert_intermediate_size"]:
        data["shared_experts.linear_fc1.weight"] = w(2 * SHARED, H)
        data["shared_experts.linear_fc2.weight"] = w(H, SHARED)
        if fields["moe_shared_expert_gate"]:
            data["shared_expert_gate"] = w(1, H)
    for r in range(ep):
        data[f"x{r}"] = torch.randn(SEQ, BATCH, H, generator=g)
        data[f"g{r}"] = torch.randn(SEQ, BATCH, H, generator=g)
    torch.save(data, root / "data.pt")


def _local_weights(data: dict, rank: int, ep: int) -> dict[str, torch.Tensor]:
    """This EP rank's weights under local expert numbers (megatron-core's and our ``state_dict`` names)."""
    local = E // ep
    out = {}
    for k, v in data.items():
        if k.startswith("experts.local_experts."):
            e = int(k.split(".")[2])
            if rank * local <= e < (rank + 1) * local:
                out[k.replace(f"local_experts.{e}.", f"local_experts.{e - rank * local}.")] = v
        elif "." in k or k == "shared_expert_gate":  # not an input x<r> / output gradient g<r>
            out[k] = v
    return out


def _global_grads(named_grads: dict[str, torch.Tensor], rank: int, ep: int) -> dict[str, torch.Tensor]:
    local = E // ep
    out = {}
    for k, v in named_grads.items():
        if k.startswith("experts.local_experts."):
            e = int(k.split(".")[2])
            k = k.replace(f"local_experts.{e}.", f"local_experts.{e + rank * local}.")
        out[k] = v
    return out


def megatron_moe_layer(case: str, root: str) -> None:
    """(a rank of) megatron-core's MoELayer on ``root/data.pt``: ``root/megatron_{rank}.pt``."""
    import torch.distributed as dist
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import build_module

    root = Path(root)
    ep = LAYER_CASES[case][0]
    rank, _ = _init_process_group()
    _megatron_on_cpu(ep)
    fields = _moe_fields(case)
    cfg = _megatron_config(expert_model_parallel_size=ep, **fields)
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    layer = build_module(spec, config=cfg)
    assert isinstance(layer, MoELayer)
    layer.set_layer_number(1)
    data = torch.load(root / "data.pt", weights_only=True)
    weights = _local_weights(data, rank, ep)
    if "shared_expert_gate" in weights:  # megatron-core keeps the gate in its shared experts
        weights["shared_experts.gate_weight"] = weights.pop("shared_expert_gate")
    missing, unexpected = layer.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    layer.train()
    x = data[f"x{rank}"].clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    out.backward(data[f"g{rank}"])
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    aux_name = {"aux_loss": "load_balancing_loss",
                "seq_aux_loss": "seq_load_balancing_loss"}[fields["moe_router_load_balancing_type"]]
    grads = {k: p.grad for k, p in layer.named_parameters()}
    if "shared_experts.gate_weight" in grads:
        grads["shared_expert_gate"] = grads.pop("shared_experts.gate_weight")
    torch.save({"out": out.detach(), "x_grad": x.grad,
                "aux": tracker[aux_name]["values"][0] * fields["moe_aux_loss_coeff"],
                "z": tracker["z_loss"]["values"][0] * fields["moe_z_loss_coeff"],
                "grads": _global_grads(grads, rank, ep)}, root / f"megatron_{rank}.pt")
    dist.destroy_process_group()


def _our_layer(case: str, ep_group=None):
    from lightning_megatron.models.gpt.config import GPTConfig
    from lightning_megatron.parallel_state import group_size
    from lightning_megatron.transformer.moe import ExpertGroups, MoELayer

    ep = group_size(ep_group)
    cfg = GPTConfig(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN,
                    spec="llama_moe_layer_spec", add_bias_linear=False, gated_linear_unit=True, activation="silu",
                    vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                    **_moe_fields(case)).with_layout(1, False, ep)
    return MoELayer(cfg, expert_groups=ExpertGroups(ep=ep_group))


def _run_our_layer(case: str, data: dict, rank: int, ep_group=None) -> dict:
    from lightning_megatron.transformer.moe import aux_loss_scale

    ep = LAYER_CASES[case][0]
    layer = _our_layer(case, ep_group)
    layer.load_state_dict(_local_weights(data, rank, ep))
    layer.train()
    x = data[f"x{rank}"].clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    with aux_loss_scale(1.0):  # megatron-core's autoscaler at scale 1
        out.backward(data[f"g{rank}"])
    with torch.no_grad():
        keep = layer.router(x.reshape(-1, H)).keep
    return {"out": out.detach(), "x_grad": x.grad, "aux": layer.stats[0].clone(), "z": layer.stats[1].clone(),
            "grads": _global_grads({k: p.grad for k, p in layer.named_parameters()}, rank, ep),
            "dropped": 0 if keep is None else int((~keep).sum())}


def our_moe_layer(case: str, root: str) -> None:
    """(a rank of) our MoELayer at EP=2 on ``root/data.pt``: ``root/ours_{rank}.pt``."""
    import torch.distributed as dist

    rank, _ = _init_process_group()
    data = torch.load(Path(root) / "data.pt", weights_only=True)
    torch.save(_run_our_layer(case, data, rank, dist.group.WORLD), Path(root) / f"ours_{rank}.pt")
    dist.destroy_process_group()


def _max_differences(ours: dict, ref: dict) -> dict[str, float]:
    assert ours["grads"].keys() == ref["grads"].keys(), sorted(ours["grads"].keys() ^ ref["grads"].keys())
    diffs = {k: float((ours[k] - ref[k]).abs().max()) for k in ("out", "x_grad", "aux", "z")}
    diffs.update({f"grad {k}": float((ours["grads"][k] - v).abs().max()) for k, v in ref["grads"].items()})
    return diffs


@needs_megatron
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_moe_layer_equals_megatron_core(case, tmp_path):
    ep = LAYER_CASES[case][0]
    _layer_data(case, tmp_path)
    _run_ranks("megatron_moe_layer", ep, case, str(tmp_path))
    data = torch.load(tmp_path / "data.pt", weights_only=True)
    if ep == 1:
        ours = [_run_our_layer(case, data, 0)]
    else:
        _run_ranks("our_moe_layer", ep, case, str(tmp_path))
        ours = [torch.load(tmp_path / f"ours_{r}.pt", weights_only=True) for r in range(ep)]
    for rank in range(ep):
        ref = torch.load(tmp_path / f"megatron_{rank}.pt", weights_only=True)
        assert float(ref["aux"]) > 0 and float(ref["z"]) > 0  # both losses were computed and tracked
        if _moe_fields(case).get("moe_expert_capacity_factor") is not None:
            assert ours[rank]["dropped"] > 0  # the capacity dropped assignments
        diffs = _max_differences(ours[rank], ref)
        largest = max(float(ref["out"].abs().max()), *(float(g.abs().max()) for g in ref["grads"].values()))
        print(f"{case} rank {rank}: max |ours - megatron-core| "
              + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()) + f" (largest output/gradient {largest:.1f})")
        bad = {k: f"{v:.2e}" for k, v in diffs.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: max |ours - megatron-core| above 1e-5: {bad}"


# ---------------------------------------------------------------------------------------------- the model

GPT_MOE = dict(num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=MOE_FFN,
               moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True, moe_router_pre_softmax=False,
               moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
               moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall")
"""megatron-core's (TransformerConfig) and our (GPTConfig) MoE fields of the model."""
OURS = dict(num_layers=2, hidden_size=H, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=FFN,
            vocab_size=VOCAB, max_sequence_length=SEQ, spec="llama_moe_layer_spec", activation="silu",
            gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope", rotary_base=5000.0,
            untie_embeddings_and_output_weights=True, layernorm_epsilon=1e-5, hidden_dropout=0.0,
            attention_dropout=0.0, **GPT_MOE)
"""Our GPTConfig of the same model."""


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(4))


def _megatron_args(ep: int, tp: int = 1):
    import argparse

    return argparse.Namespace(
        num_layers=2, hidden_size=H, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
        ffn_hidden_size=FFN, swiglu=True, normalization="RMSNorm", norm_epsilon=1e-5, add_bias_linear=False,
        position_embedding_type="rope", rotary_base=5000, rotary_percent=1.0,
        untie_embeddings_and_output_weights=True, max_position_embeddings=SEQ, kv_channels=8,
        padded_vocab_size=PADDED, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp, num_experts=E, moe_router_topk=K,
        moe_ffn_hidden_size=MOE_FFN, moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True,
        moe_router_pre_softmax=False, moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_layer_freq=1,
        moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False, moe_expert_capacity_factor=None,
        moe_pad_expert_input_to_capacity=False, moe_token_drop_policy="probs", moe_input_jitter_eps=None,
        moe_router_num_groups=None, moe_router_group_topk=None, moe_apply_probs_on_input=False)


def write_megatron_moe_checkpoints(root: str, tp: str = "1") -> None:
    """(a rank of) megatron-core's GPTModel with MoE layers at TP=``tp`` (the experts' TP too) and EP = the rest of
    the world: rank 0's logits and the model in both checkpoint formats."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    root = Path(root)
    tp = int(tp)
    rank, world = _init_process_group()
    ep = world // tp
    _megatron_on_cpu(ep, tp)
    cfg = _megatron_config(num_layers=2, num_query_groups=2, normalization="RMSNorm", layernorm_epsilon=1e-5,
                           tensor_model_parallel_size=tp, expert_model_parallel_size=ep, **GPT_MOE)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=PADDED, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=5000).eval()
    local = E // ep
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):  # norms away from 1, so a misplaced norm shows
                p.uniform_(0.5, 1.5)
            elif ".local_experts." in name:  # every expert (and TP shard) its own weights, whichever rank holds it
                layer, e = int(name.split(".")[2]), int(name.split(".")[6])
                expert = mps.get_expert_model_parallel_rank() * local + e
                g = torch.Generator().manual_seed(1000 * layer + 10 * expert + mps.get_tensor_model_parallel_rank())
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        tokens = _tokens()
        position_ids = torch.arange(SEQ).expand_as(tokens)
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
        logits = model(tokens, position_ids, causal)  # its default causal mask is built on CUDA
        logits = gather_from_tensor_model_parallel_region(logits)  # its vocabulary shards (TP > 1)
    if rank == 0:
        torch.save({"ref": logits[..., :VOCAB].clone()}, root / "reference.pt")
    args = _megatron_args(ep, tp)
    # Megatron-LM's rank directory: mp_rank_<tp>, with _<ep> appended under expert parallelism (no PP here)
    name = f"mp_rank_{mps.get_tensor_model_parallel_rank():02d}"
    name += f"_{mps.get_expert_model_parallel_rank():03d}" if ep > 1 else ""
    d = root / "legacy" / "iter_0000001" / name
    d.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "args": args, "iteration": 1, "checkpoint_version": 3.0},
               d / "model_optim_rng.pt")
    if rank == 0:
        (root / "legacy" / "latest_checkpointed_iteration.txt").write_text("1")
        (root / "torch_dist").mkdir()
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 1,
                             "checkpoint_version": 3.0}, str(root / "torch_dist"))
    # One tensor per layer and expert, a SwiGLU linear_fc1 as gate (_w) and up (_v); no args beside it.
    if rank == 0:
        (root / "torch_dist_singleton").mkdir()
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(metadata={"singleton_local_shards": True}),
                            str(root / "torch_dist_singleton"))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[(1, 1), (1, 2), (2, 1)], ids=["ep1", "ep2", "tp2"])
def megatron_moe_root(request, tmp_path_factory):
    tp, ep = request.param
    root = tmp_path_factory.mktemp(f"megatron_moe_tp{tp}ep{ep}")
    _run_ranks("write_megatron_moe_checkpoints", tp * ep, str(root), str(tp))
    return root


def _logits_error(module, root: Path) -> float:
    module.configure_model()
    with torch.no_grad():
        ours = module.eval().model_chunks[0](_tokens())[..., :VOCAB]
    ref = torch.load(root / "reference.pt", weights_only=True)["ref"]
    err = float((ours - ref).abs().max())
    print(f"{root.name}: max |ours - megatron-core| = {err:.1e} (largest logit {float(ref.abs().max()):.2f})")
    return err


@needs_megatron
@pytest.mark.parametrize("source", ["legacy", "torch_dist"])
def test_init_from_megatron_core_moe_gpt_gives_its_logits(megatron_moe_root, source):
    """Its args give the architecture (the legacy files' and torch_dist's common.pt)."""
    from lightning_megatron.models.gpt.module import GPTLightningModule

    module = GPTLightningModule.from_pretrained(str(megatron_moe_root / source), config=dict(
        vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0))
    assert {k: module.hparams["config"][k] for k in OURS} == OURS
    err = _logits_error(module, megatron_moe_root)
    assert err <= 1e-5, f"{source}: max |ours - megatron-core| = {err:.2e}"


@needs_megatron
def test_init_from_megatron_core_moe_singleton_shards(megatron_moe_root):
    """torch_dist with ``singleton_local_shards`` (a tensor per layer and expert, SwiGLU halves apart) and no args
    beside it: the architecture given, checked against the tensors (a module without the shared experts' gate is
    refused before loading)."""
    from lightning_megatron.models.gpt.module import GPTLightningModule

    source = str(megatron_moe_root / "torch_dist_singleton")
    err = _logits_error(GPTLightningModule(OURS, init_from=source), megatron_moe_root)
    assert err <= 1e-5, f"max |ours - megatron-core| = {err:.2e}"
    ungated = GPTLightningModule({**OURS, "moe_shared_expert_gate": False}, init_from=source)
    with pytest.raises(ValueError, match="moe_shared_expert_gate"):
        ungated.configure_model()


@needs_megatron
def test_init_from_te_grouped_expert_names(megatron_moe_root, tmp_path):
    """Legacy files whose experts are a Transformer-Engine ``TEGroupedMLP``'s (``experts.linear_fc1.weight<i>``,
    per local expert the ``SequentialMLP`` expert's tensor): the same logits (the files here are megatron-core's
    SequentialMLP files renamed, Transformer Engine not being installed)."""
    import re

    from lightning_megatron.interop.megatron_lm import _load_rank_file
    from lightning_megatron.models.gpt.module import GPTLightningModule

    src = megatron_moe_root / "legacy" / "iter_0000001"
    for rank_dir in src.iterdir():
        state = _load_rank_file(rank_dir / "model_optim_rng.pt")
        te_name = lambda k: re.sub(r"experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight",  # noqa: E731
                                   r"experts.\2.weight\1", k)
        state["model"] = {te_name(k): v for k, v in state["model"].items() if not k.endswith("_extra_state")}
        assert any(k.endswith("experts.linear_fc1.weight1") for k in state["model"])
        state["args"].moe_grouped_gemm = True
        (tmp_path / rank_dir.name).mkdir()
        torch.save(state, tmp_path / rank_dir.name / "model_optim_rng.pt")
    module = GPTLightningModule.from_pretrained(str(tmp_path), config=dict(vocab_size=VOCAB, hidden_dropout=0.0,
                                                                          attention_dropout=0.0))
    assert _logits_error(module, megatron_moe_root) <= 1e-5


# ------------------------------------------------------------------------------------ refusals (no megatron-core)


def test_megatron_moe_args_map_to_our_config():
    from lightning_megatron.models.gpt.interop import gpt_architecture_from_args

    arch = gpt_architecture_from_args(_megatron_args(2), 2)
    assert {k: arch[k] for k in GPT_MOE} == GPT_MOE and arch["spec"] == "llama_moe_layer_spec"
    args = _megatron_args(1)
    args.moe_ffn_hidden_size, args.moe_shared_expert_intermediate_size, args.moe_token_dispatcher_type = None, 0, "flex"
    arch = gpt_architecture_from_args(args, 2)
    assert arch["moe_ffn_hidden_size"] == FFN and "moe_shared_expert_intermediate_size" not in arch
    assert arch["moe_token_dispatcher_type"] == "alltoall"


@pytest.mark.parametrize("change, named", [
    (dict(moe_layer_freq=2), "moe_layer_freq=2"),
    (dict(moe_layer_freq=[1, 0]), "moe_layer_freq=[1, 0]"),
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias"),
    (dict(moe_router_topk_scaling_factor=2.5), "moe_router_topk_scaling_factor"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "moe_router_group_topk"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0), "sinkhorn"),
    (dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position"), "moe_token_drop_policy"),
    (dict(normalization="LayerNorm"), "normalization='LayerNorm'"),
    (dict(swiglu=False), "swiglu=False"),
    (dict(moe_latent_size=16), "moe_latent_size"),
])
def test_megatron_moe_args_we_cannot_compute_are_refused(change, named):
    from lightning_megatron.models.gpt.interop import gpt_architecture_from_args

    args = _megatron_args(1)
    for k, v in change.items():
        setattr(args, k, v)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(")):
        gpt_architecture_from_args(args, 2)


def test_megatron_moe_training_only_losses_are_dropped_with_a_warning():
    from lightning_megatron.models.gpt.interop import gpt_architecture_from_args

    args = _megatron_args(1)
    args.moe_router_load_balancing_type, args.moe_aux_loss_coeff = ["aux_loss", "global_aux_loss"], [1e-2, 1e-3]
    with pytest.warns(UserWarning, match="global_aux_loss"):
        arch = gpt_architecture_from_args(args, 2)
    assert arch["moe_router_load_balancing_type"] == "none" and arch["moe_aux_loss_coeff"] == 0.0


def _legacy_moe_file(root: Path, args, model: dict[str, torch.Tensor], name: str = "mp_rank_00") -> Path:
    (root / name).mkdir(parents=True)
    torch.save({"model": model, "args": args, "iteration": 1, "checkpoint_version": 3.0},
               root / name / "model_optim_rng.pt")
    return root


def test_legacy_moe_layouts_we_cannot_merge_are_refused(tmp_path):
    from lightning_megatron.interop.megatron_lm import read_legacy_checkpoint
    from lightning_megatron.models.gpt.interop import GPTInterop

    experts = {"decoder.layers.0.mlp.router.weight": torch.zeros(E, H),
               "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": torch.zeros(2 * MOE_FFN, H),
               "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight": torch.zeros(H, MOE_FFN)}
    args = _megatron_args(1)
    args.expert_tensor_parallel_size = 2
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2"):
        read_legacy_checkpoint(_legacy_moe_file(tmp_path / "etp", args, experts), GPTInterop())
    grouped = {"decoder.layers.0.mlp.router.weight": torch.zeros(E, H),
               "decoder.layers.0.mlp.experts.weight1": torch.zeros(H, E * 2 * MOE_FFN),
               "decoder.layers.0.mlp.experts.weight2": torch.zeros(E * MOE_FFN, H)}
    with pytest.raises(ValueError, match="GroupedMLP"):
        read_legacy_checkpoint(_legacy_moe_file(tmp_path / "grouped", _megatron_args(1), grouped), GPTInterop())
    args = _megatron_args(2)  # two expert ranks whose dense tensors differ: not one checkpoint
    dense = "decoder.layers.0.self_attention.linear_proj.weight"
    _legacy_moe_file(tmp_path / "ep2", args, {**experts, dense: torch.zeros(H, H)}, "mp_rank_00_000")
    _legacy_moe_file(tmp_path / "ep2", args, {**experts, dense: torch.ones(H, H)}, "mp_rank_00_001")
    with pytest.raises(ValueError, match="linear_proj.weight differs"):
        read_legacy_checkpoint(tmp_path / "ep2", GPTInterop())
