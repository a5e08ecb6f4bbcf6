"""``compile=True``: each transformer layer under torch.compile (regional), and the loss at one TP rank, equal eager
within fp32 tolerance."""

from __future__ import annotations

import pytest
import torch

from lightning_megatron.models.bert import BertConfig
from lightning_megatron.models.bert.module import BertLightningModule
from lightning_megatron.tensor_parallel import model_parallel_seed
from lightning_megatron.tensor_parallel.backward import WeightGradPolicy
from megatron_testing import TINY_CONFIG, TINY_OPTIONS, SyntheticBertDataset

pytestmark = pytest.mark.filterwarnings("ignore")


def _unused(*args):
    raise AssertionError("no gradient is deferred or routed in this model")


def _loss_and_grads(compile: bool, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    torch._dynamo.reset()
    model_parallel_seed(1234, 0)
    module = BertLightningModule(BertConfig(**{**TINY_CONFIG, "num_layers": 2}), **TINY_OPTIONS, compile=compile)
    module.configure_model()
    chunk = module.model_chunks[0]
    # As in the strategy's training step: the layers ask the step's weight-gradient policy for their GEMMs
    # (the policy must not tie a compiled graph to one layer object: one graph serves every layer, no
    # recompilation per layer, which 24 layers would take past torch's recompile limit into eager).
    policy = WeightGradPolicy.for_chunks([chunk])
    with torch._dynamo.config.patch(error_on_recompile=True), policy.step(_unused, _unused):
        loss, _ = module.forward_step(batch, chunk)
        loss.backward()
    layers = [m for m in chunk.modules() if type(m).__name__ == "TransformerLayer"]
    compiled = sum(1 for m in layers if getattr(m, "_compiled_call_impl", None) is not None)
    compiled += chunk._compiled_loss is not None  # the loss too, at one TP rank
    return loss.detach(), {n: p.grad.clone() for n, p in chunk.named_parameters()}, compiled


def test_compiled_layers_equal_eager():
    import torch._inductor.config as inductor_config

    data = SyntheticBertDataset(4)
    batch = {k: torch.stack([data[i][k] for i in range(4)]).to(torch.get_default_device()) for k in data[0]}
    eager_loss, eager_grads, none = _loss_and_grads(False, batch)
    # No pool of compile workers on 2 cores. The config's own patch: pytest's monkeypatch deletes a config
    # entry when it undoes (the next compile in the process then fails on the missing entry).
    with inductor_config.patch(compile_threads=1):
        loss, grads, compiled = _loss_and_grads(True, batch)
    assert none == 0 and compiled == 3, "every transformer layer and the loss are compiled, nothing else"
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, g in eager_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kernels", ["default", "cpu"])
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_a_layer_with_attention_dropout_compiles_into_one_graph_at_tp1(backend, kernels):
    """With one TP rank a compiled layer keeps its attention dropout in the default stream: the model-parallel
    stream's fork swaps the generators' states, which dynamo cannot trace (on an H200 each BERT layer broke into
    4 graphs there, and ``compile=True`` ran slower than eager). Eager still forks (the same bits as before): the
    tracker's stream advances. The CPU tuning's dropout draws its words through one opaque op when compiled
    (dynamo does not trace ``random_``: a BERT layer broke into 19 graphs, one at every dropout)."""
    from lightning_megatron.tensor_parallel.random import MODEL_PARALLEL_RNG_TRACKER_NAME, get_rng_tracker

    model_parallel_seed(1234, 0)
    config = {**TINY_CONFIG, "num_layers": 1, "hidden_dropout": 0.1, "attention_dropout": 0.1,
              "attention_backend": backend}
    module = BertLightningModule(BertConfig(**config), **TINY_OPTIONS)
    module.configure_model()
    if kernels == "cpu":
        from lightning_megatron.cpu.kernels import CPUKernels
        from lightning_megatron.transformer.kernels import set_kernels

        set_kernels(module.model_chunks[0], CPUKernels())
    layer = next(m for m in module.model_chunks[0].modules() if type(m).__name__ == "TransformerLayer")
    x = torch.randn(16, 2, TINY_CONFIG["hidden_size"])
    hidden = torch.zeros(2, 1, 16, 16, dtype=torch.bool)
    hidden[1, ..., 12:] = True  # padding
    stream = get_rng_tracker().states[MODEL_PARALLEL_RNG_TRACKER_NAME][0].clone()
    layer(x, hidden)
    assert not torch.equal(get_rng_tracker().states[MODEL_PARALLEL_RNG_TRACKER_NAME][0], stream), "eager forks"
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x, hidden)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]


def test_attention_with_tp_ranks_keeps_its_dropout_stream_when_compiled():
    """A TP size above 1, by the config even without a group (an attention built on its own), keeps the fork
    under compilation: each rank's heads must not be dropped in lock-step with another rank's."""
    from lightning_megatron.transformer import TransformerConfig
    from lightning_megatron.transformer.attention import DotProductAttention
    from lightning_megatron.transformer.utils import AttnMaskType

    model_parallel_seed(1234, 0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.1,
                               tensor_model_parallel_size=2)
    core = DotProductAttention(config, 1, AttnMaskType.padding)
    from lightning_megatron.tensor_parallel.random import MODEL_PARALLEL_RNG_TRACKER_NAME, get_rng_tracker

    q, k, v = (torch.randn(16, 2, 2, 8) for _ in range(3))  # this rank's 2 of the 4 heads
    stream = get_rng_tracker().states[MODEL_PARALLEL_RNG_TRACKER_NAME][0].clone()
    torch._dynamo.reset()
    torch.compile(core, backend="eager")(q, k, v, torch.zeros(2, 1, 1, 16, dtype=torch.bool))
    assert not torch.equal(get_rng_tracker().states[MODEL_PARALLEL_RNG_TRACKER_NAME][0], stream), \
        "the dropout ran in the model-parallel stream"


def test_a_gated_mlp_compiles_into_one_graph_with_eagers_gradients():
    """The gated activation's backward writes its two halves into one tensor through ``out=`` views in eager,
    which dynamo cannot trace (a graph break before and after: three graphs); compiled, it concatenates them:
    one graph, and under ``aot_eager`` (the joint graph without inductor's fusion) the bits of eager."""
    from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from lightning_megatron.transformer import MLP, MLPSubmodules, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                               gated_linear_unit=True, activation="silu", add_bias_linear=False)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    x = torch.randn(8, 2, 32, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(mlp)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]
    g = torch.randn(8, 2, 32)
    torch._dynamo.reset()
    y, _ = torch.compile(mlp, backend="aot_eager")(x)
    y.backward(g)
    compiled = (y.detach(), x.grad.clone(), *(p.grad.clone() for p in mlp.parameters()))
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    y, _ = mlp(x)
    y.backward(g)
    for got, want in zip(compiled, (y.detach(), x.grad, *(p.grad for p in mlp.parameters()))):
        assert torch.equal(got, want)


def test_the_cpu_dropout_compiled_draws_the_numbers_of_eager():
    """Compiled, the CPU tuning's dropout takes its words from the same generator in the same order: the same
    mask, output and gradient as eager under the same seed."""
    import torch._inductor.config as inductor_config

    from lightning_megatron.cpu.dropout import cpu_dropout

    x = torch.randn(64, 3, 8, device="cpu")
    results = []
    torch._dynamo.reset()
    with inductor_config.patch(compile_threads=1):
        for f in (cpu_dropout, torch.compile(cpu_dropout)):
            torch.manual_seed(7)
            z = x.clone().requires_grad_()
            y = f(z, 0.3)
            y.backward(torch.ones_like(y))
            results.append((y, z.grad))
    (y, g), (yc, gc) = results
    assert torch.equal(y, yc) and torch.equal(g, gc)
    assert 0 < (y == 0).float().mean() < 0.6, "it drops"


def test_compile_with_selective_recomputation_and_attention_dropout_is_refused_for_training():
    """The compiled layer's recomputed attention drew other dropout masks than its forward (a GPT-2-shaped
    model at TP=1: loss equal, grad norm 1.575614 against 1.575977, the worst gradient 0.45 off; eager and full
    recomputation exact): refused for a training run (the rule), not for evaluating or predicting (no backward);
    without dropout, with full recomputation or eager, not refused."""
    from types import SimpleNamespace

    from lightning_megatron.language.module import compile_problem

    def config(dropout, **recompute):
        return SimpleNamespace(attention_dropout=dropout, **recompute)

    assert compile_problem(config(0.1, recompute_granularity="selective"), True) == (
        "compile=True with recompute_granularity='selective' and attention_dropout=0.1: the compiled layer recomputes "
        "attention with other dropout masks than its forward's (its gradients would not be the loss's); use "
        "recompute_granularity='full', attention_dropout=0, or compile=False")
    for dropout, granularity, compiled in ((0.0, "selective", True), (0.1, "full", True), (0.1, "selective", False)):
        assert compile_problem(config(dropout, recompute_granularity=granularity), compiled) is None


@pytest.mark.parametrize("command", ["fit", "predict"])
def test_a_training_run_of_a_compiled_model_with_selective_recomputation_and_dropout_is_refused_at_set_up(command):
    """The Python API's way (no recipe for the pre-launch check): the chunks are not built for a fit; for a
    prediction (no backward, nothing recomputed) they are, compiled."""
    from types import SimpleNamespace

    module = BertLightningModule(BertConfig(**{**TINY_CONFIG, "num_layers": 1, "attention_dropout": 0.1,
                                               "recompute_granularity": "selective"}), **TINY_OPTIONS, compile=True)
    module._trainer = SimpleNamespace(state=SimpleNamespace(fn=command))  # what the Trainer's state says at set-up
    if command == "fit":
        with pytest.raises(ValueError, match=r"compile=True with recompute_granularity='selective'"):
            module.configure_model()
    else:
        module.configure_model()
        assert module.model_chunks is not None
