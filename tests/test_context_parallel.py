"""Context parallelism's split (megatron-core's load-balanced order) and a rank's attention, against one
process's causal, document-masked attention; the layouts themselves (CP=2 alone and with TP + SP, interleaved
PP and ZeRO-1, by all-gather and by all-to-all) equal one process in ``tests/test_gpt_parallel.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_megatron.transformer.attention import DotProductAttention, document_attention_mask
from lightning_megatron.transformer.config import TransformerConfig
from lightning_megatron.transformer.context_parallel import context_parallel_indices, split_batch
from lightning_megatron.transformer.utils import AttnMaskType


def test_each_rank_keeps_an_early_and_a_late_chunk():
    assert context_parallel_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context_parallel_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    ranks = [context_parallel_indices(24, 4, r) for r in range(4)]
    assert sorted(torch.cat(ranks).tolist()) == list(range(24))  # every token once
    assert len({int(r.sum()) for r in ranks}) == 1  # as much causal work on every rank
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by 2 x context_parallel_size = 4"
                                         r".*choose a seq_length that is a multiple of 4 \(e.g. 8 or 12\)$"):
        context_parallel_indices(10, 2, 0)  # the advice ended at "that is"


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_a_rank_s_batch_and_attention_are_the_one_process_ones_at_its_tokens(monkeypatch, cp_rank):
    """A rank of 2 on a packed batch: every [b, s] tensor sliced at its tokens, the real positions kept; its
    all-gather attention (the exchange given here: the keys and values of the whole sequence in rank order)
    is one process's causal, document-masked attention at its tokens."""
    import lightning_megatron.transformer.context_parallel as cp

    monkeypatch.setattr(cp, "group_size", lambda group: 2)  # the split's arithmetic only
    s = 8
    tokens = torch.arange(2 * s).view(2, s)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, s), "document_ids": documents,
             "sample_index": torch.tensor([3, 4])}
    local, context = split_batch(batch, group=object(), cp_rank=cp_rank)
    mine = [[0, 1, 6, 7], [2, 3, 4, 5]][cp_rank]
    gathered = [0, 1, 6, 7, 2, 3, 4, 5]
    assert local["tokens"].tolist() == tokens[:, mine].tolist() and local["labels"].tolist() == (tokens + 1)[:, mine].tolist()
    assert local["position_ids"].tolist() == [mine, mine] and "document_ids" not in local
    assert local["sample_index"].tolist() == [3, 4]  # not along the sequence: as it is
    assert (context.chunks, context.chunk, context.gathered.tolist()) == ((cp_rank, 3 - cp_rank), 2, gathered)

    torch.manual_seed(0)
    q, k, v = torch.randn(s, 2, 4, 8), torch.randn(s, 2, 2, 8), torch.randn(s, 2, 2, 8)
    core = DotProductAttention(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                                 num_query_groups=2), 1, AttnMaskType.causal).eval()
    whole = core(q, k, v, document_attention_mask(documents))  # one process: causal within documents
    k_mine, v_mine = k[mine], v[mine]
    full = {id(k_mine): k[gathered], id(v_mine): v[gathered]}
    monkeypatch.setattr(context, "gather", lambda t: full[id(t)])
    got = context.attention(core, q[mine], k_mine, v_mine, "all_gather")
    assert torch.allclose(got, whole[mine], atol=1e-6)
    no_documents = split_batch({"tokens": tokens}, group=object(), cp_rank=cp_rank)[1]
    monkeypatch.setattr(no_documents, "gather", lambda t: full[id(t)])
    assert torch.allclose(no_documents.attention(core, q[mine], k_mine, v_mine, "all_gather"),
                          core(q, k, v, None)[mine], atol=1e-6)


def test_what_a_cp_rank_keeps_is_predicted_for_each_way_of_communicating(tmp_path):
    """``check --estimate-memory`` on ``recipes/gpt_tiny.yaml`` with 5 layers, 3 of them on the first of two pipeline
    stages (one step, through the CLI), at CP=2 by all-to-all (the all-gather's is ``tests/test_moe_cli.py``'s cp2),
    CP=2 x PP=2 and TP=2 x PP=2 with SP, a row for each stage: the parameters, gradients and optimizer state exactly,
    the activations a rank saved for the backward within 1% of the estimate. It counts the attention's output
    beside the projection's context and, for all-to-all, no other rank's keys and values (it counted the
    all-gather's for every kind: 6% over), the last stage's final norm in SP's chunks (it counted them whole: 2%
    over), and each stage's own layers (it took an even split: stage 0 under by a layer). The first stage under SP
    keeps its own chunk of the embedding's output (it kept a view of the whole: 2% over the estimate). The one-
    stage layouts (the reference, cp2) run without the stage sizes. The measured column is the stage's ranks: with
    CP the table took another stage's (cp2pp2: stage 0's parameters, 26.04 predicted against 19.16 MiB).

    With ``--estimate-time`` (and 2 key/value groups) the bytes each rank sends, by part, are the time model's within
    0.5%: the all-to-all of queries, keys, values and contexts (the model timed every kind as the all-gather's: cp4
    12 predicted against 6 MiB sent), the pipeline's sends of each stage's own chunks (both directions counted for
    every stage: pp2 6 against 5 MiB), under SP the ends' collectives (the output layer's and the loss's were
    missing: tp2sp 21 against 23.04)."""
    import os

    from check_tables import assert_traffic
    from dist_utils import run_python

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    recipe = os.path.join(root, "recipes", "gpt_tiny.yaml")
    run = run_python(["-m", "lightning_megatron.cli", "check", "--config", recipe, "--layouts", "cp2,cp2pp2,tp2pp2sp",
                      "--steps", "1", "--estimate-memory", "--estimate-time", "--model.config.cp_comm_type", "a2a",
                      "--model.config.num_query_groups", "2",
                      "--model.config.num_layers", "5", "--model.config.num_layers_in_first_pipeline_stage", "3"],
                     str(tmp_path), dict(os.environ), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = run.stdout.split("memory per rank")[1].split("predicted step time")[0]
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert [(r[0], r[1]) for r in rows] == [("tp1", "0"), ("cp2", "0"), ("cp2pp2", "0"), ("cp2pp2", "1"),
                                            ("tp2pp2sp", "0"), ("tp2pp2sp", "1")], table
    for row in rows:
        (params, params_held), (grads, grads_held), (opt, opt_held), (predicted, measured) = (
            (float(x) for x in cell.split("/")) for cell in row[2:6])
        assert (params, grads, opt) == (params_held, grads_held, opt_held), table
        assert abs(predicted / measured - 1) < 0.01, table
    assert_traffic(run.stdout, [("cp2", 0), ("cp2pp2", 0), ("cp2pp2", 1), ("tp2pp2sp", 0), ("tp2pp2sp", 1)])


def test_the_ring_multiplies_in_a_16_bit_models_dtype_and_is_as_near_exact_attention(tmp_path):
    """Ring attention (``cp_comm_type="p2p"``) on one rank, bf16 with grouped-query heads: every matrix product of its
    forward and backward takes bf16 operands (they were fp32: a GPU's fp32 rate, not its 16-bit one), and its output
    and gradients are within bf16's reach of fp64 causal attention on the same bf16 inputs."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_megatron.transformer.ring_attention import ring_attention

    gen = torch.Generator().manual_seed(0)
    s, b, n, g, d = 32, 2, 4, 2, 16
    q, k, v = (torch.randn(s, b, heads, d, generator=gen).to(torch.bfloat16).requires_grad_()
               for heads in (n, g, g))
    grad = torch.randn(s, b, n * d, generator=gen).to(torch.bfloat16)
    products = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "bmm", "addmm", "baddbmm", "matmul"):
                products.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    import torch.distributed as dist

    mine = not dist.is_initialized()  # a ring of one rank: its all-to-all of the key and value gradients, to itself
    if mine:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with Products():
            out = ring_attention(q, k, v, dist.new_group([0]), d ** -0.5)
            out.backward(grad)
    finally:
        if mine:
            dist.destroy_process_group()
    assert products and all(set(dtypes) == {torch.bfloat16} for dtypes in products), products
    # exact: fp64 causal attention of the same bf16 numbers ([b, heads, s, d], the key/value heads repeated)
    qd, kd, vd = (t.detach().double().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qd, kd.repeat_interleave(n // g, 1), vd.repeat_interleave(n // g, 1),
                                         is_causal=True, scale=d ** -0.5)
    ref.permute(2, 0, 1, 3).reshape(s, b, n * d).backward(grad.double())
    out, ref = out.detach(), ref.detach().permute(2, 0, 1, 3).reshape(s, b, n * d)
    for got, want in ((out, ref), (q.grad, qd.grad.permute(2, 0, 1, 3)), (k.grad, kd.grad.permute(2, 0, 1, 3)),
                      (v.grad, vd.grad.permute(2, 0, 1, 3))):
        err = float((got.double() - want).abs().max() / want.abs().max())  # one-rounding noise is ~4e-3
        assert err < 2e-2, err


def test_a_rope_decoder_continues_at_a_longer_context_on_cp2_from_the_checkpoint_the_cli_wrote(tmp_path):
    """The long-context stage as a user runs it: ``recipes/gpt_tiny.yaml`` as a rope decoder pretrained at 32
    positions (TP=2), then ``fit --ckpt_path last`` at 64 positions on CP=2, its optimizer and schedule state kept.
    Rope's positions have no weights, so the longer ``max_sequence_length`` is said (a hyper-parameter that may
    differ), not refused: the resume refused it as a checkpoint that "does not fit this model", and ``init_from``
    as an architecture the source fixes, leaving no way to lengthen a rope model's context. The learned positions
    of GPT-2 stay refused (a tensor's shape: ``tests/test_checkpoint_format.py``)."""
    import os

    from dist_utils import run_python

    from lightning_megatron.data_checks import checkpoint_extra

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    small = ["-m", "lightning_megatron.cli", "fit", "--config", os.path.join(root, "recipes", "gpt_tiny.yaml"),
             "--model.config.spec", "llama_layer_spec", "--model.config.position_embedding_type", "rope",
             "--model.config.num_layers", "1", "--model.config.hidden_size", "32", "--model.config.num_attention_heads",
             "2", "--model.config.ffn_hidden_size", "64", "--data.global_batch_size", "4", "--data.micro_batch_size",
             "2", "--data.eval_samples", "4", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2",
             "--trainer.default_root_dir", str(tmp_path / "run"), "--lr_schedule.lr_warmup_steps", "1",
             "--lr_schedule.lr_decay_steps", "4"]
    env = dict(os.environ, WANDB_MODE="offline")
    short = run_python([*small, "--trainer.max_steps", "2", "--data.seq_length", "32",
                        "--model.config.max_sequence_length", "32"], str(tmp_path), env, timeout=600)
    assert short.returncode == 0, short.stdout[-3000:] + short.stderr[-3000:]
    longer = run_python([*small, "--trainer.max_steps", "3", "--data.seq_length", "64",
                         "--model.config.max_sequence_length", "64", "--trainer.strategy.tensor_model_parallel_size",
                         "1", "--trainer.strategy.context_parallel_size", "2", "--ckpt_path", "last"], str(tmp_path),
                        env, timeout=600)
    assert longer.returncode == 0, longer.stdout[-3000:] + longer.stderr[-3000:]
    said = [line for line in longer.stderr.splitlines() if "hyper-parameters differ (allowed)" in line]
    assert len(said) == 1 and "config.max_sequence_length: checkpoint 32, model 64" in said[0], longer.stderr[-3000:]
    assert "Step 3/3" in longer.stdout, longer.stdout[-3000:]
    extra = checkpoint_extra(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert extra["global_step"] == 3 and extra["hyper_parameters"]["config"]["max_sequence_length"] == 64
