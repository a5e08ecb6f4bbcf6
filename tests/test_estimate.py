"""``check --gpus`` / ``--estimate-time``: the layout search, dropout masks in the memory estimate, and
the step-time model against hand-computed numbers and Megatron-LM's published weak-scaling table.
Pure arithmetic and one in-process CLI call: no timings are asserted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.cost import DEFAULT_DROPOUT, TransformerCost, estimate_stage, search_layouts
from lightning_megatron.models.bert.cost import BertCost
from lightning_megatron.models.gpt.cost import GPTCost
from lightning_megatron.check.timing import (MEASURED, Device, Efficiency, Framework, HostOps, collective_time,
                                             deferred_head_flops, elementwise_bytes, estimate_time, stage_flops,
                                             step_weight_parameters)
from lightning_megatron.flops import transformer_flops

BERT_LARGE = BertCost(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=512, micro_batch_size=16,
                      global_batch_size=256, params_dtype="bfloat16")


def test_layout_search_tries_vp_and_names_what_it_skips():
    """48 GPUs, global batch 256 in micro batches of 16: DP=3 cannot split 16 microbatches; VP is tried."""
    found = search_layouts(BERT_LARGE, 48)
    assert ParallelDims(tp=4, pp=2, vp=2, dp=6) not in found.layouts  # DP=6 does not divide 16 either
    assert found.skipped["DP=3 does not divide global batch 256 into micro batches of 16"] >= 1
    assert found.skipped["TP=3 does not divide 16 heads / FFN 4096"] >= 1
    big = search_layouts(dataclasses.replace(BERT_LARGE, global_batch_size=1024), 64)
    assert ParallelDims(tp=8, pp=2, vp=2, dp=4, sequence_parallel=True, zero1=True) in big.layouts
    assert ParallelDims(tp=8, pp=4, vp=6, dp=2) in big.layouts  # 24 layers: 6 per stage, 1 per chunk
    assert all(x.world_size == 64 and 24 % (x.pp * (x.vp or 1)) == 0 for x in big.layouts)
    assert "TP=16 > 8 (TP stays within a node)" in big.skipped


def test_layout_search_tries_context_parallel_where_the_model_takes_it():
    """A decoder's search (the module takes context parallelism) tries CP sizes that split the sequence into 2 CP
    chunks, and under SP into TP x CP parts, each left out under its reason; a BERT's does not try CP at all."""
    decoder = GPTCost(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=4096, micro_batch_size=1,
                      global_batch_size=64, gated_linear_unit=True, position_embedding_type="rope")
    found = search_layouts(decoder, 8, context_parallel=True)
    assert {ParallelDims(cp=8, dp=1), ParallelDims(tp=2, cp=2, dp=2, sequence_parallel=True, zero1=True),
            ParallelDims(tp=2, cp=2, pp=2, vp=2, dp=1, sequence_parallel=True)} <= set(found.layouts)
    assert all(x.world_size == 8 for x in found.layouts)
    plain = search_layouts(decoder, 8)
    assert {x for x in found.layouts if x.cp == 1} == set(plain.layouts) and all(x.cp == 1 for x in plain.layouts)
    odd = search_layouts(dataclasses.replace(decoder, seq_length=4100), 8, context_parallel=True)
    assert ParallelDims(cp=2, dp=4) in odd.layouts and not any(x.cp > 2 for x in odd.layouts)
    assert odd.skipped["CP=4 does not split sequence 4100 into 8 chunks"] >= 1
    assert ParallelDims(tp=2, cp=2, dp=2) in odd.layouts  # 2050 tokens a CP rank: TP=2 splits them under SP
    short = search_layouts(dataclasses.replace(decoder, seq_length=12), 8, context_parallel=True)
    assert ParallelDims(tp=4, cp=2, dp=1) in short.layouts  # 6 tokens a CP rank: not 4 parts for SP
    assert ParallelDims(tp=4, cp=2, dp=1, sequence_parallel=True) not in short.layouts
    assert ParallelDims(tp=2, cp=2, dp=2, sequence_parallel=True) in short.layouts
    assert short.skipped["SP with TP=4 x CP=2 does not split sequence 12"] >= 1
    heads = search_layouts(dataclasses.replace(decoder, cp_comm_type="a2a", num_attention_heads=4), 8,
                           context_parallel=True)
    assert ParallelDims(tp=2, cp=2, dp=2) in heads.layouts and ParallelDims(cp=4, dp=2) in heads.layouts
    assert all((4 // x.tp) % x.cp == 0 for x in heads.layouts)
    assert heads.skipped["cp_comm_type='a2a': CP=4 does not divide the 2 heads of a TP=2 rank"] >= 1
    assert heads.skipped["cp_comm_type='a2a': CP=2 does not divide the 1 heads of a TP=4 rank"] >= 1
    assert all(x.cp == 1 for x in search_layouts(BERT_LARGE, 8).layouts)


def _saved_activation_bytes(hidden_dropout: float, attention_dropout: float) -> int:
    """Bytes autograd saves in one training forward of a 2-layer BertModel on CPU (CPU kernels)."""
    from lightning_megatron.cpu.kernels import CPUKernels
    from lightning_megatron.models.bert import BertModel
    from lightning_megatron.tensor_parallel.random import model_parallel_seed
    from lightning_megatron.transformer import TransformerConfig
    from lightning_megatron.transformer.kernels import set_kernels

    torch.manual_seed(0)
    model_parallel_seed(1, 0)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=hidden_dropout,
                            attention_dropout=attention_dropout)
    model = BertModel(cfg, "bert_layer_local_spec", 1000, 16).train()
    set_kernels(model, CPUKernels())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 1000, (2, 16)), None)
    return sum(seen.values())


def test_activation_estimate_counts_dropout_masks():
    """Measured: the bytes dropout adds to the saved tensors equal the formula's (CPU: masks in the
    activation dtype; the unfused attention keeps its mask and the dropped probabilities)."""
    shape = BertCost(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, max_sequence_length=16,
                     seq_length=16, micro_batch_size=2, global_batch_size=2, on_cpu=True)

    def predicted(hidden: float, attention: float) -> int:
        m = dataclasses.replace(shape, hidden_dropout=hidden, attention_dropout=attention)
        return estimate_stage(m, ParallelDims(dp=1), 0).activation_bytes

    base = _saved_activation_bytes(0.0, 0.0)
    for hidden, attention in ((0.1, 0.0), (0.1, 0.1)):
        assert _saved_activation_bytes(hidden, attention) - base == predicted(hidden, attention) - predicted(0, 0)
    # On a GPU (bool masks, fused attention) dropout adds ~6% to BERT-large's activations.
    on = estimate_stage(BERT_LARGE, ParallelDims(dp=1), 0).activation_bytes
    off = estimate_stage(dataclasses.replace(BERT_LARGE, hidden_dropout=0.0, attention_dropout=0.0), ParallelDims(dp=1), 0)
    assert 1.05 < on / off.activation_bytes < 1.08


def test_a_16_bit_berts_head_is_estimated_with_the_losss_fp32_softmax_or_with_its_logits_compiled():
    """Measured (the saved tensors of one microbatch of a one-layer BERT whose masked tokens' logits dominate):
    the eager loss keeps an fp32 softmax of the masked tokens' logits whatever the parameters' dtype, so a bf16
    model's estimate counts 4 bytes a logit, not 2; with the loss compiled at one TP rank it keeps the 16-bit
    logits (``compiled_loss``, the recipe's ``model.compile``). With the library's kernels (sdpa, what a check run
    takes) and with the CPU tuning's (``on_cpu``: 16-bit attention unfused, its probabilities kept), each within 2%
    of what autograd held. The compiled loss is installed by ``compile_loss`` and run uncompiled
    (``disable=True``): saved-tensor hooks do not see into a compiled graph, and its function saves what its
    autograd Function does (the logits and per-row values)."""
    import itertools

    from lightning_megatron.check.worker import _SavedActivations
    from lightning_megatron.cpu.kernels import CPUKernels
    from lightning_megatron.transformer.kernels import set_kernels

    for dtype, compiled, tuned in itertools.product(("bfloat16", "float32"), (False, True), (False, True)):
        m = BertCost(num_layers=1, hidden_size=64, num_attention_heads=2, seq_length=128, micro_batch_size=4,
                     global_batch_size=4, params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
                     compiled_loss=compiled, on_cpu=tuned)
        torch.manual_seed(0)
        model, step = m.build_model_step()
        if tuned:
            set_kernels(model, CPUKernels())
        if compiled:
            assert model.compile_loss(disable=True)
        saved = _SavedActivations({p.untyped_storage().data_ptr() for p in model.parameters()})
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            step()
        predicted = estimate_stage(m, ParallelDims(dp=1), 0).activation_bytes
        assert abs(predicted / saved.peak - 1) < 0.02, (dtype, compiled, tuned, predicted, saved.peak)


def _saved_by_model_step(m: GPTCost, layers: int) -> int:
    """Peak bytes autograd saves (parameters excluded) in one microbatch of ``m``'s model of ``layers`` layers."""
    from lightning_megatron.check.worker import _SavedActivations

    torch.manual_seed(0)
    model, step = m.build_model_step(num_layers=layers)
    held = _SavedActivations({p.untyped_storage().data_ptr() for p in model.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(held.pack, held.unpack):
        step()
    return held.peak


def test_a_berts_ends_keep_the_final_or_embedding_norms_input_and_the_poolers_token():
    """Measured with a vocabulary small enough that the logits do not hide the rest: pre-norm and post-norm BERT
    at 1 and 2 layers within 1% of what autograd held. The pooler's dense layer kept a view of its first token,
    which holds the whole ``[s, b, h]`` output (the estimate counted it, and not the final norm's input: 0.95 of
    what was held); the pooler copies its token now. Post-norm has no final norm, but the embedding norm's input
    on the first stage."""
    for post_norm, layers in ((False, 1), (False, 2), (True, 1), (True, 2)):
        m = BertCost(num_layers=layers, hidden_size=64, num_attention_heads=2, seq_length=128, micro_batch_size=4,
                     vocab_size=256, global_batch_size=4, params_dtype="float32", hidden_dropout=0.0,
                     attention_dropout=0.0, post_norm=post_norm)
        predicted = estimate_stage(m, ParallelDims(dp=1), 0).activation_bytes
        held = _saved_by_model_step(m, layers)
        assert abs(predicted / held - 1) < 0.01, (post_norm, layers, predicted, held)


def test_a_grouped_query_decoders_activations_are_its_query_keys_values_and_context_and_under_lora_less():
    """Measured (the saved tensors of one microbatch of a grouped-query decoder with RoPE, 4 query heads in 2
    groups, SwiGLU, in fp32 and bf16), each within 2% of the estimate:

    - training every weight, the two-layer model's: the attention keeps its rotated queries, keys and values and its
      context, ``(2n + 2g) d`` a token, not the whole ``linear_qkv`` output beside a copy of the queries (keys and
      values held as views of it: 0.90 of the estimate before), and the final norm keeps its input;
    - under LoRA (adapters on some projections, the base frozen), a layer's (the three-layer model's less the
      two-layer one's): a frozen projection without an adapter keeps no input, an adapted one keeps its input for
      A's gradient and B's input ``[s, b, r]`` (the estimate counted the weights' inputs as training, up to 1.5x).
      The first layer of a LoRA model keeps less (nothing upstream of its first adapter needs a gradient): the
      estimate counts it whole.

    LayerNorm; and RMSNorm, which on a CPU is torch's composite, keeping fp32 copies of its input and of the
    normalized input (``composite_rmsnorm``, docs/memory.md: 0.85 and 0.68 of the measured without); on a GPU its
    fused kernel keeps what LayerNorm's does."""
    saved = _saved_by_model_step
    for dtype in ("float32", "bfloat16"):
        for targets in ((), ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), ("linear_qkv", "linear_fc2"),
                        ("linear_proj", "linear_fc1")):
            m = GPTCost(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                        gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope", vocab_size=512,
                        untie_embeddings_and_output_weights=True, seq_length=128, micro_batch_size=2,
                        global_batch_size=2, params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
                        lora_rank=8 if targets else 0, lora_targets=targets)
            if not targets:
                predicted = estimate_stage(m, ParallelDims(dp=1), 0).activation_bytes
                assert abs(predicted / saved(m, 2) - 1) < 0.02, (dtype, predicted, saved(m, 2))
                # RMSNorm: on this CPU torch's composite, which keeps fp32 copies (composite_rmsnorm)
                rms = dataclasses.replace(m, rmsnorm=True, composite_rmsnorm=True)
                predicted = estimate_stage(rms, ParallelDims(dp=1), 0).activation_bytes
                assert abs(predicted / saved(rms, 2) - 1) < 0.02, (dtype, predicted, saved(rms, 2))
            layer = saved(m, 3) - saved(m, 2)
            predicted = m.layer_activation_bytes(1, False)
            assert abs(predicted / layer - 1) < 0.02, (dtype, targets, predicted, layer)
            if not targets:  # the unfused attention (attention_backend: unfused), its softmax in fp32: a 16-bit
                # model keeps the fp32 probabilities beside their cast (the estimate counted the cast: 0.79)
                unfused = dataclasses.replace(m, attention_backend="unfused")
                layer = saved(unfused, 3) - saved(unfused, 2)
                predicted = unfused.layer_activation_bytes(1, False)
                assert abs(predicted / layer - 1) < 0.02, ("unfused", dtype, predicted, layer)
            if targets and dtype == "float32":  # the adapters' dropout: a mask each (on a CPU in the activation
                # dtype, ``on_cpu``), A's dropped input, beside the context the attention keeps for linear_proj's
                drop = dataclasses.replace(m, lora_dropout=0.1, on_cpu=True)
                layer = saved(drop, 3) - saved(drop, 2)
                predicted = drop.layer_activation_bytes(1, False)
                assert abs(predicted / layer - 1) < 0.02, ("dropout", targets, predicted, layer)


def test_a_mixture_of_experts_layer_keeps_its_rows_and_slots_once():
    """Measured (a layer of a grouped-query decoder whose MLP is 4 SwiGLU experts, top 2, with and without a shared
    expert, fp32 and bf16: the three-layer model's saved bytes less the two-layer one's), within 2% of the estimate:
    the experts' rows ``[s b k, h]``, the slots ``[s b, k, h]`` the routing weights' gradient reads, and the
    router's and the dispatch's per-token bookkeeping. Before, the estimate counted the mixture as a dense MLP of
    the active width (0.76 of the measured), and the dispatch kept the experts' outputs once more (autograd's
    ``index_copy`` keeps its source): ``k h`` a token a layer."""
    for dtype in ("float32", "bfloat16"):
        for shared in (None, 256):
            m = GPTCost(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                        gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope", vocab_size=512,
                        untie_embeddings_and_output_weights=True, seq_length=128, micro_batch_size=2,
                        global_batch_size=2, params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
                        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256,
                        moe_shared_expert_intermediate_size=shared)
            layer = _saved_by_model_step(m, 3) - _saved_by_model_step(m, 2)
            predicted = m.layer_activation_bytes(1, False)
            assert abs(predicted / layer - 1) < 0.02, (dtype, shared, predicted, layer)


def test_experts_padded_to_their_capacity_keep_the_padded_rows():
    """``moe_pad_expert_input_to_capacity`` runs every expert on ``ceil(f k N / E)`` rows (f the capacity factor): its
    rows, hidden activations and product are ``f`` times the balanced ones. Measured (a one-layer mixture's step):
    what padding adds within 1% of what the estimate adds (it added nothing: 0.84 of what was held at f = 1.5), the
    whole within 2%; without padding the balanced count stays (an upper bound where the capacity drops rows)."""
    def predicted_and_held(factor, pad):
        m = GPTCost(num_layers=1, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                    gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope", vocab_size=512,
                    untie_embeddings_and_output_weights=True, seq_length=128, micro_batch_size=2,
                    global_batch_size=2, params_dtype="float32", hidden_dropout=0.0, attention_dropout=0.0,
                    num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256,
                    moe_expert_capacity_factor=factor, moe_pad_expert_input_to_capacity=pad)
        return estimate_stage(m, ParallelDims(dp=1), 0).activation_bytes, _saved_by_model_step(m, 1)

    balanced, balanced_held = predicted_and_held(None, False)
    assert abs(balanced / balanced_held - 1) < 0.02, (balanced, balanced_held)
    assert predicted_and_held(2.0, False)[0] == balanced
    for factor in (1.5, 1.25):
        predicted, held = predicted_and_held(factor, True)
        assert abs(predicted / held - 1) < 0.02, (factor, predicted, held)
        assert abs((predicted - balanced) / (held - balanced_held) - 1) < 0.01, (factor, predicted, held)


def test_experts_padded_to_their_capacity_are_timed_with_the_padding():
    """The step time's FLOPs (``stage_flops``) count the padded rows' GEMMs: a SwiGLU expert's three ``h x F``
    matrices, 6 FLOPs a weight a row, for ``(f - 1) k`` more rows a token; the MFU's model FLOPs do not."""
    from lightning_megatron.check.timing import model_flops, stage_flops

    m = GPTCost(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, gated_linear_unit=True,
                vocab_size=512, seq_length=128, micro_batch_size=2, global_batch_size=2, num_moe_experts=8,
                moe_router_topk=2, moe_ffn_hidden_size=384)
    padded = dataclasses.replace(m, moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True)
    for layout in (ParallelDims(dp=1), ParallelDims(tp=2, pp=2, dp=1)):
        tokens, layers = 2 * 128, 4 // layout.pp
        extra = 6 * 3 * 256 * 384 * 0.25 * 2 * tokens * layers / layout.tp
        assert stage_flops(padded, layout, 0) - stage_flops(m, layout, 0) == pytest.approx(extra, rel=1e-9)
    assert model_flops(padded) == model_flops(m)
    # under CP every rank pads to the whole microbatch's capacity: its experts run f k rows a token of all of them
    routed = 6 * 3 * 256 * 384 * 1.25 * 2 * 2 * 128 * 4
    cp2 = ParallelDims(cp=2, dp=1)
    assert stage_flops(padded, cp2, 0) == pytest.approx(stage_flops(padded, ParallelDims(dp=1), 0) / 2 + routed / 2)


def test_recomputation_by_groups_or_of_the_first_layers_keeps_what_the_estimate_counts():
    """Measured (a four-layer decoder's step, its recomputation as the config says): ``uniform`` with groups of
    ``k`` layers keeps each group's input and recomputes a group at a time (``k`` layers' activations); ``block``
    recomputes the first ``k`` layers and keeps everything of the rest. Each within 2% of the estimate, which
    counted every kind of full recomputation as one-layer groups (``block`` 1 of 4: 0.61 of what was held)."""
    from lightning_megatron.models.gpt.model import GPTModel, gpt_loss
    from lightning_megatron.check.worker import _SavedActivations

    m = GPTCost(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, vocab_size=512,
                seq_length=128, micro_batch_size=2, global_batch_size=2, params_dtype="float32", hidden_dropout=0.0,
                attention_dropout=0.0, recompute=True)
    for method, k in (("uniform", 1), ("uniform", 2), ("uniform", 4), ("block", 1), ("block", 3), ("block", 4)):
        shape = dataclasses.replace(m, recompute_method=method, recompute_num_layers=k)
        config = dataclasses.replace(m.layer_config(4), recompute_granularity="full", recompute_method=method,
                                     recompute_num_layers=k)
        torch.manual_seed(0)
        model = GPTModel(config, m.layer_spec(), 512, 128).train()
        tokens = torch.randint(0, 512, (2, 128))
        held = _SavedActivations({p.untyped_storage().data_ptr() for p in model.parameters()})
        with torch.autograd.graph.saved_tensors_hooks(held.pack, held.unpack):
            gpt_loss(model(tokens, labels=tokens), torch.ones(2, 128)).backward()
        predicted = estimate_stage(shape, ParallelDims(dp=1), 0).activation_bytes
        assert abs(predicted / held.peak - 1) < 0.02, (method, k, predicted, held.peak)
    # and the step time runs again the forward of the recomputed layers only: "block" 1 of a chunk's 4 (2 at PP=2)
    from lightning_megatron.check.timing import stage_flops

    block, none = (dataclasses.replace(m, recompute_method="block", recompute_num_layers=1),
                   dataclasses.replace(m, recompute=False))
    for layout, share in ((ParallelDims(dp=1), 1 / 4), (ParallelDims(pp=2, dp=1), 1 / 2)):
        again = stage_flops(m, layout, 0, head=False) - stage_flops(none, layout, 0, head=False)
        assert again > 0 and stage_flops(block, layout, 0) == pytest.approx(stage_flops(none, layout, 0) + share * again)


def test_selective_recomputation_keeps_no_attention_probabilities_but_the_replayed_layers():
    """``recompute_granularity: selective`` runs the core attention again in the backward: a layer keeps neither
    the unfused attention's probabilities nor its dropout's mask (the estimate counted them: 33% over at 256 tokens),
    and the backward's peak holds one layer's replayed attention, after its MLP's and output projection's backward
    freed theirs. Measured within 2% (the head's peak at 128 tokens, the replay's at 256)."""
    from lightning_megatron.check.worker import _SavedActivations
    from lightning_megatron.models.gpt.model import GPTModel, gpt_loss
    from lightning_megatron.tensor_parallel import model_parallel_seed

    for seq, dropout in ((128, 0.0), (256, 0.0)):  # the head's peak; the replayed attention's (the longer one)
        m = GPTCost(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256,
                    seq_length=seq, micro_batch_size=2, global_batch_size=2, params_dtype="float32",
                    hidden_dropout=0.0, attention_dropout=dropout, attention_backend="unfused",
                    selective_recompute=True)
        config = dataclasses.replace(m.layer_config(4), recompute_granularity="selective")
        model_parallel_seed(0, 0)
        model = GPTModel(config, m.layer_spec(), 256, seq).train()
        tokens = torch.randint(0, 256, (2, seq))
        held = _SavedActivations({p.untyped_storage().data_ptr() for p in model.parameters()})
        with torch.autograd.graph.saved_tensors_hooks(held.pack, held.unpack):
            gpt_loss(model(tokens, labels=tokens), torch.ones(2, seq)).backward()
        predicted = estimate_stage(m, ParallelDims(dp=1), 0).activation_bytes
        kept_all = estimate_stage(dataclasses.replace(m, selective_recompute=False), ParallelDims(dp=1), 0)
        assert kept_all.activation_bytes > 1.2 * held.peak  # what it kept without selective recomputation
        assert abs(predicted / held.peak - 1) < 0.02, (seq, dropout, predicted, held.peak)
    # the step time runs the core attention's forward again (4 T s P a layer: scores and weighted sum); the model
    # FLOPs (the MFU's) do not count it
    from lightning_megatron.check.timing import stage_flops
    from lightning_megatron.cost.flops import model_flops

    none = dataclasses.replace(m, selective_recompute=False)
    again = 4 * 2 * m.seq_length * 4 * m.seq_length * 64
    assert stage_flops(m, ParallelDims(dp=1), 0) == pytest.approx(stage_flops(none, ParallelDims(dp=1), 0) + again)
    assert model_flops(m) == model_flops(none)


def test_uneven_pipeline_stages_are_estimated_with_their_own_layers():
    """``num_layers_in_last_pipeline_stage`` (and first), and a split ``pp`` does not divide: each stage's parameters,
    activations and FLOPs are its own layers' (the estimate took ``num_layers // pp`` for every stage); the ``--gpus``
    search skips the PP sizes the stage sizes cannot fill, naming why. Measured through ``check``:
    ``tests/test_context_parallel.py``."""
    from lightning_megatron.check.timing import stage_flops
    from lightning_megatron.cost.memory import stage_layers

    m = GPTCost(num_layers=12, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, vocab_size=512,
                seq_length=128, micro_batch_size=2, global_batch_size=8, num_layers_in_last_pipeline_stage=4,
                hidden_dropout=0.0, attention_dropout=0.0)
    layout = ParallelDims(pp=2, dp=1)
    assert [stage_layers(m, 2, s) for s in (0, 1)] == [[8], [4]]
    assert [stage_layers(m, 2, s, 2) for s in (0, 1)] == [[4, 4], [2, 2]]
    assert stage_layers(m, 1, 0) == [12]  # one stage holds them all
    even = dataclasses.replace(m, num_layers_in_last_pipeline_stage=None)
    first, last = (estimate_stage(m, layout, s) for s in (0, 1))
    assert first.params - estimate_stage(even, layout, 0).params == 2 * m.layer_parameters(1)
    assert first.activation_bytes == pytest.approx(2 * 8 * m.layer_activation_bytes(1, False))  # 1F1B: 2 in flight
    assert stage_flops(m, layout, 0, head=False) == pytest.approx(2 * stage_flops(m, layout, 1, head=False))
    assert [sum(stage_layers(dataclasses.replace(even, num_layers=10), 4, s)) for s in range(4)] == [3, 3, 2, 2]
    assert estimate_stage(dataclasses.replace(even, num_layers=10), ParallelDims(pp=4, dp=1), 0).params > \
        estimate_stage(dataclasses.replace(even, num_layers=10), ParallelDims(pp=4, dp=1), 2).params
    search = search_layouts(dataclasses.replace(m, num_layers_in_last_pipeline_stage=10), 8)
    assert search.skipped.get("PP=4 does not fit the model's first / last pipeline stage sizes") == 2, search.skipped
    assert {x.pp for x in search.layouts} == {1, 2}  # PP=4 and 8 leave the other stages 2 layers for 3 or 7


def test_the_output_layers_deferred_weight_gradient_keeps_each_microbatchs_output_gradient_and_input():
    """``defer_embedding_wgrad_compute``: measured, what the output layer's deferral keeps of one microbatch (its
    output gradient ``[tokens, V/t]`` and input ``[tokens, h]``, fp32 and bf16) is the estimate's, and the last stage
    holds the step's earlier microbatches' until the flush (the estimate counted none: at Llama-3-8B's vocabulary,
    s = 4096, bf16, 1 GiB a microbatch), or as many as ``wgrad_deferral_limit``."""
    from lightning_megatron.models.gpt.model import gpt_loss
    from lightning_megatron.tensor_parallel import DeferredWeightGrad

    for dtype in ("float32", "bfloat16"):
        m = GPTCost(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, vocab_size=1000,
                    seq_length=64, micro_batch_size=2, global_batch_size=8, params_dtype=dtype, hidden_dropout=0.0,
                    attention_dropout=0.0, untie_embeddings_and_output_weights=True, defer_embedding_wgrad_compute=True)
        model, _ = m.build_model_step(1)
        deferral = DeferredWeightGrad()
        deferral.open()
        model.output_layer.weight_grad_deferral = deferral  # as the step's policy sets it on the last stage
        tokens = torch.randint(0, 1000, (2, 64))
        gpt_loss(model(tokens, labels=tokens), torch.ones(2, 64)).backward()
        held = sum(g.untyped_storage().nbytes() + x.untyped_storage().nbytes() for _, _, g, x in deferral._stashed)
        assert deferral.pending == 1 and m.deferred_output_bytes(1) == held, (dtype, held)
        layout = ParallelDims(pp=2, dp=1)
        plain = dataclasses.replace(m, defer_embedding_wgrad_compute=False)
        assert (estimate_stage(m, layout, 1).activation_bytes - estimate_stage(plain, layout, 1).activation_bytes
                == 3 * held)  # 4 microbatches: 3 kept while the last runs
        limited = dataclasses.replace(m, wgrad_deferral_limit=2)  # at most 2 wait (tests/test_deferred_wgrad.py)
        assert (estimate_stage(limited, layout, 1).activation_bytes
                - estimate_stage(plain, layout, 1).activation_bytes == 2 * held)
        assert estimate_stage(m, layout, 0).activation_bytes == estimate_stage(plain, layout, 0).activation_bytes


def test_the_output_layers_deferred_weight_gradient_is_timed_at_the_flush_beyond_the_drain():
    """``defer_embedding_wgrad_compute`` moves the last stage's output-layer weight gradients (GEMM and the [V/t, h]
    gradient written) out of its microbatches into the flush, where the earlier stages' last backward passes (2/3 of
    the bubble) hide them: TP=2 x PP=2 x DP=2, 4 microbatches, efficiencies of 1, no latency."""
    m = GPTCost(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32768, seq_length=1024,
                micro_batch_size=2, global_batch_size=16, params_dtype="bfloat16", position_embedding_type="rope",
                hidden_dropout=0.0, attention_dropout=0.0)
    dev = Device(name="toy", flops_16=1e14, flops_32=1e13, hbm=1e12, link_intra=1e11, link_inter=1e10,
                 devices_per_node=4, latency_intra=0.0, latency_inter=0.0)
    layout, fw = ParallelDims(tp=2, pp=2, dp=2), Framework(overlap_grad_reduce=False)
    plain = estimate_time(m, layout, dev, MEASURED, fw)
    deferred = dataclasses.replace(m, defer_embedding_wgrad_compute=True)
    # a microbatch's: 2 x 2048 head tokens x 1024 x 32768 / 2 FLOPs (a third of the head's), its 32 MiB gradient written
    assert deferred_head_flops(deferred, layout) == 2 * 2048 * 1024 * 32768 / 2
    wgrad = 2 * 2048 * 1024 * 32768 / 2 / 1e14 + 16384 * 1024 * 2 / 1e12
    st = estimate_time(deferred, layout, dev, MEASURED, fw)
    assert st.bubble == plain.bubble  # the first stage's microbatch, as before
    drain = 2 / 3 * plain.bubble
    assert 4 * wgrad > drain > wgrad  # all 4 at the flush outlast the drain; one does not
    assert st.compute == pytest.approx(plain.compute - 4 * wgrad + (4 * wgrad - drain), rel=1e-12)
    # wgrad_deferral_limit=1: three are drained within the steady state, the last one hides in the drain
    one = estimate_time(dataclasses.replace(deferred, wgrad_deferral_limit=1), layout, dev, MEASURED, fw)
    assert one.compute == pytest.approx(plain.compute - wgrad, rel=1e-12)
    # nothing to defer without a pipeline, or under LoRA (the output layer is frozen)
    flat = ParallelDims(tp=2, dp=4)
    assert deferred_head_flops(deferred, flat) == 0
    assert estimate_time(deferred, flat, dev, MEASURED, fw) == estimate_time(m, flat, dev, MEASURED, fw)
    assert deferred_head_flops(dataclasses.replace(deferred, lora_rank=8), layout) == 0


def test_the_cpu_tunings_weight_grads_once_a_step_are_timed_after_each_ranks_last_backward():
    """``CPUTuning(weight_grads_per_step=True)``: each microbatch leaves out its layers' weight-gradient GEMMs (and on
    a pipeline's last stage the output layer's, which owns its weight there), whose gradients are added into
    ``main_grad`` once a step instead of each microbatch; each rank computes them after its last backward pass, the
    last stage's hidden behind the earlier stages' last backward passes (2/3 of the bubble), the first stage's not at
    all. Hand-computed: TP=2 x PP=2 x DP=2, 4 microbatches of 2 x 1024 tokens, bf16, efficiencies of 1."""
    m = GPTCost(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32768, seq_length=1024,
                micro_batch_size=2, global_batch_size=16, params_dtype="bfloat16", position_embedding_type="rope",
                hidden_dropout=0.0, attention_dropout=0.0)
    dev = Device(name="toy", flops_16=1e14, flops_32=1e13, hbm=1e12, link_intra=1e11, link_inter=1e10,
                 devices_per_node=4, latency_intra=0.0, latency_inter=0.0)
    fw = Framework(overlap_grad_reduce=False)
    per_step = dataclasses.replace(fw, weight_grads_per_step=True)
    layout = ParallelDims(tp=2, pp=2, dp=2)
    # a rank of either stage: 2 layers of qkv 3h^2, projection h^2, MLP 2 h 4h, over TP=2; the output layer 16384 x h
    weights, head = 2 * 12 * 1024 ** 2 / 2, 16384 * 1024
    assert step_weight_parameters(m, layout, 0) == step_weight_parameters(m, layout, 1) == weights
    layers_mb = 2 * 2048 * weights / 1e14  # a microbatch's layer weight gradients: 2 FLOPs a weight and token
    head_mb = 2 * 2048 * 1024 * 16384 / 1e14 + head * 2 / 1e12  # the head's GEMM and its bf16 gradient written
    # main_grad: the microbatches no longer add these bf16 gradients (copy, then 3 adds: 4 x 6 + 3 x 4 bytes); the
    # drain copies each once (6 bytes)
    each, once = [36 * weights / 1e12, 36 * (weights + head) / 1e12], [6 * weights / 1e12, 6 * (weights + head) / 1e12]
    plain, st = estimate_time(m, layout, dev, MEASURED, fw), estimate_time(m, layout, dev, MEASURED, per_step)
    # 1F1B over 2 stages and 4 microbatches: the bubble is one microbatch of the first stage, now without its share
    assert plain.bubble - st.bubble == pytest.approx(layers_mb + each[0] / 4, rel=1e-9)
    drains = [4 * layers_mb + once[0], 4 * (layers_mb + head_mb) + once[1]]
    flush = drains[1] - 2 / 3 * st.bubble
    assert flush > drains[0]  # the last stage's drain (the head's GEMMs too) beyond the bubble's outlasts the first's
    assert st.compute == pytest.approx(plain.compute - 4 * (layers_mb + head_mb) - each[1] + flush, rel=1e-12)
    assert st.accumulate == pytest.approx(plain.accumulate - each[1] + once[1], rel=1e-12)
    # without PP the (tied) output layer uses the embedding's weight: the layers' gradients alone, all after the one
    # stage's last backward, so the step only saves their additions into main_grad (2 microbatches: 16 - 6 bytes)
    flat = ParallelDims(tp=2, dp=4)
    one = estimate_time(m, flat, dev, MEASURED, per_step)
    assert deferred_head_flops(m, flat, per_step=True) == 0 < deferred_head_flops(m, layout, per_step=True)
    assert one.compute == pytest.approx(estimate_time(m, flat, dev, MEASURED, fw).compute - 10 * 2 * weights / 1e12,
                                        rel=1e-12)
    # untied, the output layer owns its weight without PP too; under LoRA nothing is deferred (bases frozen)
    assert deferred_head_flops(dataclasses.replace(m, untie_embeddings_and_output_weights=True), flat, per_step=True)
    lora = dataclasses.replace(m, lora_rank=8)
    assert step_weight_parameters(lora, layout, 0) == deferred_head_flops(lora, layout, per_step=True) == 0
    assert estimate_time(lora, layout, dev, MEASURED, per_step) == estimate_time(lora, layout, dev, MEASURED, fw)
    # a mixture of experts' layer: the attention's and the shared experts' weights; the routed experts are not linear
    # layers of the tuning's (their grouped GEMMs keep their per-microbatch gradients)
    moe = dataclasses.replace(m, num_moe_experts=8, moe_router_topk=2, moe_shared_expert_intermediate_size=512)
    assert step_weight_parameters(moe, layout, 0) == 2 * (4 * 1024 ** 2 + 2 * 1024 * 512) / 2


def test_default_dropout_is_the_modules():
    from lightning_megatron.models.bert import BertConfig

    assert BertConfig().hidden_dropout == BertConfig().attention_dropout == DEFAULT_DROPOUT


def test_collective_times():
    assert collective_time("all_reduce", 8e9, 8, 1e11, 1e-5) == pytest.approx(2 * 7 / 8 * 8e9 / 1e11 + 1e-5)
    assert collective_time("all_gather", 8e9, 4, 1e11, 0.0) == pytest.approx(3 / 4 * 8e9 / 1e11)
    assert collective_time("reduce_scatter", 8e9, 1, 1e11, 1e-5) == 0.0
    assert collective_time("send", 1e9, 2, 1e10, 2e-5) == pytest.approx(0.1 + 2e-5)


def test_flops_are_the_papers():
    """GPT with f = 4h and full recomputation: 96 B s l h^2 (1 + s/6h + V/16lh) (Narayanan et al. 2021)."""
    B, s, l, h, V = 512, 2048, 24, 2304, 51200
    ours = transformer_flops(num_layers=l, hidden_size=h, ffn_hidden_size=4 * h, seq_length=s, tokens=B * s,
                             head_tokens=B * s, vocab_size=V, head_dense=False, recompute=True)
    assert ours == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)), rel=1e-12)


def test_step_time_against_hand_computed_numbers():
    """TP=2 x PP=2 x DP=2 on 8 devices of 4 per node, measured-style efficiencies of 1, no latency."""
    m = GPTCost(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32768, seq_length=1024,
                micro_batch_size=2, global_batch_size=16, params_dtype="bfloat16", position_embedding_type="rope",
                hidden_dropout=0.0, attention_dropout=0.0)
    dev = Device(name="toy", flops_16=1e14, flops_32=1e13, hbm=1e12, link_intra=1e11, link_inter=1e10,
                 devices_per_node=4, latency_intra=0.0, latency_inter=0.0)
    layout = ParallelDims(tp=2, pp=2, dp=2)
    fw = Framework(overlap_grad_reduce=False)
    st = estimate_time(m, layout, dev, MEASURED, fw)
    # Last stage, one microbatch (2048 tokens), per TP rank: 2 layers 360777252864 + head 412316860416 FLOPs, / 2.
    gemm = 386547056640 / 1e14
    # Elementwise: 28672 bytes per token and layer (norms 8192, 2 bias-dropout-adds 12288, bias-GeLU 8192 / 2),
    # x 2048 tokens x 2 layers x 3 passes, and RoPE's 14 bf16 elements read or written per element of the 8 query
    # and 8 key heads of 64 of a TP rank (forward and backward, 14 x 2048 bytes per token and layer), at 1e12 B/s.
    elementwise = (28672 * 3 + 14 * 2048) * 2048 * 2 / 1e12
    # Vocabulary passes of the last stage: its [16384, 1024] bf16 word-embedding copy (32 MiB) read by the
    # head's forward and input-gradient GEMMs and its gradient written (3 x 32 MiB), and the fp32 logits
    # [2048, 16384] passed 6 times.
    vocab = (3 * 33554432 + 6 * 2048 * 16384 * 4) / 1e12
    # Gradient accumulation into the fp32 main grads, 4 microbatches: the first a copy (read 2, write 4 bytes),
    # the 3 others an add (read 2, read and write 4): 36 bytes per parameter and step.
    params = max(estimate_stage(m, layout, s).params for s in range(2))
    assert params == estimate_stage(m, layout, 1).params  # the last stage is the fuller one
    accumulate = 36 * params / 1e12
    tp = 2 * 4 * (2 * 1 / 2 * 4194304 / 1e11)  # 2 layers x 4 all-reduces of [s, b, h] bf16 (4 MiB) over NVLink
    # the output layer's input gradient all-reduced, and the cross entropy's 3 fp32 values a token (8 KiB each)
    tp += 2 * 1 / 2 * 4194304 / 1e11 + 3 * (2 * 1 / 2 * 8192 / 1e11)
    pp = 4194304 / 1e10  # the last stage sends its input gradient back, between nodes (2 x 2 x 2 = 8 > 4 per node)
    # The tied word embedding's fp32 grads (64 MiB) all-reduced between the first and last stage, once a step.
    tied = 2 * 1 / 2 * 67108864 / 1e10
    compute_mb = gemm + elementwise + vocab + accumulate / 4
    t_mb = compute_mb + tp + pp
    assert st.compute == pytest.approx(4 * compute_mb, rel=1e-12)  # 16 / (2 x 2) = 4 microbatches
    assert st.vocab == pytest.approx(4 * vocab, rel=1e-12) and st.accumulate == pytest.approx(accumulate, rel=1e-12)
    assert st.tp_comm == pytest.approx(4 * tp, rel=1e-12)
    assert st.pp_comm == pytest.approx(4 * pp + tied, rel=1e-12)
    # The bubble: 1F1B waits for the other stage once, its forward filling the pipe and its backward draining
    # it (the last stage, the slowest, runs back to back in between): one microbatch of the first stage, which
    # has 2 layers, no head, its word embedding's dense gradient to write (32 MiB) and its own parameters.
    params0 = estimate_stage(m, layout, 0).params
    t0 = gemm - 412316860416 / 2 / 1e14 + elementwise + 33554432 / 1e12 + 36 * params0 / 1e12 / 4 + tp + pp
    assert st.bubble == pytest.approx(t0, rel=1e-12) and t0 < t_mb
    # fp32 grads all-reduced within the node, then divided by the DP size in place (read and write 4 bytes each)
    assert st.dp_comm == pytest.approx(2 * 1 / 2 * 4 * params / 1e11 + 8 * params / 1e12, rel=1e-12)
    # Adam over the fp32 main params (read param, grad and both moments, write param and moments: 28 bytes), the
    # norm's read of the grads (4) and the main params copied back into the bf16 model params (read 4, write 2).
    assert st.optimizer == pytest.approx(38 * params / 1e12, rel=1e-12)
    fp32 = estimate_time(dataclasses.replace(m, params_dtype="float32"), layout, dev, MEASURED, fw)
    assert fp32.optimizer == pytest.approx(32 * params / 1e12, rel=1e-12)  # no main copy to write back
    assert st.tokens_per_s == pytest.approx(16 * 1024 / st.total)
    flops = transformer_flops(num_layers=4, hidden_size=1024, ffn_hidden_size=4096, seq_length=1024, tokens=16384,
                              head_tokens=16384, vocab_size=32768, head_dense=False)
    assert st.mfu == pytest.approx(flops / st.total / 8 / 1e14)
    # VP divides the bubble; SP moves the same TP bytes, and its backward gathers the qkv and fc1 inputs again:
    # hidden behind their input gradients' GEMMs (asynchronous collectives), or not (the CPU tuning's synchronous
    # ones: two all-gathers of [s, b, h] a layer); ZeRO-1 = reduce-scatter + all-gather; overlap hides DP.
    vp = estimate_time(m, ParallelDims(tp=2, pp=2, vp=2, dp=2), dev, MEASURED, fw)
    assert vp.bubble == pytest.approx((t0 + 2 * pp) / 2, rel=1e-12)  # 3 sends: chunk 1 both ways, chunk 3 back
    sp = estimate_time(m, ParallelDims(tp=2, pp=2, dp=2, sequence_parallel=True), dev, MEASURED, fw)
    # ... and once a step sums the gradients of the parameters that saw a chunk of the sequence over TP: the last
    # stage's 2 layers' norms and row-parallel biases (6 h), the final norm (2 h), fp32
    sp_grads = 2 * 1 / 2 * (2 * 6 + 2) * 1024 * 4 / 1e11
    assert sp.tp_comm == pytest.approx(st.tp_comm + sp_grads) and sp.pp_comm == pytest.approx(4 * pp / 2 + tied)
    exposed = estimate_time(m, ParallelDims(tp=2, pp=2, dp=2, sequence_parallel=True), dev, MEASURED,
                            dataclasses.replace(fw, overlap_sp_gather=False))
    # the gathers again: the qkv and fc1 inputs of 2 layers and the output layer's, 4 microbatches
    assert exposed.tp_comm == pytest.approx(sp.tp_comm + 4 * (2 * 2 + 1) * (1 / 2 * 4194304 / 1e11), rel=1e-12)
    z = estimate_time(m, ParallelDims(tp=2, pp=2, dp=2, zero1=True), dev, MEASURED, fw)
    # ZeRO-1: reduce-scatter, the mean of the rank's half, all-gather of the bf16 params
    assert z.dp_comm == pytest.approx(1 / 2 * 4 * params / 1e11 + 8 * params / 2 / 1e12 + 1 / 2 * 2 * params / 1e11,
                                      rel=1e-12)
    assert z.optimizer == pytest.approx(st.optimizer / 2)
    hidden = estimate_time(m, layout, dev, MEASURED, Framework())  # the strategy's default: overlapped
    # the reduction hidden behind the last microbatch's backward; the mean after it is not
    assert hidden.dp_comm == pytest.approx(max(0.0, 2 * 1 / 2 * 4 * params / 1e11 - 2 / 3 * compute_mb)
                                           + 8 * params / 1e12)
    # megatron-core's gradient_accumulation_fusion: the weight-gradient GEMMs add into main_grad themselves.
    fused = estimate_time(m, layout, dev, MEASURED, Framework(overlap_grad_reduce=False, fused_grad_accumulation=True))
    assert fused.accumulate == 0 and fused.compute == pytest.approx(st.compute - accumulate, rel=1e-12)


def test_the_host_bounds_a_step_whose_kernels_take_less_than_their_dispatch():
    """On an accelerator the host queues the kernels ahead of the device: a step takes the longer of the device's
    work and the host's dispatch (ops x host seconds per op), by the rank whose host dispatches the most."""
    m = GPTCost(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1024, seq_length=128,
                micro_batch_size=2, global_batch_size=16, params_dtype="bfloat16")
    dev = Device(name="fast device, slow host", flops_16=1e15, flops_32=1e14, hbm=1e13, link_intra=1e12,
                 link_inter=1e11, host_op=20e-6)
    ops = HostOps(layer=150, ends=300, step=350)
    layout = ParallelDims(pp=2, dp=1)
    st = estimate_time(m, layout, dev, MEASURED, Framework(host_ops=ops))
    # 8 microbatches; the last stage dispatches its 2 layers' and the ends' ops for each, then the step's.
    assert st.host == pytest.approx((8 * (2 * 150 + 300) + 350) * 20e-6, rel=1e-12)
    assert st.host > st.device and st.total == st.host
    assert st.tokens_per_s == pytest.approx(16 * 128 / st.host)
    no_host = estimate_time(m, layout, dev, MEASURED, Framework())  # no counts: the device alone
    assert no_host.host == 0 and no_host.total == no_host.device == pytest.approx(st.device, rel=1e-12)
    cpu = estimate_time(m, layout, dataclasses.replace(dev, host_op=None), MEASURED, Framework(host_ops=ops))
    assert cpu.host == 0  # a CPU runs its kernels on the host: their dispatch is inside the measured rates
    recomputed = estimate_time(dataclasses.replace(m, recompute=True), layout, dev, MEASURED, Framework(host_ops=ops))
    assert recomputed.host == pytest.approx((8 * (2 * 150 * 4 / 3 + 300) + 350) * 20e-6, rel=1e-12)
    slow = dataclasses.replace(dev, flops_16=1e11)  # device-bound: the host waits
    assert estimate_time(m, layout, slow, MEASURED, Framework(host_ops=ops)).total == pytest.approx(
        estimate_time(m, layout, slow, MEASURED, Framework()).total, rel=1e-12)


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_host_ops_are_counted_from_the_models_own_layer_and_ends_at_any_width(family):
    """``count_host_ops`` counts a small copy of the model (the same spec, norms, heads and groups) as an
    accelerator dispatches it: a layer is a two-layer model's ops less a one-layer model's. Without dropout and
    with LayerNorm (where the CPU dispatches as a GPU does) its counts are this test's own count of the model at
    another width, sequence and batch, with one hook op per trained parameter for the GradBuffer. Each hidden
    dropout site adds its fused op and that op's backward (2; the CPU composes four ops forward), the attention's
    dropout nothing (inside the fused kernel; the CPU's SDPA with dropout runs its ~45-op math path), and RMSNorm
    is a fused kernel each way as LayerNorm is (the CPU composes ~25 ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_megatron.check.host_ops import count_host_ops
    from lightning_megatron.tensor_parallel.random import MODEL_PARALLEL_RNG_TRACKER_NAME, get_rng_tracker
    from lightning_megatron.tensor_parallel.utils import torch_kernel_sums

    if family == "bert":
        m = BertCost(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=512, micro_batch_size=32,
                     global_batch_size=32, params_dtype="bfloat16", hidden_dropout=0.0, attention_dropout=0.0)
        other = dataclasses.replace(m, hidden_size=96, seq_length=40, micro_batch_size=3)
    else:
        m = GPTCost(num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=5632,
                    gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope",
                    vocab_size=32000, seq_length=2048, micro_batch_size=16, global_batch_size=16,
                    params_dtype="bfloat16", hidden_dropout=0.0, attention_dropout=0.0)
        other = dataclasses.replace(m, hidden_size=64, ffn_hidden_size=48, seq_length=24, micro_batch_size=2)

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    def counted(layers: int) -> int:
        with torch_kernel_sums():  # as on a GPU: its kernels sum 16-bit weight gradients in fp32 themselves
            module, step = other.build_model_step(layers)
            step()
            with Ops() as ops:
                step()
        return ops.count + sum(p.requires_grad for p in module.parameters())

    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG_TRACKER_NAME not in tracker.states:
        tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, 1234)
    one, two = counted(1), counted(2)
    host = count_host_ops(m)
    assert host.layer == two - one > 100 and host.ends == 2 * one - two > 50, (host, one, two)
    dropped = count_host_ops(dataclasses.replace(m, hidden_dropout=0.1, attention_dropout=0.1))
    assert dropped.layer == host.layer + 2 * 2  # two bias-dropout-adds a layer
    if family == "bert":  # and the embeddings' dropout
        assert dropped.ends == host.ends + 2
    else:  # two norms a layer and the final one: a fused kernel each way; a weight each, where LayerNorm's bias
        rms = count_host_ops(dataclasses.replace(m, rmsnorm=True))  # costs its AccumulateGrad's and the hook's ops
        assert rms.layer == host.layer - 2 * 2 and rms.ends == host.ends - 2, (rms, host)



def test_a_mixtures_host_ops_are_counted_the_same_whatever_ran_before():
    """A mixture's routing follows its random weights, and the ops its experts dispatch follow the routing: the
    small copy's weights are drawn from one seed (``isolated_rng``), so the counts do not move with the global
    RNG's state (the Mixtral recipe's layer read 406 to 462 ops in three runs of the CLI before), and that state
    is left as it was (the CPU's; an accelerator's generators are not touched)."""
    from lightning_megatron.check.host_ops import count_host_ops

    m = GPTCost(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope", rmsnorm=True,
                vocab_size=32000, seq_length=4096, micro_batch_size=1, global_batch_size=8, params_dtype="bfloat16",
                hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=8, moe_router_topk=2)
    counts = []
    for seed in (0, 4, 5):  # the old counts: 434 and 73, 434 and 45, 378 and 129
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        counts.append(count_host_ops(m))
        assert torch.equal(torch.get_rng_state(), before)
    assert counts[0] == counts[1] == counts[2] and counts[0].layer > 300, counts

def test_vocabulary_and_grad_accumulation_bytes():
    """The memory traffic that the GEMM FLOPs do not count, for BERT's tied 30592 x 768 fp32 word embedding
    (micro batch 4 x 128 tokens, 15% of them in the LM head: 76.8), per microbatch and rank."""
    from lightning_megatron.check.timing import grad_accumulation_bytes, vocab_bytes

    m = BertCost(num_layers=4, hidden_size=768, num_attention_heads=12, seq_length=128, micro_batch_size=4,
                 global_batch_size=16, post_norm=True, on_cpu=True)
    w = 30592 * 768 * 4  # the word embedding: 94 MB
    logits = 6 * 76.8 * 30592 * 4  # [n, V] fp32, 6 passes
    # One rank holds both uses of the tied weight: the embedding's dense gradient written (W), the head's
    # weight read twice and its gradient written (3W), and autograd's sum of the two gradients (read 2W, write W).
    assert vocab_bytes(m, ParallelDims(dp=1), 0) == pytest.approx(7 * w + logits, rel=1e-12)
    assert vocab_bytes(m, ParallelDims(pp=2, dp=1), 0) == pytest.approx(w, rel=1e-12)  # first stage: the embedding
    assert vocab_bytes(m, ParallelDims(pp=2, dp=1), 1) == pytest.approx(3 * w + logits, rel=1e-12)  # last stage: the head
    # TP splits the vocabulary (padded to a multiple of 128 x 2: 30720, 15360 rows a rank); the head sees all n
    # tokens.
    assert vocab_bytes(m, ParallelDims(tp=2, dp=1), 0) == pytest.approx((7 * 15360 * 768 * 4 + 6 * 76.8 * 15360 * 4), rel=1e-12)
    # Per step: the first microbatch copies its grads into main_grad (read 4, write 4 bytes per parameter),
    # the 3 others add theirs (read 4, read and write 4): 4 x 8 + 3 x 4 = 44 bytes per parameter.
    assert grad_accumulation_bytes(1000, 4, 4, Framework()) == 44000
    assert grad_accumulation_bytes(1000, 2, 1, Framework()) == 6000  # bf16 grads, one microbatch: a copy
    assert grad_accumulation_bytes(1000, 4, 4, Framework(fused_grad_accumulation=True)) == 0


def test_measured_elementwise_rate_times_the_memory_bound_kernels():
    """A CPU's norms, GELU, softmax and dropout run far below its copy bandwidth: ``Device.elementwise``
    (measured from one layer) times them, the optimizer stays at ``hbm``; the rate is the counted bytes
    over what the layer took beyond its GEMMs."""
    from dataclasses import replace

    from lightning_megatron.check.devices import _elementwise_rate, probe_times
    from lightning_megatron.check.timing import elementwise_bytes
    from lightning_megatron.flops import transformer_flops

    m = BertCost(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                 global_batch_size=4, on_cpu=True)
    dev = Device(name="toy", flops_16=1e10, flops_32=1e10, hbm=1e10, link_intra=1e9, link_inter=1e9, latency_intra=0.0,
                 latency_inter=0.0, cores=1)
    fw = Framework(overlap_grad_reduce=False, fused_attention=not m.unfused_attention)
    base = estimate_time(m, ParallelDims(dp=1), dev, MEASURED, fw)
    slow = estimate_time(m, ParallelDims(dp=1), replace(dev, elementwise=1e9), MEASURED, fw)
    counted = elementwise_bytes(m, ParallelDims(dp=1), fw) * 16 * 2 * 2 * 3 * 2  # tokens x layers x 3 passes x 2 microbatches
    assert slow.compute - base.compute == pytest.approx(counted / 1e9 - counted / 1e10, rel=1e-12)
    assert slow.optimizer == base.optimizer and slow.vocab == base.vocab and slow.accumulate == base.accumulate
    flops = transformer_flops(num_layers=1, hidden_size=64, ffn_hidden_size=256, seq_length=16, tokens=32,
                              head_tokens=0, vocab_size=0)
    assert _elementwise_rate(m, flops / 1e10 + 0.5, 1e10) == pytest.approx(counted / 4 / 0.5, rel=1e-9)
    # one real layer of m, forward and backward, on one thread and in turn on two (the threads' speed-up)
    probed = probe_times(32, 256, 64, False, m, rounds=1, cores=2)
    assert probed["layer"] > 0 and probed["layer_on_cores"] > 0


def test_a_cpu_ranks_threads_speed_its_kernels_up_by_the_measured_factor():
    """A CPU's rates are one core's. A rank with more cores than one runs them as intra-op threads, which do not
    scale linearly (each op's dispatch stays on one thread; small ops split poorly): ``Device.thread_speedup``,
    measured on the model's layer at all cores, divides its GEMMs, memory-bound kernels and vocabulary passes
    (interpolated linearly between one thread and all); the gradient accumulation and the optimizer keep the copy
    rate times the cores (a copy's bandwidth does scale). Ranks with a core or less time-slice: unchanged."""
    from dataclasses import replace

    from lightning_megatron.check.devices import isolated_rng

    m = BertCost(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=16,
                 micro_batch_size=2, global_batch_size=16, on_cpu=True)
    linear = Device(name="toy", flops_16=1e10, flops_32=1e10, hbm=1e10, elementwise=2e9, vocab=3e9, link_intra=1e9,
                    link_inter=1e9, latency_intra=0.0, latency_inter=0.0, cores=4)
    measured = replace(linear, thread_speedup=2.5)  # 4 threads run a layer 2.5x as fast as one
    fw = Framework(overlap_grad_reduce=False, fused_attention=not m.unfused_attention)

    def kernels(t):  # the compute that is not the gradient accumulation
        return t.compute - t.accumulate

    for layout, threads, speedup in (("tp1", 4, 2.5), ("dp2", 2, 1 + 1.5 / 3), ("dp4", 1, 1), ("dp8", 0.5, 0.5)):
        dims = ParallelDims.parse(layout)
        a, b = (estimate_time(m, dims, dev, MEASURED, fw) for dev in (linear, measured))
        assert kernels(b) == pytest.approx(kernels(a) * threads / speedup, rel=1e-12), layout
        assert b.vocab == pytest.approx(a.vocab * threads / speedup, rel=1e-12), layout
        assert (b.accumulate, b.optimizer, b.dp_comm, b.peak) == (a.accumulate, a.optimizer, a.dp_comm, a.peak)
    with pytest.raises(ValueError, match="thread_speedup=5"):
        replace(linear, thread_speedup=5.0)  # more than its 4 cores: a measurement gone wrong
    with pytest.raises(ValueError, match="thread_speedup=2"):
        replace(linear, cores=None, thread_speedup=2.0)  # a GPU has no threads to speed up
    threads = torch.get_num_threads()
    with isolated_rng(threads=2):  # what measures the layer at all cores
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == threads


def test_measured_vocab_rate_times_the_vocabulary_passes():
    """``Device.vocab`` (measured from a one-layer model less its layer) times the vocabulary passes of the
    first and last stage, nothing else; the rate is their counted bytes over what the embeddings, heads
    and loss took beyond the heads' GEMMs."""
    from dataclasses import replace

    from lightning_megatron.check.devices import _vocab_rate, isolated_rng, probe_times
    from lightning_megatron.check.timing import vocab_bytes

    m = BertCost(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=16,
                 micro_batch_size=2, global_batch_size=4, on_cpu=True)
    dev = Device(name="toy", flops_16=1e10, flops_32=1e10, hbm=1e10, link_intra=1e9, link_inter=1e9, latency_intra=0.0,
                 latency_inter=0.0, cores=1)
    fw = Framework(overlap_grad_reduce=False, fused_attention=not m.unfused_attention)
    base = estimate_time(m, ParallelDims(dp=1), dev, MEASURED, fw)
    slow = estimate_time(m, ParallelDims(dp=1), replace(dev, vocab=1e9), MEASURED, fw)
    counted = 7 * 1024 * 64 * 4 + 6 * 0.15 * 32 * 1024 * 4  # tied [1024, 64] fp32 weight on one rank, 4.8 head tokens
    assert vocab_bytes(m, ParallelDims(dp=1), 0) == pytest.approx(counted, rel=1e-12)
    assert slow.vocab == pytest.approx(2 * counted / 1e9, rel=1e-12)  # 2 microbatches
    assert slow.compute - base.compute == pytest.approx(2 * (counted / 1e9 - counted / 1e10), rel=1e-12)
    assert (slow.optimizer, slow.accumulate, slow.tp_comm) == (base.optimizer, base.accumulate, base.tp_comm)
    head = transformer_flops(num_layers=0, hidden_size=64, ffn_hidden_size=256, seq_length=16, tokens=32,
                             head_tokens=0.15 * 32, vocab_size=1024)
    assert _vocab_rate(m, head / 1e10 + 0.5, 1e10) == pytest.approx(counted / 0.5, rel=1e-9)
    assert probe_times(32, 256, 64, False, m, rounds=1)["model"] > 0  # a real one-layer BERT of m with its loss
    # The decoder's own pieces are timed, not BERT's: its grouped-query, gated layer and a one-layer GPTModel.
    decoder = GPTCost(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      gated_linear_unit=True, add_bias_linear=False, rmsnorm=True, position_embedding_type="rope",
                      vocab_size=1000, seq_length=16, micro_batch_size=2, global_batch_size=4, on_cpu=True)
    layer, step = decoder.build_layer_step()
    assert layer.self_attention.linear_qkv.weight.shape == ((4 + 2 * 2) * 16, 64)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with isolated_rng():
        with Ops() as ops:  # the timed layer runs the model's rotary embeddings, which its counted bytes include
            step()
        assert {"cos", "sin"} <= ops.names, sorted(ops.names)
        ops.names.clear()
        with Ops() as ops:  # and, as the model, makes their cos and sin once, not at every step
            step()
        assert not {"cos", "sin"} & ops.names and {"mul", "sub_", "add_"} <= ops.names, sorted(ops.names)
    assert layer.mlp.linear_fc1.weight.shape == (2 * 96, 64) and layer.mlp.linear_fc1.bias is None
    assert type(layer.input_layernorm).__name__ == "RMSNorm"
    model, _ = decoder.build_model_step()
    assert type(model).__name__ == "GPTModel"
    probed = probe_times(32, 96, 64, False, decoder, rounds=1)
    assert probed["layer"] > 0 and probed["model"] > 0


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
# Table 1 (also the weak-scaling table of Megatron-LM's README, 2021): GPT, s = 2048, V = 51200, A100 80GB.
# (parameters B, heads, hidden, layers, TP, PP, GPUs, batch, achieved TFLOP/s per GPU)
MEGATRON_WEAK_SCALING = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
MEGATRON_2021 = Framework(grad_reduce_bytes=2, overlap_grad_reduce=False, p2p_scatter_gather=True,
                          fused_attention=False, fused_grad_accumulation=False)
"""Megatron-LM in the paper: fp16 gradients all-reduced after the backward, scatter/gather of pipeline
sends, unfused (scale-mask-softmax) attention, each microbatch's grads added into main_grad by its DDP
hook; micro batch 1, no VP assumed (not stated per row)."""


def megatron_row(heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
                 eff: Efficiency = Efficiency()) -> float:
    """Predicted TFLOP/s per GPU in the paper's count (with recomputation) for one row of the table."""
    from lightning_megatron.check.devices import DEVICES

    m = GPTCost(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=51200,
                max_sequence_length=2048, seq_length=2048, micro_batch_size=1, global_batch_size=batch,
                params_dtype="float16", recompute=True)
    st = estimate_time(m, ParallelDims(tp=tp, pp=pp, dp=gpus // (tp * pp)), DEVICES["a100"], eff, MEGATRON_2021)
    flops = transformer_flops(num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden, seq_length=2048,
                              tokens=batch * 2048, head_tokens=batch * 2048, vocab_size=51200, head_dense=False,
                              recompute=True)
    return flops / st.total / gpus / 1e12


@pytest.mark.parametrize("row", MEGATRON_WEAK_SCALING, ids=[f"{r[0]:g}B" for r in MEGATRON_WEAK_SCALING])
def test_megatron_weak_scaling_within_25_percent(row):
    _, heads, hidden, layers, tp, pp, gpus, batch, published = row
    assert abs(megatron_row(heads, hidden, layers, tp, pp, gpus, batch) / published - 1) < 0.25


def test_the_estimate_reads_the_recipes_cpu_tuning_as_the_strategy_does(tmp_path):
    """``--estimate-time --device this`` times the run the recipe describes: its MegatronStrategy's ``cpu_tuning``
    read as the strategy reads the argument (``true``, a mapping of the record's fields or ``class_path`` and
    ``init_args``, ``false`` or none); a field the record lacks is refused, naming it and the record's fields."""
    from pathlib import Path

    from lightning_megatron.check.recipe import load_recipe
    from lightning_megatron.cpu import CPUTuning

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    base = recipes / "bert_tiny.yaml"  # cpu_tuning: true

    def tuning(value: str) -> CPUTuning | None:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"base: {base}\ntrainer:\n  strategy:\n    init_args:\n      cpu_tuning: {value}\n")
        return load_recipe(recipe).cpu_tuning

    assert load_recipe(base).cpu_tuning == CPUTuning()
    assert load_recipe(recipes / "bert_base.yaml").cpu_tuning is None  # a GPU recipe: the library's path on a CPU
    assert tuning("{weight_grads_per_step: true}") == CPUTuning(weight_grads_per_step=True)
    assert tuning("{class_path: lightning_megatron.cpu.CPUTuning, init_args: {kernels: false}}") == CPUTuning(
        kernels=False)
    assert tuning("false") is None and tuning("null") is None
    with pytest.raises(ValueError, match=r"cpu_tuning: weight_grad_per_step is not a field of .*CPUTuning "
                                         r"\(shared_memory_collectives, keep_freed_memory, kernels, "
                                         r"weight_grads_per_step"):
        tuning("{weight_grad_per_step: true}")


@pytest.mark.parametrize("tuned", [True, False], ids=["per-step-tuning", "untuned"])
def test_cli_estimate_time_on_this_machine_measures_a_ranks_threads(capsys, tmp_path, tuned):
    """``check --estimate-time --device this`` as a user runs it on a recipe (``base:`` the tiny BERT one, with the
    CPU tuning's weight gradients once a step, or with the tuning off): the machine measured as that run runs (the
    tuning's shared-memory collectives, kept memory and kernels, or gloo, torch's allocator and the library's
    kernels; one core's rates, the model's layer on every core too), the layouts predicted with them and the
    tuning; DP's part holds the reduction and the mean, one rank's none."""
    import os
    import platform
    import re
    import sys
    from pathlib import Path

    from lightning_megatron.cli import main

    base = Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml"
    recipe = tmp_path / "r.yaml"
    tuning = "{weight_grads_per_step: true}" if tuned else "false"
    recipe.write_text(f"base: {base}\ntrainer:\n  strategy:\n    init_args:\n      cpu_tuning: {tuning}\n")
    with pytest.raises(SystemExit) as e:
        main(["check", "--config", str(recipe), "--estimate-time", "--device", "this", "--layouts", "tp1,dp2,tp2dp2"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    linux = sys.platform.startswith("linux")
    if tuned:
        assert ("the recipe's CPU tuning: shared-memory collectives, freed memory kept, CPU kernels, weight gradients "
                "once a step") in out, out
        assert "the model's own layer and one-layer model with the CPU tuning's kernels" in out, out
        if linux:  # timed as a tuned run's ranks run: glibc keeps freed memory, the groups share memory on x86-64
            assert "freed memory kept (the CPU tuning's allocator)" in out, out
            assert ("shared-memory all-reduce" in out) == (platform.machine().lower() in ("x86_64", "amd64")), out
    else:
        assert "without the CPU tuning (the recipe switches none of its pieces on): gloo collectives" in out, out
        assert "the model's own layer and one-layer model with torch's kernels" in out, out
        assert "gloo all-reduce" in out and "freed memory kept" not in out, out
    cores = os.cpu_count() or 1
    # ranks outnumbering the cores share them in time slices: the table says what that does not model
    assert ("tp2dp2: more ranks than this machine's" in out) == (cores < 4), out
    if cores > 1:
        speedup = float(re.search(rf"the layer on {cores} threads ([0-9.]+)x one", out).group(1))
        assert 1 <= speedup <= cores, out
    rows = {r[0]: r for r in (line.split() for line in out.splitlines()) if r and r[0] in ("tp1", "dp2")}
    assert float(rows["tp1"][8]) == 0 < float(rows["dp2"][8]), out  # the DP column
    assert float(rows["tp1"][1]) > 0 and float(rows["dp2"][1]) > 0


def test_the_machines_probes_take_turns_so_a_slow_spell_falls_on_none_alone():
    """``--device this`` derives the elementwise rate from a layer's time beyond its GEMMs at the GEMM probe's rate:
    a slow spell on the layer's runs alone read it 10x off (1.53 against 14.85 GB/s in one benchmark run). The probes
    take turns, each keeping its fastest run: the spell costs each probe the runs inside it, not its best."""
    from lightning_megatron.check.devices import interleaved_best, probe_times

    now, order = [0.0], []
    spell = {"gemm": [1.0, 1.0, 1.0], "layer": [9.0, 9.0, 5.0]}  # the first two rounds slow for the layer alone

    def step(name):
        def run():
            order.append(name)
            now[0] += spell[name][order.count(name) - 1]
        return run

    best = interleaved_best({"gemm": step("gemm"), "layer": step("layer")}, 3, clock=lambda: now[0])
    assert best == {"gemm": 1.0, "layer": 5.0}
    assert order == ["gemm", "layer"] * 3
    m = BertCost(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=16,
                 micro_batch_size=2, global_batch_size=4, on_cpu=True)
    times = probe_times(32, 256, 64, False, m, rounds=2)  # the real probes: GEMM, copy, the layer, the 1-layer model
    assert set(times) == {"gemm", "copy", "layer", "model"} and min(times.values()) > 0
    class LayerOnly(BertCost):  # a family that builds no one-layer model: the copy rate stands in for its vocabulary
        def build_model_step(self, num_layers=1):
            raise NotImplementedError

    layer_only = LayerOnly(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)})
    assert set(probe_times(32, 256, 64, False, layer_only, rounds=1)) == {"gemm", "copy", "layer"}


class _LayerFails(BertCost):
    """A model whose layer cannot be built: the measuring process that times it dies (module level: the spawned
    process unpickles it by name)."""

    def build_layer_step(self):
        raise RuntimeError("no layer")


def test_measuring_this_machine_notices_its_process_dying_instead_of_waiting():
    """The machine is measured in two spawned processes; one that dies before reporting is noticed (the caller
    raises, naming the exit codes and the way round) instead of waiting on the queue forever."""
    from lightning_megatron.check.devices import measure_this_machine

    m = _LayerFails(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=16,
                    micro_batch_size=2, global_batch_size=4, on_cpu=True)
    with pytest.raises(RuntimeError, match=r"processes ended with \[1, (0|None)\].*--device h100"):
        measure_this_machine(32, 256, 64, False, shape=m)


def test_cli_estimate_time_ranks_layouts_and_lists_what_it_skips(capsys, tmp_path):
    """Through the CLI: --data.* overrides, VP layouts, skip reasons, ranking by predicted tokens/s."""
    from lightning_megatron.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  config:\n    num_layers: 4\n    hidden_size: 256\n    num_attention_heads: 4\n"
                      "data:\n  global_batch_size: 32\n  micro_batch_size: 8\n  max_seq_length: 128\n")
    with pytest.raises(SystemExit) as e:
        main(["check", "--config", str(recipe), "--estimate-memory", "--estimate-time", "--device", "h100",
              "--gpus", "8", "--gpu-memory", "80GB", "--data.global_batch_size", "16", "--data.micro_batch_size", "4",
              "--model.config.hidden_size", "512"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert "hidden 512" in out and "global batch 16" in out and "dropout 0.1/0.1" in out
    assert "DP=8 does not divide global batch 16 into micro batches of 4: skipped 1" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("tp", "pp", "dp")) and " yes " in line]
    assert "tp2pp2vp2dp2" in [r[0] for r in rows]
    speeds = [float(r[8]) for r in rows]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) > 10
    with pytest.raises(SystemExit) as e:
        main(["check", "--config", str(recipe), "--layouts", "tp2,pp2vp2,dp2zero1", "--estimate-time",
              "--device", "a100", "--gemm-efficiency", "0.5"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "GEMM 0.5" in out and "pp2vp2" in out and "dp2zero1" in out
    with pytest.raises(SystemExit) as e:  # the strategy's overlap_param_gather hides ZeRO-1's all-gather
        main(["check", "--config", str(recipe), "--layouts", "tp2,pp2vp2,dp2zero1", "--estimate-time",
              "--device", "a100", "--gemm-efficiency", "0.5", "--overlap-param-gather", "on"])
    overlapped = capsys.readouterr().out
    dp_column = {name: [line.split()[8] for line in text.splitlines() if line.startswith("dp2zero1")][0]
                 for name, text in (("off", out), ("on", overlapped))}
    # hidden: the all-gather; left: the mean of the rank's shard and what the backward does not hide of its reduction
    assert e.value.code == 0 and 0 < float(dp_column["on"]) < float(dp_column["off"]) / 2, dp_column
    for flags, message in ((["--device", "tpu"], "unknown device 'tpu'"),
                           (["--link-efficiency", "1.5"],
                            "argument --link-efficiency: 1.5 is not a fraction in (0, 1]"),
                           (["--device", "h100", "--host-op-us", "-1"], "--host-op-us -1: a GPU's host microseconds"),
                           (["--device", "this", "--host-op-us", "5"], "--device this runs the kernels on its host")):
        with pytest.raises(SystemExit) as e:
            main(["check", "--config", str(recipe), "--estimate-time", *flags])
        assert e.value.code == 2 and message in capsys.readouterr().err
    for host_us in ("22", "0"):  # the hosts' dispatch: counted and shown, or left out (the device alone)
        with pytest.raises(SystemExit) as e:
            main(["check", "--config", str(recipe), "--layouts", "tp1,tp2", "--estimate-time", "--device", "h100",
                  "--host-op-us", host_us])
        out = capsys.readouterr().out
        assert e.value.code == 0, out
        rows = {line.split()[0]: [float(x) for x in line.split()[1:11]] for line in out.splitlines()
                if line.startswith("tp")}
        step, host = {k: r[0] for k, r in rows.items()}, {k: r[9] for k, r in rows.items()}
        if host_us == "0":
            assert set(host.values()) == {0.0} and "us an op" not in out, out
        else:  # one TP=2 rank dispatches every op of its layers, as one TP=1 rank: no faster on the host
            assert "host 22 us an op" in out and host["tp2"] == host["tp1"] > 0, out  # the flag's value
            assert all(step[k] >= 0.999 * host[k] for k in step), out  # host printed to 3 digits
    with pytest.raises(SystemExit) as e:  # --gpus alone would silently run a parity check instead
        main(["check", "--config", str(recipe), "--gpus", "8"])
    assert e.value.code == 2 and "add one of them" in capsys.readouterr().err


def test_cli_refuses_an_estimate_whose_ops_it_cannot_count_and_names_the_way_round(capsys, tmp_path, monkeypatch):
    """A model whose small copy fails to run stops the estimate with the reason and ``--host-op-us 0``."""
    from lightning_megatron.check import time_cli
    from lightning_megatron.cli import main

    def cannot(m):
        raise RuntimeError("a shape the small copy cannot take")

    monkeypatch.setattr(time_cli, "count_host_ops", cannot)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  config:\n    num_layers: 2\n    hidden_size: 64\n    num_attention_heads: 4\n")
    with pytest.raises(SystemExit) as e:
        main(["check", "--config", str(recipe), "--layouts", "tp1", "--estimate-time", "--device", "h100"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "a shape the small copy cannot take" in err and "--host-op-us 0" in err, err
    with pytest.raises(SystemExit) as e:
        main(["check", "--config", str(recipe), "--layouts", "tp1", "--estimate-time", "--device", "h100",
              "--host-op-us", "0"])
    assert e.value.code == 0 and "tp1" in capsys.readouterr().out


class _ToyCost:
    """A model family's own cost model (not a TransformerCost): 100 parameters per layer split over TP, 7 more on
    the first stage; 1000 activation bytes per layer and microbatch; its own TP rule."""

    num_layers, micro_batch_size, global_batch_size, param_bytes, optimizer, recompute = 4, 2, 8, 4, "sgd", False

    def stage_parameters(self, tp: int, pp: int, stage: int) -> int:
        return self.num_layers // pp * 100 // tp + (7 if stage == 0 else 0)

    def layer_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return 1000.0 / tp

    def layer_input_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return 10.0

    def first_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return 5.0

    def last_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return 50.0

    def tensor_parallel_problem(self, tp: int) -> str | None:
        return None if tp <= 2 else f"toy: TP={tp} > 2"

    def describe(self) -> str:
        return "a toy of 4 layers"


class _ToyModule:
    @classmethod
    def estimate_shape(cls, model, data, *, micro_batch_size, global_batch_size):
        return _ToyCost()


def test_memory_estimate_takes_any_module_cost_model(capsys):
    """--estimate-memory computes from the module's declared costs (cost.MemoryCost), not from a BERT
    formula: a family plugs in its own parameter and activation counts without touching check/."""
    from types import SimpleNamespace

    from lightning_megatron.cost import estimate_memory
    from lightning_megatron.check.memory_cli import fitting_layouts
    from lightning_megatron.cost import EstimatesCost, MemoryCost

    toy = _ToyCost()
    assert isinstance(toy, MemoryCost) and isinstance(_ToyModule, EstimatesCost)
    assert isinstance(BERT_LARGE, MemoryCost)  # BERT's cost record is one implementation
    # PP=2, DP=2: 2 microbatches; stage 0 holds 2 layers (200) + 7, 2 forwards in flight, plus its 5 bytes
    est = estimate_memory(toy, ParallelDims(pp=2, dp=2))
    assert (est.stage, est.params, est.param_bytes, est.grad_bytes, est.optimizer_bytes) == (0, 207, 828, 828, 828)
    assert est.activation_bytes == 2 * 2 * 1000 + 5 * 2
    last = estimate_stage(toy, ParallelDims(pp=2, dp=2), 1)
    assert (last.params, last.activation_bytes) == (200, 1 * 2 * 1000 + 50)
    found = search_layouts(toy, 4)
    assert found.skipped == {"toy: TP=4 > 2": 1} and ParallelDims(tp=2, pp=2, dp=1) in found.layouts
    recipe = SimpleNamespace(model_class=f"{__name__}._ToyModule", model={}, data={}, dropout={}, schedule_only={},
                             micro_batch_size=2, global_batch_size=8)
    assert fitting_layouts(recipe, 2, 10**6) == 0
    out = capsys.readouterr().out
    assert "a toy of 4 layers" in out and "tp2" in out.replace("-", "").lower()


def test_context_and_expert_parallel_terms_against_hand_computed_numbers():
    """CP=2 gives each rank half the tokens (FLOPs, elementwise bytes, TP messages), all-gathers each layer's
    keys and values and reduce-scatters their gradients, and reduces the dense gradients over d x cp ranks;
    EP=2 adds 4 all-to-alls of the routed rows per MoE layer and reduces the experts' gradients over their
    own data-parallel ranks (none here). Latencies 0, efficiencies 1, one node of 4."""
    dev = Device(name="toy", flops_16=1e14, flops_32=1e13, hbm=1e12, link_intra=1e11, link_inter=1e10,
                 devices_per_node=4, latency_intra=0.0, latency_inter=0.0)
    fw = Framework(overlap_grad_reduce=False)
    m = GPTCost(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32768, seq_length=1024,
                micro_batch_size=2, global_batch_size=16, params_dtype="bfloat16", position_embedding_type="rope",
                hidden_dropout=0.0, attention_dropout=0.0)
    dp = estimate_time(m, ParallelDims(tp=2, dp=2), dev, MEASURED, fw)  # 4 microbatches of 2048 tokens
    cp = estimate_time(m, ParallelDims(tp=2, cp=2, dp=1), dev, MEASURED, fw)  # 8 microbatches of 1024 tokens per rank
    layout = ParallelDims(tp=2, cp=2, dp=1)
    assert stage_flops(m, layout, 0) == pytest.approx(stage_flops(m, ParallelDims(tp=2, dp=1), 0) / 2, rel=1e-12)
    # Keys and values of the whole sequence: 2 x 1024 tokens x 2 samples x 16 groups x 64 / 2 (TP) x 2 bytes,
    # all-gathered forward and their gradients reduce-scattered backward, over 2 ranks, 4 layers, 8 microbatches.
    kv = 2 * 1024 * 2 * 16 * 64 / 2 * 2
    assert cp.cp_comm == pytest.approx(8 * 4 * 2 * (1 / 2 * kv / 1e11), rel=1e-12)
    assert cp.tp_comm == pytest.approx(dp.tp_comm, rel=1e-12)  # twice the microbatches, half the tokens each
    assert cp.dp_comm == pytest.approx(dp.dp_comm, rel=1e-12)  # the same parameters over d x cp = 2 ranks
    assert dp.cp_comm == 0 and dp.ep_comm == 0
    # Both ranks run 8192 tokens a step: the same GEMMs and elementwise bytes; but the word embedding's dense
    # gradient and the gradient accumulation come per microbatch (8 against 4), as do the logits of fewer tokens.
    assert cp.compute - cp.vocab - cp.accumulate == pytest.approx(dp.compute - dp.vocab - dp.accumulate, rel=1e-12)
    assert cp.accumulate > dp.accumulate and cp.vocab > dp.vocab
    assert cp.total == pytest.approx(
        cp.compute + cp.tp_comm + cp.cp_comm + cp.dp_comm + cp.optimizer, rel=1e-12)
    # The ring (p2p) sends the rank's keys and values (kv / 2) once a layer forward and once backward (c - 1 = 1),
    # each beside a ring step's attention, two [256, 256] blocks (four chunks of the 1024 tokens) of 8 heads of 64:
    # 2 x 2 products forward, 2 x 5 backward, of 2 x 256^2 x 64 x 8 x 2 FLOPs; exposed only beyond them (at 5e13
    # FLOP/s the forward's exchange outlasts its blocks, the backward's does not). And each layer's key and value
    # gradients go to their owners all-to-all in fp32 (2 x 4 x 1024 x 2 x 16 x 64 / 2 bytes).
    ring_model, slower = dataclasses.replace(m, cp_comm_type="p2p"), dataclasses.replace(dev, flops_16=5e13)
    ring = estimate_time(ring_model, layout, slower, MEASURED, fw)
    product = 2 * 256**2 * 64 * 8 * 2
    send = kv / 2 / 1e11
    grads = 2 * 4 * 1024 * 2 * 16 * 64 / 2
    assert 4 * product / 5e13 < send < 10 * product / 5e13
    assert ring.cp_comm == pytest.approx(8 * 4 * (send - 4 * product / 5e13 + 1 / 2 * grads / 1e11), rel=1e-12)
    # on a link a hundred times slower little of it hides (the blocks take 1.4e-5 s beside 2e-3)
    slow = estimate_time(ring_model, layout, dataclasses.replace(slower, link_intra=1e9), MEASURED, fw)
    assert slow.cp_comm == pytest.approx(8 * 4 * (2 * send * 100 - 14 * product / 5e13 + 1 / 2 * grads / 1e9),
                                         rel=1e-12)
    moe = GPTCost(num_layers=2, hidden_size=512, num_attention_heads=8, vocab_size=1024, seq_length=256,
                  micro_batch_size=2, global_batch_size=8, params_dtype="bfloat16", position_embedding_type="rope",
                  hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=4, moe_router_topk=2,
                  moe_ffn_hidden_size=1024)
    ep = estimate_time(moe, ParallelDims(dp=2, ep=2), dev, MEASURED, fw)  # 2 microbatches per rank
    rows = 256 * 2 * 2 * 512 * 2  # tokens x k rows of h bf16 elements
    counts = 8 * 4  # the int64 rows per expert, all-to-all once a forward
    assert ep.ep_comm == pytest.approx(2 * 2 * (4 * (1 / 2 * rows) + 1 / 2 * counts) / 1e11, rel=1e-12)
    # The allgather dispatcher: every rank's tokens (2 x 512 of 512 bf16) and int64 sort keys (2 x 512 x 2) gathered
    # and the slots (2 x 512 x 2 rows) reduce-scattered forward; the gradients of the tokens and slots the other way
    x = 256 * 2 * 512 * 2
    gathered = estimate_time(dataclasses.replace(moe, moe_token_dispatcher_type="allgather"), ParallelDims(dp=2, ep=2),
                             dev, MEASURED, fw)
    assert gathered.ep_comm == pytest.approx(2 * 2 * 1 / 2 * (2 * (2 * x + 2 * 2 * x) + 2 * 8 * 512 * 2) / 1e11,
                                             rel=1e-12)
    params = estimate_stage(moe, ParallelDims(dp=2, ep=2), 0).params
    experts = moe.stage_expert_parameters(1, 2, 1)
    assert 0 < experts < params
    # Only the dense parameters are all-reduced over the 2 data-parallel ranks; each expert lives on one rank. Every
    # gradient is then divided by the DP size (the loss's mean over the global batch: the experts' too).
    assert ep.dp_comm == pytest.approx(2 * 1 / 2 * 4 * (params - experts) / 1e11 + 8 * params / 1e12, rel=1e-12)
    replicated = estimate_time(moe, ParallelDims(dp=2), dev, MEASURED, fw)
    dense = estimate_stage(moe, ParallelDims(dp=2), 0).params
    assert replicated.ep_comm == 0 and replicated.dp_comm == pytest.approx(
        2 * 1 / 2 * 4 * dense / 1e11 + 8 * dense / 1e12, rel=1e-12)


def test_step_flops_of_a_gated_grouped_query_decoder_and_of_its_lora_run():
    """A Llama-shaped layer (SwiGLU: three h x f matrices; 2 key/value groups of 8 heads) counted as such, and
    under LoRA the frozen weights without their weight-gradient GEMMs while each adapter weight does all 6 FLOPs
    per token (hand-written from the shapes, not from transformer_flops)."""
    shape = dict(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1024,
                 gated_linear_unit=True, vocab_size=1024, seq_length=256, micro_batch_size=2, global_batch_size=4,
                 position_embedding_type="rope")
    m = GPTCost(**shape)
    T, L, h, f, s, V = 512, 2, 512, 1024, 256, m.padded_vocab(1)
    p, k = 512, 2 * 64  # query projection n d, key/value projection g d
    weights = 2 * h * p + 2 * h * k + 3 * h * f  # q and proj, k and v, gate/up/down
    layers = 6 * T * L * weights + 12 * T * L * s * p
    assert stage_flops(m, ParallelDims(dp=1), 0) == pytest.approx(layers + 6 * T * h * V, rel=1e-12)
    lora = GPTCost(**shape, lora_rank=8, lora_targets=("linear_qkv", "linear_fc2"))
    adapters = (8 * h + (8 + 2 * 2) * 64 * 8) + (8 * f + h * 8)  # qkv: A [r, h], B [(n + 2g) d, r]; fc2: A [r, f], B [h, r]
    assert stage_flops(lora, ParallelDims(dp=1), 0, head=False) == pytest.approx(
        layers - 2 * T * L * weights + 6 * T * L * adapters, rel=1e-12)


def test_lora_step_moves_only_what_trains_and_pays_for_the_adapters_passes():
    """Under LoRA the base is frozen, the word embedding and output layer included: the output layer runs its
    forward and input-gradient GEMMs only (4 of 6 FLOPs), no dense embedding gradient or output-layer gradient
    is written, and only the adapters are accumulated into main grads, reduced over DP and stepped by the
    optimizer. The adapters' thin GEMMs move their inputs and outputs through memory (6 input + 4 output
    elements per token, forward and backward: the output accumulated into the base's), and add no activation-sized
    TP collective (a column-parallel adapter's input gradient joins its base's reduction), only their ``[s, b, r]``
    ones. Hand-written from the shapes; latencies 0."""
    from lightning_megatron.check.timing import adapter_bytes, grad_accumulation_bytes, vocab_bytes

    dev = Device(name="toy", flops_16=1e14, flops_32=1e13, hbm=1e12, link_intra=1e11, link_inter=1e10,
                 devices_per_node=8, latency_intra=0.0, latency_inter=0.0)
    fw = Framework(overlap_grad_reduce=False)
    shape = dict(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1024,
                 gated_linear_unit=True, vocab_size=1024, seq_length=256, micro_batch_size=2, global_batch_size=4,
                 position_embedding_type="rope", untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                 attention_dropout=0.0)
    full = GPTCost(**shape)
    lora = GPTCost(**shape, lora_rank=8, lora_targets=("linear_qkv", "linear_fc2"))
    T, h, f, V, w = 512, 512, 1024, 1024, 1024 * 512 * 4  # tokens of a microbatch; the [V, h] fp32 weights
    one = ParallelDims(dp=1)
    head = stage_flops(lora, one, 0) - stage_flops(lora, one, 0, head=False)
    assert head == pytest.approx(4 * T * h * V, rel=1e-12)
    logits = 6 * T * V * 4
    # Untied, one stage: the embedding's dense gradient (W), the output layer read twice and its gradient written
    # (3W); nothing is summed. Frozen: the output layer read twice, nothing written.
    assert vocab_bytes(full, one, 0) == pytest.approx(4 * w + logits, rel=1e-12)
    assert vocab_bytes(lora, one, 0) == pytest.approx(2 * w + logits, rel=1e-12)
    assert vocab_bytes(lora, ParallelDims(pp=2, dp=1), 0) == 0  # the frozen embedding: no gradient at all
    # qkv (column): in h, out (8 + 2 x 2) x 64 = 768 (over TP); fc2 (row): in f (over TP), out h.
    assert adapter_bytes(full, one) == 0
    assert adapter_bytes(lora, one) == 4 * (6 * 512 + 4 * 768 + 6 * 1024 + 4 * 512)
    assert adapter_bytes(lora, ParallelDims(tp=2, dp=1)) == 4 * (6 * 512 + 4 * 384 + 6 * 512 + 4 * 512)

    adapters = (8 * h + 768 * 8) + (8 * f + h * 8)  # qkv A [r, h], B [768, r]; fc2 A [r, f], B [h, r]
    trained = 2 * adapters  # two layers
    base = estimate_time(full, ParallelDims(dp=2), dev, MEASURED, fw)  # one microbatch per rank
    est = estimate_time(lora, ParallelDims(dp=2), dev, MEASURED, fw)
    assert est.dp_comm == pytest.approx(2 * 1 / 2 * 4 * trained / 1e11 + 8 * trained / 1e12, rel=1e-12)
    assert est.optimizer == pytest.approx(trained * fw.optimizer_bytes_per_param(4) / 1e12, rel=1e-12)
    assert est.accumulate == pytest.approx(grad_accumulation_bytes(trained, 4, 1, fw) / 1e12, rel=1e-12)
    assert est.optimizer < base.optimizer / 100 and est.dp_comm < base.dp_comm / 100
    # The compute: the frozen weights' weight-gradient GEMMs and the output layer's gone, the adapters' 6 FLOPs
    # per weight and token added; their bytes at the elementwise rate (hbm here); the vocabulary passes above.
    weights = 2 * h * 512 + 2 * h * 128 + 3 * h * f
    flops = 2 * (6 * T * weights + 12 * T * 256 * 512) - 2 * 2 * T * weights + 2 * 6 * T * adapters + 4 * T * h * V
    elementwise = 2 * T * (3 * elementwise_bytes(lora, one, fw) + adapter_bytes(lora, one))
    assert est.compute == pytest.approx(flops / 1e13 + elementwise / 1e12 + (2 * w + logits) / 1e12
                                        + est.accumulate, rel=1e-12)
    # MFU counts what the step runs: the global batch is 2 such microbatches (4 samples of 256 tokens).
    assert est.model_flops == pytest.approx(2 * flops, rel=1e-12)
    # TP=2: no more TP collectives of [s, b, h] than without adapters (a column-parallel adapter reads its base's
    # mapped input: their input gradients are summed before the one all-reduce), one less: the first layer's qkv
    # input gradient (x, 1 MiB in fp32), which the frozen embedding does not need; the adapters' own are [s, b, r]
    # (a = 512 x 8 fp32, 16 KiB): qkv's A output gathered (a/2 sent) and its gradient all-reduced (a), fc2's
    # all-reduced (a), in each of 2 layers, 2 microbatches.
    tp_full = estimate_time(full, ParallelDims(tp=2, dp=1), dev, MEASURED, fw)
    tp_lora = estimate_time(lora, ParallelDims(tp=2, dp=1), dev, MEASURED, fw)
    assert tp_full.tp_comm > 0
    assert tp_lora.tp_comm == pytest.approx(tp_full.tp_comm + 2 * (2 * 2.5 * 16384 - 1048576) / 1e11, rel=1e-12)


def test_measured_elementwise_rate_of_a_decoder_layer_counts_its_own_gemms():
    """The time a layer spends beyond its GEMMs is what the elementwise rate divides into: a grouped-query, gated
    layer's GEMMs are counted with its own shape (3 h x f matrices, narrow key/value projections), and a LoRA
    layer's without the frozen weights' weight gradients, with its adapters' FLOPs and bytes."""
    from lightning_megatron.check.devices import _elementwise_rate, probe_times
    from lightning_megatron.check.timing import adapter_bytes

    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                 gated_linear_unit=True, add_bias_linear=False, rmsnorm=True, position_embedding_type="rope",
                 vocab_size=1000, seq_length=16, micro_batch_size=2, global_batch_size=4, on_cpu=True)
    m = GPTCost(**shape)
    T, h, f, s = 32, 64, 96, 16
    weights = 2 * h * 64 + 2 * h * 32 + 3 * h * f  # q and proj; k and v of 2 groups of 16; gate, up, down
    flops = 6 * T * weights + 12 * T * s * 64
    fw = Framework(fused_attention=not m.unfused_attention)
    counted = 3 * T * elementwise_bytes(m, ParallelDims(dp=1), fw)
    assert _elementwise_rate(m, flops / 1e10 + 0.5, 1e10) == pytest.approx(counted / 0.5, rel=1e-9)
    lora = GPTCost(**shape, lora_rank=4, lora_targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    adapters = (4 * h + 128 * 4) + (4 * 64 + h * 4) + (4 * h + 2 * f * 4) + (4 * f + h * 4)
    flops = 6 * T * weights - 2 * T * weights + 6 * T * adapters + 12 * T * s * 64
    counted = 3 * T * elementwise_bytes(lora, ParallelDims(dp=1), fw) + T * adapter_bytes(lora, ParallelDims(dp=1))
    assert _elementwise_rate(lora, flops / 1e10 + 0.5, 1e10) == pytest.approx(counted / 0.5, rel=1e-9)
    # The layer timed is the LoRA layer: its base frozen, its adapters training.
    layer, _ = lora.build_layer_step()
    trains = sorted(n for n, p in layer.named_parameters() if p.requires_grad)
    assert trains and all(".adapter." in f".{n}" for n in trains), trains
    assert len(trains) == 8  # A and B of the four projections
    # Timed as ``--device this`` times it (its attention dropout draws from the model-parallel RNG state, which
    # the measurement seeds when the process has none: the step alone needed an earlier test to have seeded it).
    assert probe_times(32, 96, 64, False, lora, rounds=1)["layer"] > 0


def _moved_bytes(run, larger_than: int = 0) -> int:
    """Bytes the aten ops of ``run()`` read and write at dispatch: each op's tensor arguments read, its results
    written (an ``out=`` tensor once, as a result); views and allocations move nothing; tensors of at most
    ``larger_than`` elements (an angle table) left out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    skip = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze",
            "reshape", "as_strided", "detach", "alias", "split", "split_with_sizes", "chunk", "unbind", "empty",
            "empty_like", "empty_strided"}
    total = [0]

    def size(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size() if x.numel() > larger_than else 0
        return sum(size(y) for y in x) if isinstance(x, (list, tuple)) else 0

    class Moved(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in skip:
                total[0] += size(list(args)) + size(out)
            return out

    with Moved():
        run()
    return total[0]


def test_a_decoder_layers_gated_mlp_and_rotary_bytes_are_what_their_ops_move():
    """``elementwise_bytes`` of a Llama-shaped layer counts, beyond a plain one, the bytes the library's gated
    activation and rotary embeddings read and write, forward and backward (3 passes of the formula), as counted
    at dispatch: 16 f per token for ``act(gate) * up`` (bias-GeLU's 2 f per pass otherwise), 14 elements of each
    query and key for RoPE; in bf16, at TP=1 and TP=2."""
    from lightning_megatron.check.timing import elementwise_bytes
    from lightning_megatron.transformer.rotary import RotaryEmbedding, apply_rotary_pos_emb
    from lightning_megatron.transformer.utils import gated_activation

    T, f, s, n, g, d = 64, 96, 16, 8, 2, 32
    x = torch.randn(T, 2 * f, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, f, dtype=torch.bfloat16)
    glu = _moved_bytes(lambda: gated_activation(x, "silu").backward(dy))
    assert glu == 16 * f * 2 * T
    freqs = RotaryEmbedding(d)(s)
    q = torch.randn(s, T // s, n + g, d, dtype=torch.bfloat16, requires_grad=True)  # queries and keys of T tokens
    dq = torch.randn_like(q)
    rope = _moved_bytes(lambda: apply_rotary_pos_emb(q, freqs).backward(dq), freqs.numel())
    assert rope == 14 * (n + g) * d * 2 * T

    shape = dict(num_layers=2, hidden_size=n * d, num_attention_heads=n, num_query_groups=g, ffn_hidden_size=f,
                 vocab_size=1000, seq_length=s, micro_batch_size=2, global_batch_size=4, params_dtype="bfloat16",
                 hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, rmsnorm=True)
    llama = GPTCost(**shape, gated_linear_unit=True, position_embedding_type="rope")
    plain = GPTCost(**shape)
    unplaced = GPTCost(**shape, gated_linear_unit=True, position_embedding_type="none")  # no positions at all
    fw = Framework()
    for tp in (1, 2):
        layout = ParallelDims(tp=tp, dp=1)
        extra = 3 * T * (elementwise_bytes(llama, layout, fw) - elementwise_bytes(plain, layout, fw))
        assert extra == pytest.approx((glu - 3 * 2 * f * 2 * T + rope) / tp, rel=1e-12), tp
        extra = 3 * T * (elementwise_bytes(unplaced, layout, fw) - elementwise_bytes(plain, layout, fw))
        assert extra == pytest.approx((glu - 3 * 2 * f * 2 * T) / tp, rel=1e-12), tp  # no rotation moved
    # From a config: each type as it is, and the model --estimate-memory measures applies what the config says.
    from lightning_megatron.models.gpt.config import GPTConfig

    for kind in ("learned_absolute", "rope", "none"):
        config = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, position_embedding_type=kind)
        cost = GPTCost.from_config(config, seq_length=8, micro_batch_size=1, global_batch_size=1, vocab_size=64)
        assert (cost.position_embedding_type, cost.learned_positions) == (kind, kind == "learned_absolute")
        model, _ = cost.build_model_step()
        assert model.position_embedding_type == kind
        assert cost.stage_parameters(1, 1, 0) == sum(p.numel() for p in model.parameters()), kind
    with pytest.raises(ValueError, match="position_embedding_type='alibi' must be one of"):
        GPTCost(**shape, position_embedding_type="alibi")


def test_a_mixture_of_experts_layer_moves_its_routed_rows_and_is_timed_itself():
    """Per token, an MoE layer's all-to-all dispatcher gathers its k routed rows in expert order (read and write
    k h), puts the experts' outputs back into [n, k, h] slots (zeros, then an index copy: 4 k h), weighs them
    (2 k h) and sums them (k h read, h written): (9 k + 1) h elements forward beyond a dense MLP of the active
    width, and 4 k h more at EP > 1 (the received rows regrouped by local expert and back). The layer that
    ``--device this`` times for the elementwise rate is the MoE layer itself: router, dispatcher, grouped experts."""
    from lightning_megatron.transformer.moe import MoELayer

    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, gated_linear_unit=True,
                 add_bias_linear=False, rmsnorm=True, position_embedding_type="rope", vocab_size=1000, seq_length=16,
                 micro_batch_size=2, global_batch_size=4, on_cpu=True, hidden_dropout=0.0, attention_dropout=0.0)
    moe = GPTCost(**shape, ffn_hidden_size=96, num_moe_experts=4, moe_router_topk=2)
    dense = GPTCost(**shape, ffn_hidden_size=2 * 96)  # the active width: k experts of 96
    fw = Framework()
    one = ParallelDims(dp=1)
    assert moe.ffn == dense.ffn == 192
    assert elementwise_bytes(moe, one, fw) - elementwise_bytes(dense, one, fw) == (9 * 2 + 1) * 64 * 4
    ep = ParallelDims(dp=2, ep=2)
    assert elementwise_bytes(moe, ep, fw) - elementwise_bytes(dense, ep, fw) == (9 * 2 + 1 + 4 * 2) * 64 * 4
    layer, step = moe.build_layer_step()
    assert isinstance(layer.mlp, MoELayer) and layer.mlp.num_experts == 4
    assert layer.mlp.experts is not None and layer.mlp.config.moe_ffn_hidden_size == 96
    step()
    model, step = moe.build_model_step()
    assert any(isinstance(x, MoELayer) for x in model.modules())
    step()


def test_cli_plans_a_recipe_with_its_deferred_output_layer_weight_gradient(capsys):
    """``check --estimate-memory --estimate-time --gpus`` plans the recipe as it trains: with its
    ``defer_embedding_wgrad_compute`` (the parity runs turn it off: the one-process reference refuses it), the last
    stage keeps the waiting microbatches' output gradients and inputs, and its step leaves their weight gradients to
    the flush. It had planned every recipe without it: memory short by those tensors (at Llama-3-8B's vocabulary 1
    GiB a microbatch), and "fits" where a run could run out."""
    from lightning_megatron.cli import main

    def row(defer: str) -> list[str]:
        with pytest.raises(SystemExit) as e:
            main(["check", "--config", "recipes/llama_1b.yaml", "--estimate-memory", "--estimate-time", "--device",
                  "h100", "--gpus", "8", "--model.config.defer_embedding_wgrad_compute", defer])
        out = capsys.readouterr().out
        assert e.value.code == 0, out
        return next(line.split() for line in out.splitlines() if line.startswith("tp4pp2 "))

    plain, deferred = row("false"), row("true")
    # activations (GiB) of the fullest rank, the last stage: 4.56 without, 22.19 with the waiting microbatches' tensors
    assert float(deferred[4]) > 4 * float(plain[4])
    compute = [float(r[-1].split("/")[0]) for r in (plain, deferred)]  # the device's compute part (the host bounds it)
    assert compute[1] < compute[0]
