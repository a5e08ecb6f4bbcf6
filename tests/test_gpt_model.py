"""GPTModel on one process: the same logits, loss and gradients as Hugging Face's GPT2LMHeadModel on the
same weights (fp32), megatron-core's parameter names, recomputation equal to none, clear refusals.

The weight copy below is the test's own (the real converters are ``models/gpt/hf.py``): our fused
``linear_qkv`` rows are grouped per head ``[q_h, k_h, v_h]`` (megatron-core's layout with one query per
group), GPT-2's ``c_attn`` is a Conv1D (``[in, out]``) with columns ``[q | k | v]``.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_megatron.models.gpt import GPTConfig, GPTModel
from lightning_megatron.models.gpt.module import GPTLightningModule
from lightning_megatron.transformer import TransformerConfig

VOCAB, SEQ, BATCH, HIDDEN, HEADS, LAYERS = 256, 16, 3, 64, 4, 2
LLAMA_MODULE = dict(spec="llama_layer_spec", num_query_groups=2, activation="silu", gated_linear_unit=True,
                    add_bias_linear=False, position_embedding_type="rope", untie_embeddings_and_output_weights=True)


def _tokens(n: int = SEQ + 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, n), generator=torch.Generator().manual_seed(3))


def _gpt2_config(**kw) -> TransformerConfig:
    return TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh",
                             layernorm_epsilon=1e-5, **kw)


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ + 1, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                  activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def copy_into_gpt2(ours: GPTModel, hf) -> None:
    """Our weights -> GPT2LMHeadModel (Conv1D weights are [in, out]: transposed)."""
    sd = dict(ours.named_parameters())
    n, d = HEADS, HIDDEN // HEADS
    t = hf.transformer
    with torch.no_grad():
        t.wte.weight.copy_(sd["embedding.word_embeddings.weight"][:VOCAB])
        t.wpe.weight.copy_(sd["embedding.position_embeddings.weight"])
        for i, block in enumerate(t.h):
            p = f"decoder.layers.{i}."
            qkv_w = sd[p + "self_attention.linear_qkv.weight"].view(n, 3, d, HIDDEN)
            qkv_b = sd[p + "self_attention.linear_qkv.bias"].view(n, 3, d)
            block.attn.c_attn.weight.copy_(torch.cat([qkv_w[:, j].reshape(n * d, HIDDEN) for j in range(3)]).t())
            block.attn.c_attn.bias.copy_(torch.cat([qkv_b[:, j].reshape(n * d) for j in range(3)]))
            pairs = {"ln_1": "input_layernorm", "ln_2": "pre_mlp_layernorm"}
            for hf_name, name in pairs.items():
                getattr(block, hf_name).weight.copy_(sd[p + name + ".weight"])
                getattr(block, hf_name).bias.copy_(sd[p + name + ".bias"])
            for hf_lin, name in ((block.attn.c_proj, "self_attention.linear_proj"), (block.mlp.c_fc, "mlp.linear_fc1"),
                                 (block.mlp.c_proj, "mlp.linear_fc2")):
                hf_lin.weight.copy_(sd[p + name + ".weight"].t())
                hf_lin.bias.copy_(sd[p + name + ".bias"])
        t.ln_f.weight.copy_(sd["decoder.final_layernorm.weight"])
        t.ln_f.bias.copy_(sd["decoder.final_layernorm.bias"])


def test_gpt2_shape_equals_transformers_gpt2():
    """Logits within 1e-5 of GPT2LMHeadModel's max, the loss (HF shifts the labels itself) within 1e-6
    relative, and the gradients of embedding, first-layer qkv and final norm within 1e-5 (fp32)."""
    ours = GPTModel(_gpt2_config(), "gpt_layer_spec", VOCAB, SEQ + 1, make_vocab_size_divisible_by=128)
    assert ours.padded_vocab_size == VOCAB and "output_layer.weight" not in dict(ours.named_parameters())
    hf = _hf_gpt2()
    copy_into_gpt2(ours, hf)
    ids = _tokens()
    tokens, labels = ids[:, :-1], ids[:, 1:]
    logits = ours(tokens)
    out = hf(input_ids=tokens)
    scale = out.logits.abs().max()
    assert (logits - out.logits).abs().max() <= 1e-5 * scale
    loss = ours(tokens, labels=labels).mean()
    hf_loss = hf(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, hf_loss, rtol=1e-6, atol=0)
    loss.backward()
    hf_loss.backward()
    sd = dict(ours.named_parameters())
    n, d = HEADS, HIDDEN // HEADS
    pairs = [(sd["embedding.word_embeddings.weight"].grad, hf.transformer.wte.weight.grad),
             (sd["embedding.position_embeddings.weight"].grad, hf.transformer.wpe.weight.grad),
             (sd["decoder.final_layernorm.weight"].grad, hf.transformer.ln_f.weight.grad),
             (sd["decoder.layers.1.mlp.linear_fc1.weight"].grad, hf.transformer.h[1].mlp.c_fc.weight.grad.t())]
    qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"].grad.view(n, 3, d, HIDDEN)
    pairs.append((torch.cat([qkv[:, j].reshape(n * d, HIDDEN) for j in range(3)]),
                  hf.transformer.h[0].attn.c_attn.weight.grad.t()))
    for ours_g, hf_g in pairs:
        assert (ours_g - hf_g).abs().max() <= 1e-5 * hf_g.abs().max()


def test_parameter_names_are_megatron_core_gpt_names():
    """Tied (GPT-2): no output_layer.weight on one stage; untied: output_layer.weight [V_pad, h], no biases
    anywhere with add_bias_linear=False, no position embedding without learned positions."""
    names = set(dict(GPTModel(_gpt2_config(), "gpt_layer_spec", 1000, SEQ).named_parameters()))
    layer = {f"decoder.layers.0.{n}" for n in (
        "input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
        "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")}
    assert layer <= names
    assert {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
            "decoder.final_layernorm.weight", "decoder.final_layernorm.bias"} <= names
    assert not any(n.startswith("output_layer") for n in names), names
    untied = GPTModel(_gpt2_config(add_bias_linear=False), "gpt_layer_spec", 1000, SEQ,
                      share_embeddings_and_output_weights=False, position_embedding_type="none")
    params = dict(untied.named_parameters())
    assert params["output_layer.weight"].shape == (1024, HIDDEN)
    assert "embedding.position_embeddings.weight" not in params
    assert not any(n.endswith("bias") and "layernorm" not in n for n in params), sorted(params)


def _module_step(dropout: float = 0.1, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from lightning_megatron.tensor_parallel import model_parallel_seed

    module = GPTLightningModule(GPTConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                          vocab_size=VOCAB, max_sequence_length=SEQ, hidden_dropout=dropout,
                                          attention_dropout=dropout, **kw))
    module.configure_model()
    model_parallel_seed(7, 0)
    torch.manual_seed(11)
    ids = _tokens()
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": (ids[:, 1:] != 0).float()}
    output, loss_func = module.forward_step(batch, module.model_chunks[0])
    loss, _ = loss_func(output)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.sharded_named_parameters()}


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.mark.parametrize("shape,recompute", [({}, FULL), ({}, dict(recompute_granularity="selective")),
                                             ("llama", FULL)], ids=["gpt2-full", "gpt2-selective", "llama-full"])
def test_recompute_equals_no_recompute_with_dropout(shape, recompute):
    """Dropout on: recomputation replays the forward's RNG (and the rope table reaches the recomputed
    layers), so loss and every gradient are identical (1e-6), and dropout really acts (the gradients
    differ from a dropout-free step)."""
    shape = LLAMA_MODULE if shape == "llama" else shape
    loss, grads = _module_step(**shape)
    loss_rc, grads_rc = _module_step(**shape, **recompute)
    torch.testing.assert_close(loss_rc, loss, rtol=1e-6, atol=0)
    for name in grads:
        torch.testing.assert_close(grads_rc[name], grads[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    _, plain = _module_step(dropout=0.0, **shape)
    w = "decoder.layers.0.mlp.linear_fc1.weight"
    assert (plain[w] - grads[w]).abs().max() > 1e-2 * grads[w].abs().max(), "dropout must act for this to prove anything"


def test_refusals_name_the_value():
    with pytest.raises(ValueError, match="position_embedding_type='alibi'"):
        GPTModel(_gpt2_config(), "gpt_layer_spec", VOCAB, SEQ, position_embedding_type="alibi")
    with pytest.raises(ValueError, match="no_such_spec"):
        GPTConfig(spec="no_such_spec")
    with pytest.raises(ValueError, match="normalization='RMSNorm' but spec='gpt_layer_spec' uses LayerNorm"):
        GPTLightningModule(GPTConfig(spec="gpt_layer_spec", normalization="RMSNorm"))
    with pytest.raises(ValueError, match="must start at layer 0"):
        GPTModel(_gpt2_config(), "gpt_layer_spec", VOCAB, SEQ, layer_range=range(1, 2))


MOE_MODULE = dict(LLAMA_MODULE, spec="llama_moe_layer_spec", num_moe_experts=4, moe_router_topk=2,
                  moe_ffn_hidden_size=40, moe_shared_expert_intermediate_size=24)


@pytest.mark.parametrize("shape", [{}, LLAMA_MODULE, MOE_MODULE], ids=["gpt2", "llama", "moe"])
def test_declared_flops_equal_the_counted_matmuls(shape):
    """``training_flops`` (Megatron's decoder count, grouped-query attention and SwiGLU included) equals
    torch's FlopCounterMode over one forward and backward of the whole model (every matmul, the
    attention's included: the unfused path, whose score and context matmuls the counter sees; no
    vocabulary padding: V = 256). A mixture of experts counts the k experts a token is routed to and the shared
    expert (megatron-core's count, which leaves out the router's [h, E] matmul: taken off the counter's total; the
    MFU of an MoE run counted one expert of width ffn_hidden_size)."""
    from torch.utils.flop_counter import FlopCounterMode

    # the unfused attention: CPU SDPA's kernel is not in the counter
    module = GPTLightningModule(GPTConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                          ffn_hidden_size=96, vocab_size=VOCAB, max_sequence_length=SEQ,
                                          hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused",
                                          **shape))
    module.configure_model()
    ids = _tokens()
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(BATCH, SEQ)}
    with FlopCounterMode(display=False) as counter:
        output, loss_func = module.forward_step(batch, module.model_chunks[0])
        loss_func(output)[0].backward()
    declared = module.training_flops(batch, data_parallel_size=1)
    counted = counter.get_total_flops()
    if shape.get("num_moe_experts"):  # the router (and the shared expert's gate, if any): forward 2, backward 4
        counted -= 6 * batch["tokens"].numel() * LAYERS * HIDDEN * shape["num_moe_experts"]
    assert declared == pytest.approx(counted, rel=1e-9), (declared, counter.get_flop_counts())


GROUPS, FFN, ROPE_BASE = 2, 96, 50000.0


def _llama_config(**kw) -> TransformerConfig:
    return TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                             ffn_hidden_size=FFN, hidden_dropout=0.0, attention_dropout=0.0, activation="silu",
                             gated_linear_unit=True, add_bias_linear=False, normalization="RMSNorm",
                             layernorm_epsilon=1e-6, rotary_base=ROPE_BASE, **kw)


def copy_into_llama(ours: GPTModel, hf) -> None:
    """Our weights -> LlamaForCausalLM: linear_qkv rows per query group [q x n/g, k, v] -> q/k/v_proj;
    linear_fc1 [gate; up] (TP=1) -> gate_proj, up_proj."""
    sd = dict(ours.named_parameters())
    n, g, d = HEADS, GROUPS, HIDDEN // HEADS
    m = hf.model
    with torch.no_grad():
        m.embed_tokens.weight.copy_(sd["embedding.word_embeddings.weight"][:VOCAB])
        for i, layer in enumerate(m.layers):
            p = f"decoder.layers.{i}."
            qkv = sd[p + "self_attention.linear_qkv.weight"].view(g, n // g + 2, d, HIDDEN)
            layer.self_attn.q_proj.weight.copy_(qkv[:, : n // g].reshape(n * d, HIDDEN))
            layer.self_attn.k_proj.weight.copy_(qkv[:, n // g].reshape(g * d, HIDDEN))
            layer.self_attn.v_proj.weight.copy_(qkv[:, n // g + 1].reshape(g * d, HIDDEN))
            layer.self_attn.o_proj.weight.copy_(sd[p + "self_attention.linear_proj.weight"])
            gate, up = sd[p + "mlp.linear_fc1.weight"].chunk(2)
            layer.mlp.gate_proj.weight.copy_(gate)
            layer.mlp.up_proj.weight.copy_(up)
            layer.mlp.down_proj.weight.copy_(sd[p + "mlp.linear_fc2.weight"])
            layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(sd[p + "pre_mlp_layernorm.weight"])
        m.norm.weight.copy_(sd["decoder.final_layernorm.weight"])
        hf.lm_head.weight.copy_(sd["output_layer.weight"][:VOCAB])


def test_llama_shape_equals_transformers_llama():
    """RMSNorm, rope (base 50000), grouped-query attention (4 heads, 2 groups), SwiGLU, no biases, untied
    output layer: logits within 1e-5 of LlamaForCausalLM's max, loss within 1e-6, gradients of the
    embedding, q/k projections, gate and the output layer within 1e-5 (fp32)."""
    transformers = pytest.importorskip("transformers")
    ours = GPTModel(_llama_config(), "llama_layer_spec", VOCAB, SEQ + 1, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)
    params = dict(ours.named_parameters())
    assert "embedding.position_embeddings.weight" not in params and "output_layer.weight" in params
    assert not any(n.endswith(".bias") for n in params), sorted(params)
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((HEADS + 2 * GROUPS) * 16, HIDDEN)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                                   max_position_embeddings=SEQ + 1, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": ROPE_BASE},
                                   bos_token_id=0, eos_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    copy_into_llama(ours, hf)
    ids = _tokens()
    tokens, labels = ids[:, :-1], ids[:, 1:]
    logits = ours(tokens)
    hf_logits = hf(input_ids=tokens).logits
    assert (logits - hf_logits).abs().max() <= 1e-5 * hf_logits.abs().max()
    loss = ours(tokens, labels=labels).mean()
    hf_loss = hf(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, hf_loss, rtol=1e-6, atol=0)
    loss.backward()
    hf_loss.backward()
    n, g, d = HEADS, GROUPS, HIDDEN // HEADS
    qkv = params["decoder.layers.0.self_attention.linear_qkv.weight"].grad.view(g, n // g + 2, d, HIDDEN)
    layer = hf.model.layers[0]
    pairs = [(params["embedding.word_embeddings.weight"].grad, hf.model.embed_tokens.weight.grad),
             (params["output_layer.weight"].grad, hf.lm_head.weight.grad),
             (qkv[:, : n // g].reshape(n * d, HIDDEN), layer.self_attn.q_proj.weight.grad),
             (qkv[:, n // g].reshape(g * d, HIDDEN), layer.self_attn.k_proj.weight.grad),
             (params["decoder.layers.1.mlp.linear_fc1.weight"].grad.chunk(2)[0], hf.model.layers[1].mlp.gate_proj.weight.grad),
             (params["decoder.final_layernorm.weight"].grad, hf.model.norm.weight.grad)]
    for ours_g, hf_g in pairs:
        assert (ours_g - hf_g).abs().max() <= 1e-5 * hf_g.abs().max()


def test_platform_kernels_take_the_loss_a_piece_of_rows_at_a_time_with_the_same_bits():
    """A platform's Kernels installed with set_kernels reach the model's loss (Kernels.loss_rows): the llama shape in
    bf16, its loss in pieces of 5 rows (48 tokens: the last piece 3) equals the default kernels' bit for bit, loss and
    gradients, and F.cross_entropy of its logits; the CPU kernels choose ~4 MiB of fp32 rows, none on another device."""
    import torch.nn.functional as F

    from lightning_megatron.cpu.kernels import CPUKernels
    from lightning_megatron.transformer import Kernels, set_kernels

    class FiveRows(Kernels):
        def loss_rows(self, logits: torch.Tensor) -> int | None:
            return 5

    torch.manual_seed(0)
    model = GPTModel(_llama_config(), "llama_layer_spec", VOCAB, SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).bfloat16()
    ids = _tokens()
    tokens, labels = ids[:, :-1], ids[:, 1:]
    runs = []
    for kernels in (Kernels(), FiveRows()):
        assert set_kernels(model, kernels) >= 1 and model.kernels is kernels
        model.zero_grad(set_to_none=True)
        loss = model(tokens, labels=labels)
        loss.sum().backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (whole, whole_grads), (pieces, piece_grads) = runs
    assert torch.equal(pieces, whole)
    assert all(torch.equal(piece_grads[n], g) for n, g in whole_grads.items())
    logits = model(tokens).float()[..., :VOCAB]
    torch.testing.assert_close(pieces, F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                                       reduction="none").view_as(labels), rtol=1e-6, atol=1e-6)
    assert CPUKernels().loss_rows(torch.empty(4, 32_000)) == 32
    assert CPUKernels().loss_rows(torch.empty(4, 4_000_000, device="meta")) is None
    assert CPUKernels(loss_pieces=False).loss_rows(torch.empty(4, 32_000)) is None


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_greedy_generation_equals_transformers_generate(shape):
    """``GPTLightningModule.generate`` (KV cache; learned positions or rope from the cache's offset) gives
    transformers' ``generate(do_sample=False)`` tokens on the same weights, and the same tokens without
    the cache."""
    transformers = pytest.importorskip("transformers")
    kw = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
              max_sequence_length=SEQ + 1, hidden_dropout=0.0, attention_dropout=0.0)
    if shape == "gpt2":
        module = GPTLightningModule(GPTConfig(**kw, activation="gelu_tanh"))
        hf = _hf_gpt2()
        copy = copy_into_gpt2
    else:
        module = GPTLightningModule(GPTConfig(**{**kw, **LLAMA_MODULE, "ffn_hidden_size": FFN,
                                                 "layernorm_epsilon": 1e-6, "rotary_base": ROPE_BASE}))
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=SEQ + 1, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_BASE}, bos_token_id=0, eos_token_id=0)).eval()
        copy = copy_into_llama
    module.configure_model()
    copy(module.model_chunks[0], hf)
    prompt = _tokens(5)
    ours = module.generate(prompt, 10, stop_token=None)
    theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                         attention_mask=torch.ones_like(prompt))
    assert torch.equal(ours, theirs), (ours, theirs)
    assert torch.equal(module.generate(prompt, 10, stop_token=None, use_cache=False), ours)


def test_validate_and_predict_through_the_strategy():
    """``Trainer.validate`` logs ``val_perplexity`` = exp(the mean token cross entropy of the split) next to
    ``val_loss``, the same mean (2 batches of 2 microbatches counting different numbers of tokens); ``Trainer.predict`` under the MegatronStrategy: each batch's prompts (two microbatches)
    followed by ``predict_max_new_tokens`` greedy tokens, the same as ``generate`` on the whole batch."""
    from lightning.pytorch import Trainer
    from test_custom_module import hermetic
    from torch.utils.data import DataLoader

    from lightning_megatron.strategy import MegatronStrategy

    module = GPTLightningModule(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                                          max_sequence_length=SEQ), predict_max_new_tokens=5,
                                predict_stop_at_eod=False)  # a plain dataloader: no tokenizer to stop at
    prompts = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(5))
    # ragged: each row counts its last 1..8 targets (as a fine-tuning answer), so microbatches and batches differ
    rows = [{"tokens": t, "labels": t, "loss_mask": (torch.arange(8) >= 7 - (3 * i) % 8).float()}
            for i, t in enumerate(prompts)]
    with hermetic():
        trainer = Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), logger=False,
                          enable_progress_bar=False, enable_model_summary=False)
        [metrics] = trainer.validate(module, DataLoader(rows, batch_size=4), verbose=False)
        [out] = trainer.predict(module, DataLoader(rows[:4], batch_size=4))
        prompts = prompts[:4]
    # the split's token mean, whatever batches and microbatches hold the tokens (it was the batches' mean of their
    # microbatches' means)
    assert metrics["val_perplexity"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-5), metrics
    assert out.shape == (4, 8 + 5) and torch.equal(out[:, :8], prompts)
    assert torch.equal(out, module.generate(prompts, 5, stop_token=None))


def test_rope_table_stays_fp32_when_the_model_is_cast_to_bf16():
    """Lightning's ``bf16-true`` casts the module (``.to(torch.bfloat16)``), floating buffers included: a
    registered RotaryEmbedding's ``inv_freq`` would be rounded (angles at position 4095 off by radians).
    GPTModel keeps its rope table out of the module tree: after the cast it is still the fp32 table."""
    from lightning_megatron.transformer.rotary import RotaryEmbedding

    model = GPTModel(_llama_config(), "llama_layer_spec", VOCAB, 4096, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).to(torch.bfloat16)
    table = model.rotary_pos_emb(4096, torch.device("cpu"))
    want = RotaryEmbedding(HIDDEN // HEADS, 1.0, ROPE_BASE)(4096)
    assert table.dtype == torch.float32 and torch.equal(table, want)
    cast = torch.nn.ModuleList([RotaryEmbedding(HIDDEN // HEADS, 1.0, ROPE_BASE)]).to(torch.bfloat16)[0]
    assert (cast(4096) - want).abs().max() > 1.0, "the cast rounds inv_freq: the hazard this guards against"


@pytest.mark.parametrize("shape", [{}, LLAMA_MODULE], ids=["gpt2", "llama"])
def test_kv_cache_logits_equal_the_whole_sequence_logits(shape):
    """Decoding with the KV cache (a prompt, then two tokens at once, then one at a time) gives, at every
    position, the logits of one forward over the whole sequence: learned positions and the rope table
    taken from the cache's offset. Logits, not greedy tokens: a rope table read from position 0 moves
    the logits by ~1e-3 of their size, which rarely changes an argmax of small random weights."""
    from lightning_megatron.transformer import InferenceContext

    module = GPTLightningModule(GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                          vocab_size=VOCAB, max_sequence_length=SEQ, hidden_dropout=0.0,
                                          attention_dropout=0.0,
                                          **({"ffn_hidden_size": FFN, "rotary_base": ROPE_BASE} | shape if shape else {})))
    module.configure_model()
    model = module.model_chunks[0].eval()
    tokens = _tokens(SEQ)
    with torch.no_grad():
        whole = model(tokens)
        cache = InferenceContext(max_batch_size=BATCH, max_sequence_length=SEQ)
        pieces = []
        for start, end in [(0, 5), (5, 7)] + [(t, t + 1) for t in range(7, SEQ)]:
            pieces.append(model(tokens[:, start:end], position_offset=start, inference_context=cache))
            cache.advance(end - start)
    cached = torch.cat(pieces, dim=1)
    assert cached.shape == whole.shape == (BATCH, SEQ, module.model_chunks[0].padded_vocab_size)
    err = float((cached - whole).abs().max() / whole.abs().max())
    assert err <= 1e-5, f"cached logits differ from the whole sequence's by {err:.2e} of their largest"


@pytest.mark.parametrize("dtype,most", [("float32", 2), ("bfloat16", 3)], ids=["fp32", "bf16"])
def test_a_training_step_makes_the_logits_as_few_times_as_it_needs(dtype, most):
    """The logits are the largest tensor of a decoder's step ([s, b, V]: 4 GB in fp32 for 8k tokens of a
    128k vocabulary). A training microbatch's forward and backward allocate a logits-sized tensor only for the
    output layer's product and the loss's fp32 working copy, whose backward turns it into the gradient in place
    (bf16: and that gradient cast back to the logits' dtype). Megatron's order: the labels are transposed to
    [s, b], never the logits to [b, s] (a copy forward, another in the backward's reshape)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    vocab = 4096  # the logits 8x the largest other activation, as in a real decoder
    module = GPTLightningModule(GPTConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                          vocab_size=vocab, max_sequence_length=SEQ, hidden_dropout=0.0,
                                          attention_dropout=0.0, params_dtype=dtype, **LLAMA_MODULE))
    module.configure_model()
    ids = _tokens()
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(BATCH, SEQ)}
    logits_numel = BATCH * SEQ * vocab
    made: list[str] = []

    class LogitsSized(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if (isinstance(t, torch.Tensor) and t.numel() == logits_numel and t.size(-1) == vocab
                        and t.untyped_storage().data_ptr() not in inputs):
                    made.append(f"{func} {tuple(t.shape)} {t.dtype}")
            return out

    with LogitsSized():
        output, loss_func = module.forward_step(batch, module.model_chunks[0])
        loss_func(output)[0].backward()
    assert len(made) <= most, made
    assert any("mm" in m for m in made), made  # the counter sees the output layer's product


@pytest.mark.parametrize("positions", ["shared", "per-sample"])
def test_a_decoder_step_makes_the_rope_cos_and_sin_once_for_all_its_layers(positions):
    """Every layer rotates its queries and keys by the same cos and sin of the forward's angle table, in the
    activations' dtype: the model makes them once for all its layers (as Hugging Face Llama's
    ``position_embeddings``), and keeps those of the positions every training step shares from one step to the
    next; the backward rotates back by the same tables (no negated sin). Counted at dispatch in the second
    training step of a bf16 decoder of three layers, after a forward in inference mode: no cos, sin or neg with
    shared positions (each layer made a cos, a sin, two casts and, backward, a neg), one cos and one sin with each
    sample's own positions."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import dataclasses

    model = GPTModel(dataclasses.replace(_llama_config(), num_layers=3), "llama_layer_spec", VOCAB, SEQ,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False).to(torch.bfloat16)
    ids = _tokens()
    kwargs = {}
    if positions == "per-sample":  # two packed documents a sample, each from position 0
        kwargs["position_ids"] = torch.cat([torch.arange(5), torch.arange(SEQ - 5)]).expand(BATCH, SEQ)
    counts: dict[str, int] = {}

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    def step() -> None:
        model(ids[:, :-1], labels=ids[:, 1:], **kwargs).float().mean().backward()

    with torch.inference_mode():  # the table the model keeps is made here (a Trainer's validation, generation)
        model(ids[:, :-1], **kwargs)
    step()
    with Ops():
        step()
    made = {op: counts.get(op, 0) for op in ("cos", "sin", "neg")}
    want = {"cos": 0, "sin": 0, "neg": 0} if positions == "shared" else {"cos": 1, "sin": 1, "neg": 0}
    assert made == want, made
