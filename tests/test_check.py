"""``check_layouts`` catches a broken tensor-parallel layer and names it (the first module whose forward
output diverges) and its parameter; the same custom
spec, unbroken, passes. The spec is registered here, as a user would register theirs."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from megatron_testing import MASKED_PER_SAMPLE, SEQ, TINY_CONFIG, TINY_MODEL, SyntheticBertDataset

from lightning_megatron.models.bert.specs import bert_layer_spec
from lightning_megatron.tensor_parallel import RowParallelLinear
from lightning_megatron.transformer import LayerNorm, ModuleSpec, get_spec, list_specs, register_spec
from lightning_megatron.parallel_dims import ParallelDims


class IntactRowParallelLinear(RowParallelLinear):
    """A user's own row-parallel layer: the library's, unchanged."""


class ForgetfulRowParallelLinear(RowParallelLinear):
    """The bug users write: the partial products of the TP ranks are never all-reduced."""

    def forward(self, input_: torch.Tensor):
        output = torch.nn.functional.linear(input_, self.weight)  # input is already TP-parallel
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None


def _spec_with_fc2(fc2: type) -> ModuleSpec:
    layer = bert_layer_spec(LayerNorm, "pre")
    mlp = layer.submodules.mlp
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc2=fc2))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


for _name, _fc2 in (("check_test_intact_fc2", IntactRowParallelLinear),
                    ("check_test_forgetful_fc2", ForgetfulRowParallelLinear)):
    if _name not in list_specs():  # registered once per process (spawned ranks import this module too)
        register_spec(_name, _spec_with_fc2(_fc2))


def make_module(spec: str):
    from lightning_megatron.models.bert.module import BertLightningModule

    return BertLightningModule(**{**TINY_MODEL, "config": {**TINY_CONFIG, "spec": spec}})


def _check(spec: str, layouts=("tp2",), **kwargs):
    from lightning_megatron.check import check_layouts

    return check_layouts(functools.partial(make_module, spec), functools.partial(SyntheticBertDataset, 64),
                         layouts=list(layouts), global_batch_size=8, micro_batch_size=4, steps=2, timeout=600,
                         **kwargs)


def test_check_names_the_layer_that_forgets_its_all_reduce():
    assert get_spec("check_test_forgetful_fc2").submodules.mlp.submodules.linear_fc2 is ForgetfulRowParallelLinear
    # tp2sp: the strategy hands sequence_parallel to the module with its ParallelState, so its layers
    # keep activations split along the sequence: fewer saved bytes than tp2's.
    intact = _check("check_test_intact_fc2", layouts=("tp2", "tp2sp"), measure_memory=True)
    print(intact.table())
    assert intact.passed, intact.table()
    sp, tp = (intact.runs[n].memory[0]["activations_peak"] for n in ("tp2sp", "tp2"))
    assert sp < 0.95 * tp, (sp, tp)
    _assert_memory_predicted(intact)
    # At TP=1 the forgetful layer is the intact one (nothing to reduce): the same reference.
    broken = _check("check_test_forgetful_fc2", reference_run=intact.reference)
    print(broken.table())
    assert not broken.passed
    [result] = broken.results
    assert result.worst_param is not None and "mlp.linear_fc2" in result.worst_param, broken.table()
    assert any("linear_fc2" in f for f in result.failures), result.failures
    # Named by the first module whose step-1 forward output departs from one process (the layer
    # itself, not the parameter with the largest gradient error downstream); none in the intact run.
    assert result.first_divergence.startswith("forward output of encoder.layers.0.mlp.linear_fc2 "), broken.table()
    assert "FAIL: first divergence: forward output of encoder.layers.0.mlp.linear_fc2" in broken.table()
    assert [r.first_divergence for r in intact.results] == [None, None], intact.table()
    assert "FAIL" in broken.table().splitlines()[-1]


def _assert_memory_predicted(report) -> None:
    """The closed-form bytes (docs/memory.md) against what the run held: parameters, gradients and
    optimizer state exactly; the peak of the tensors saved for backward within 10%."""
    from lightning_megatron.cost import estimate_stage
    from lightning_megatron.models.bert.cost import BertCost

    shape = BertCost(num_layers=TINY_CONFIG["num_layers"], hidden_size=TINY_CONFIG["hidden_size"],
                     num_attention_heads=TINY_CONFIG["num_attention_heads"],
                     ffn_hidden_size=TINY_CONFIG["ffn_hidden_size"], vocab_size=TINY_CONFIG["vocab_size"],
                     max_sequence_length=TINY_CONFIG["max_sequence_length"], seq_length=SEQ, micro_batch_size=4,
                     global_batch_size=8, masked_lm_prob=MASKED_PER_SAMPLE / SEQ)
    for name, run in report.runs.items():
        layout = ParallelDims.parse(name)
        for rank, measured in enumerate(run.memory):
            est = estimate_stage(shape, layout, rank // (layout.tp * layout.dp))
            assert (measured["params"], measured["grads"], measured["optimizer"]) == \
                (est.param_bytes, est.grad_bytes, est.optimizer_bytes), (name, rank, measured, est)
            assert abs(est.activation_bytes / measured["activations_peak"] - 1) < 0.10, (name, rank, measured, est)


def test_memory_formula_scales_with_the_layout():
    """Pure arithmetic: sharding divides what it should, and the fit listing runs nothing."""
    from lightning_megatron.cost import candidate_layouts, estimate_memory
    from lightning_megatron.models.bert.cost import BertCost

    m = BertCost(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=512, micro_batch_size=4,
                 global_batch_size=256, params_dtype="bfloat16")
    one = estimate_memory(m, ParallelDims(dp=1))
    assert 330e6 < one.params < 340e6  # BERT-large
    assert one.param_bytes == 2 * one.params and one.grad_bytes == 4 * one.params
    assert one.optimizer_bytes == 12 * one.params  # fp32 main params + Adam's two moments
    zero = estimate_memory(m, ParallelDims(dp=8, zero1=True))
    assert zero.optimizer_bytes == 12 * -(-one.params // 8)
    tp = estimate_memory(m, ParallelDims(tp=4, dp=1))
    assert tp.params < one.params / 3.5
    sp = estimate_memory(m, ParallelDims(tp=4, sequence_parallel=True, dp=1))
    assert sp.activation_bytes < tp.activation_bytes
    rc = estimate_memory(dataclasses.replace(m, recompute=True), ParallelDims(dp=1))
    assert rc.activation_bytes < one.activation_bytes / 5
    layouts = candidate_layouts(m, 64)
    assert ParallelDims(tp=8, pp=8, dp=1) in layouts and all(x.world_size == 64 for x in layouts)


def test_cli_lists_layouts_that_fit(capsys, tmp_path):
    from lightning_megatron.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  config:\n    num_layers: 4\n    hidden_size: 256\n    num_attention_heads: 4\n"
                      "data:\n  global_batch_size: 16\n  micro_batch_size: 4\n  max_seq_length: 128\n")
    with pytest.raises(SystemExit) as e:
        main(["check", "--config", str(recipe), "--estimate-memory", "--gpus", "4", "--gpu-memory", "1GB",
              "--model.config.hidden_size", "512"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert "hidden 512" in out and "tp2pp2" in out and " yes" in out
    # fit's spelling of a class_path section's argument (--data.init_args.NAME) is check's too
    with pytest.raises(SystemExit) as e:
        main(["check", "--config", str(recipe), "--estimate-memory", "--gpus", "4", "--gpu-memory", "1GB",
              "--model.init_args.config.hidden_size", "512", "--data.init_args.micro_batch_size=2"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "hidden 512" in out and "micro batch 2," in out, out
    with pytest.raises(SystemExit) as e:  # an argument the data module does not have: a usage error, no traceback
        main(["check", "--config", str(recipe), "--estimate-memory", "--data.micro_batch", "2"])
    assert e.value.code == 2
    assert "--data.micro_batch is not an argument of BertDataModule; its arguments: " in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["check", "--config", str(recipe), "--estimate-memory", "--gpus", "4", "--gpu-memory", "1MB"])
    assert e.value.code == 1 and "0 of" in capsys.readouterr().out
    # the flat spelling of before: refused, naming the new one
    with pytest.raises(SystemExit) as e:
        main(["check", "--config", str(recipe), "--estimate-memory", "--model.hidden_size", "512"])
    assert e.value.code == 2
    assert "--model.hidden_size is now --model.config.hidden_size" in capsys.readouterr().err


def test_a_berts_compiled_loss_is_estimated_keeping_the_masked_tokens_logits(capsys, tmp_path):
    """``model.compile: true`` on a recipe with ``base: bert_base.yaml`` (bf16): at one TP rank the compiled loss
    keeps the masked tokens' 16-bit logits where the eager one keeps their fp32 softmax, so ``check
    --estimate-memory`` puts 2 bytes a logit less on the last stage (0.15 x 512 x 16 masked tokens x 30,592
    columns: 0.07 GiB); with two TP ranks the vocab-parallel function stays, and so does its estimate."""
    from pathlib import Path

    from lightning_megatron.check.cli import main

    base = Path(__file__).resolve().parents[1] / "recipes" / "bert_base.yaml"
    compiled = tmp_path / "bert_base_compiled.yaml"
    compiled.write_text(f"base: {base}\nmodel:\n  compile: true\n")

    def fullest(recipe: Path, layout: str) -> float:
        assert main(["--config", str(recipe), "--estimate-memory", "--gpus", "8", "--gpu-memory", "80GB"]) == 0
        [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{layout} ")]
        return float(row.split()[5])  # the GiB column: params, grads, optimizer and activations

    logits = 0.15 * 512 * 16 * 30592 / 2**30
    assert abs(fullest(base, "dp8") - fullest(compiled, "dp8") - 2 * logits) < 0.011
    assert fullest(base, "tp2dp4") == fullest(compiled, "tp2dp4")


def test_a_16_bit_recipes_layouts_are_checked_in_fp32_with_fp32s_bounds(capsys, tmp_path):
    """``check --fp32`` on a bf16 recipe (``base: bert_tiny.yaml`` made bf16-true): the model with fp32 parameters
    and the Trainer at 32-true, held to the fp32 bounds; without it the recipe's bf16 is checked at the 16-bit
    bounds, and passes: torch's CPU layer norm and embedding backward summed their weight gradients in bf16, which
    put one process (two threads) 20% from a layout of two (one thread each) on a layer norm's bias (docs/check.md,
    "bf16 on CPU"); summed in fp32 (``tests/test_wide_sums.py``), DP=2 is the one process's bits."""
    from pathlib import Path

    from check_tables import assert_traffic

    from lightning_megatron.check.cli import main

    base = Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml"
    recipe = tmp_path / "bert_tiny_bf16.yaml"
    recipe.write_text(f"base: {base}\ntrainer:\n  precision: bf16-true\nmodel:\n  config:\n    params_dtype: bfloat16\n"
                      f"megatron_optimizer:\n  use_distributed_optimizer: true\n")  # ZeRO-1 where a layout says zero1
    args = ["--config", str(recipe), "--layouts", "tp2,pp2", "--steps", "1", "--global-batch-size", "8",
            "--micro-batch-size", "4", "--data.max_seq_length", "64"]
    assert main(["--config", str(recipe), "--layouts", "tp2,pp2,dp2", "--steps", "1", "--global-batch-size", "4",
                 "--micro-batch-size", "2", "--data.max_seq_length", "64"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "tolerances: loss 0.01 rel, grad norm 0.02 rel, grads 0.05" in out and out.rstrip().endswith("PASS"), out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[1:2] == ["1"]}
    # loss and gradients: the same bits; the norm's sum of squares over the recipe's shared-memory collectives
    # (cpu_tuning, on in bert_tiny) in another order
    assert rows["dp2"][3] == rows["dp2"][6] == "0.00e+00" and float(rows["dp2"][5]) < 1e-12, out
    # TP=2's pooler bias (a sum over 4 samples whose terms cancel) 12.5% from one bf16 process's, as far from the
    # fp32 truth as it (19.3%): judged against the truth, it passes, and says so (the worst of the table is the
    # pooler's bias on the Intel AMX host, its weight, 7.6%, on the AMD Zen 4 host: their bf16 kernels differ)
    assert float(rows["tp2"][6]) > 0.05 and rows["tp2"][7] in ("pooler.dense.bias", "pooler.dense.weight"), out
    assert "16-bit gradients beyond the bounds: judged against the fp32 truth, tp1 in fp32 from the same" in out, out
    assert "tp2            PASS\n               step 1: against the fp32 truth pooler.dense.bias is " in out, out
    # fp16 under ZeRO-1: the recorder divided the loss scale out before it put the reduce-scattered pieces together,
    # and so recorded the rest of each rank's buffer unreduced (grad norm 5% off, pooler.dense.bias 190%)
    fp16 = tmp_path / "bert_tiny_fp16.yaml"
    fp16.write_text(f"base: {base}\ntrainer:\n  precision: 16-true\nmodel:\n  config:\n    params_dtype: float16\n"
                    f"megatron_optimizer:\n  initial_loss_scale: 1024\n")
    assert main(["--config", str(fp16), "--layouts", "dp2zero1", "--steps", "1", "--global-batch-size", "4",
                 "--micro-batch-size", "2", "--data.max_seq_length", "64"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    [row] = [line.split() for line in out.splitlines() if line.split()[:2] == ["dp2zero1", "1"]]
    assert float(row[5]) < 1e-5 and float(row[6]) < 1e-3, out  # the grad norm's and gradients' differences
    assert main(args + ["--fp32", "--estimate-memory", "--estimate-time"]) == 0
    out = capsys.readouterr().out
    assert "in fp32 (--fp32: config.params_dtype float32, precision 32-true)" in out, out
    assert "tolerances: loss 1e-05 rel, grad norm 1e-05 rel, grads 0.0001" in out and "tp2            PASS" in out, out
    # What a rank sends: TP's from the most masked tokens a microbatch had (within 2%), the pipeline's sends and the
    # tied embedding's gradient exactly
    assert_traffic(out, [("tp2", 0), ("pp2", 0), ("pp2", 1)], tp=0.02)
    # The memory table predicts the LM head with the most masked tokens a microbatch of the step had (the built-in
    # corpus's short samples have fewer than 0.15 s b: the last stage was 10-16% over), every stage within 2%
    out = out.split("predicted step time")[0]
    rows = [line.split() for line in out.split("memory per rank")[1].splitlines()[2:] if line.strip()]
    assert [(r[0], r[1]) for r in rows] == [("tp1", "0"), ("tp2", "0"), ("pp2", "0"), ("pp2", "1")], out
    for row in rows:
        predicted, measured = (float(x) for x in row[5].split("/"))
        assert abs(predicted / measured - 1) < 0.02, out
    # and with the LM head on every token (lm_head_on_masked_only: false; the estimate put it on 0.15 s b tokens
    # still: 34.88 predicted against 138.15 MiB at the recipe's sizes); the layout named is the one run: dp2 without
    # the ZeRO-1 the recipe trains with (its optimizer state was sharded, half the bytes predicted for dp2)
    assert main([*args[:3], "tp2,dp2", *args[4:], "--fp32", "--estimate-memory", "--model.lm_head_on_masked_only",
                 "false"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.split("memory per rank")[1].splitlines()[2:] if line.strip()]
    assert [r[0] for r in rows] == ["tp1", "tp2", "dp2"], out
    for row in rows:  # params, grads, optimizer state, activations
        for cell in row[2:6]:
            predicted, measured = (float(x) for x in cell.split("/"))
            assert abs(predicted / measured - 1) < 0.02, out
    with pytest.raises(SystemExit) as refused:  # a recipe already in fp32: nothing to switch, said so
        main(["--config", str(base), "--layouts", "tp2", "--fp32"])
    assert refused.value.code == 2 and "already trains in fp32" in capsys.readouterr().err


def test_what_each_rank_sends_is_what_the_time_model_times(capsys):
    """``check --estimate-memory --estimate-time`` counts the bytes each rank sends in a step, by part (every
    collective of the parallel state's groups, the all-to-alls and sends the library issues itself), beside what
    the time model's collectives and sends move: ``recipes/gpt_tiny.yaml`` with rotary positions and ring attention
    at TP=2 with SP and at CP=2, within 0.5%. The ring passes keys and values around and sends their fp32
    gradients to their owners (the model timed it as the all-gather's: 8 MiB predicted against 12 sent); with
    no learned positions the word embedding reduce-scatters into SP's chunks (it all-reduced, then scattered: 0.5
    MiB more at TP=2); the output layer and the loss send under TP (not counted before: at TP=2 without SP 17 MiB
    predicted against 18.02 sent)."""
    from pathlib import Path

    from check_tables import assert_traffic, traffic_rows

    from lightning_megatron.check.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "gpt_tiny.yaml"
    assert main(["--config", str(recipe), "--layouts", "tp2sp,cp2", "--steps", "1", "--estimate-memory",
                 "--estimate-time", "--model.config.position_embedding_type", "rope",
                 "--model.config.cp_comm_type", "p2p"]) == 0
    out = capsys.readouterr().out
    assert_traffic(out, [("tp2sp", 0), ("cp2", 0)])
    rows = traffic_rows(out)
    # By hand, 2 microbatches of 8 x 128 tokens, hidden 128 in fp32 (x = 0.5 MiB), 4 layers. TP=2 with SP, a rank's
    # half of an all-gather or reduce-scatter of x: 0.25 MiB; a layer 10 (a column and a row layer's gather and
    # reduce-scatter each way, twice, and the qkv and fc1 inputs gathered again); the embedding 2 (reduce-scatter,
    # its gradient gathered); the output layer 3 (gathered twice, its input gradient reduce-scattered); the loss
    # 3 all-reduces of 4 bytes a token (12 KiB); once a step the norms' and biases' gradients (3328 fp32, 13 KiB).
    assert rows[("tp2sp", 0)]["tp"][1] == pytest.approx(2 * ((4 * 10 + 2 + 3) * 0.25 + 12 / 1024) + 13 / 1024, abs=1e-3)
    # CP=2 by the ring, a rank's keys and values 2 x 512 tokens x 4 heads x 32 x 4 bytes = 0.5 MiB, a layer: sent
    # once forward, once backward, and its share of the fp32 gradients of both chunks (1 MiB) to their owner: 0.5
    assert rows[("cp2", 0)]["cp"][1] == pytest.approx(2 * 4 * (0.5 + 0.5 + 0.5), abs=1e-3)


def test_recipe_check_keeps_the_megatron_callback_sections():
    """``check --config`` runs a recipe's layouts with its clipping and lr schedule (the CLI's named sections)."""
    from pathlib import Path

    from lightning_megatron.check.recipe import build_callbacks, load_recipe, with_dropout

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml")
    built = {type(cb).__name__: cb for cb in build_callbacks(recipe.callbacks, None)}
    assert built["MegatronOptimizerCallback"].config.clip_grad == 1.0
    assert built["OptimizerParamSchedulerCallback"].kwargs["max_lr"] == 1.0e-3
    # the deferred output-layer weight gradient is the schedule's business: off for the one-process reference
    deferred = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml",
                           model_overrides={"config.defer_embedding_wgrad_compute": True})
    assert deferred.model["config"]["defer_embedding_wgrad_compute"] is False
    assert recipe.model["config"]["hidden_dropout"] == 0.0 and recipe.dropout == {"config.hidden_dropout": 0.1,
                                                                                  "config.attention_dropout": 0.1}
    assert with_dropout(recipe.model, recipe.dropout)["config"]["hidden_dropout"] == 0.1


def test_first_divergence_forward_then_gradients():
    """Pure: outputs are compared in the reference's forward order (TP pieces joined along their split
    dimension, vocab padding cut); when every output agrees, the first module in backward order whose
    gradients differ is named."""
    from lightning_megatron.check.parity import LayoutRun, Tolerances, first_divergence, join_pieces

    g = torch.Generator().manual_seed(0)
    x, logits, h = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 10, generator=g), torch.randn(3, generator=g)
    padded = torch.cat([logits, torch.zeros(4, 2, 2)], -1)  # two TP pieces of a vocab padded to 12
    pieces = [padded[..., :6], padded[..., 6:]]
    assert torch.equal(join_pieces(pieces, logits.shape), logits) and join_pieces([x], x.shape) is x
    order = ["embed", "blocks.0.fc1", "blocks.0.fc2", "head"]
    grads = {"embed.weight": h, "blocks.0.fc1.weight": h, "blocks.0.fc2.weight": h, "head.weight": h}

    def run(outputs, grads):
        return LayoutRun(layout="x", losses=[], grad_norms=[], grads={1: grads}, params={}, memory=[], collectives=[],
                         outputs=outputs, output_order=order)

    ref = run({"embed": [x], "blocks.0.fc1": [x], "blocks.0.fc2": [x], "head": [logits]}, grads)
    same = {"embed": [x], "blocks.0.fc1": [x[..., :4], x[..., 4:]], "blocks.0.fc2": [x], "head": pieces}
    assert first_divergence(run(same, grads), ref, Tolerances()) is None
    assert first_divergence(run({**same, "blocks.0.fc2": [2 * x], "head": [2 * logits]}, grads), ref,
                            Tolerances()).startswith("forward output of blocks.0.fc2 ")
    off = {**grads, "embed.weight": h + 1, "blocks.0.fc1.weight": h + 1}  # backward order: fc1 before embed
    assert first_divergence(run(same, off), ref, Tolerances()).startswith("gradients of blocks.0.fc1 ")


def test_first_divergence_across_pipeline_stages():
    """Pure, on records shaped as the ranks return them: with a pipelined reference (``--reference pp2``,
    ``pp2vp2``) the forward order is the model's (model chunk, then stage, then call order on the rank:
    under interleaving stage 0 holds layers 0 and 2), so of two diverging modules on different stages the
    earlier one in the model is named; both ways round (pipelined reference, pipelined run)."""
    from lightning_megatron.check.parity import Tolerances, first_divergence, gather_runs

    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(0))
    model = ["embedding", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    one_process = {name: (0, 0) for name in model}  # name -> (stage, model chunk)
    pp2 = {"embedding": (0, 0), "layers.0": (0, 0), "layers.1": (0, 0), "layers.2": (1, 0), "layers.3": (1, 0),
           "head": (1, 0)}
    pp2vp2 = {"embedding": (0, 0), "layers.0": (0, 0), "layers.1": (1, 0), "layers.2": (0, 1), "layers.3": (1, 1),
              "head": (1, 1)}

    def layout_run(placement: dict, changed: tuple[str, ...] = ()):
        outputs: dict[int, dict] = {}
        for name in model:  # each rank runs its modules in the model's order (first microbatch)
            stage, chunk = placement[name]
            mine = outputs.setdefault(stage, {})
            mine[name] = ((chunk, len(mine)), 2 * x if name in changed else x)
        records = [{"layout": "x", "coords": (0, 0, stage), "losses": [], "grad_norms": [], "grads": {},
                    "params": {}, "memory": {}, "collectives": {}, "outputs": mine}
                   for stage, mine in sorted(outputs.items())]
        return gather_runs([[r] for r in records])["x"]

    for placement in (pp2, pp2vp2):
        assert layout_run(placement).output_order == model
        # layers.1 and layers.2 both diverge: layers.1 (stage 0 of pp2; stage 1, chunk 0 of pp2vp2) comes first
        broken, ref = layout_run(one_process, ("layers.1", "layers.2")), layout_run(placement)
        assert first_divergence(broken, ref, Tolerances()).startswith("forward output of layers.1 ")
        broken, ref = layout_run(placement, ("layers.1", "layers.2")), layout_run(one_process)
        assert first_divergence(broken, ref, Tolerances()).startswith("forward output of layers.1 ")
    # A container split over the stages (stage 0's part of the layer stack) holds fewer parameter tensors than one
    # process's: its output is a part's, not compared (a bf16 pp2 check named "forward output of encoder (9.68e-01)").
    ref, run = layout_run(one_process), layout_run(pp2)
    for records, out, count in ((ref, x, 4), (run, 2 * x, 2)):
        records.outputs["stack"], records.output_params["stack"] = [out], count
    ref.output_order.insert(1, "stack")
    assert first_divergence(run, ref, Tolerances()) is None
    run.output_params["stack"] = 4
    assert first_divergence(run, ref, Tolerances()).startswith("forward output of stack ")
    # Under context parallelism a rank's outputs are its tokens in the split's order: not compared (they named the
    # first module whatever diverged); the gradients, whole tensors, name the module.
    run.layout = "tp2cp2"
    assert first_divergence(run, ref, Tolerances()) is None


def test_16_bit_gradients_beyond_the_bounds_are_judged_against_the_fp32_truth():
    """Pure: ``judge_against_truth``. A gradient of a layout beyond the 16-bit bounds from the 16-bit reference
    passes when it is as near the fp32 truth as that reference (within 2x its distance); a wrong one (half of it,
    a missing TP rank's share) fails however far the reference is; a loss failure stays."""
    from lightning_megatron.check.parity import LayoutRun, Tolerances, compare_runs, judge_against_truth
    from lightning_megatron.check.parity import CheckReport

    gen = torch.Generator().manual_seed(0)
    exact = {"w": torch.randn(64, generator=gen), "bias": torch.randn(8, generator=gen) * 1e-2}

    def run(layout: str, bias: torch.Tensor, loss: float = 1.0) -> LayoutRun:
        return LayoutRun(layout=layout, losses=[loss], grad_norms=[1.0], grads={1: {"w": exact["w"], "bias": bias}},
                         params={}, memory=[], collectives=[])

    noise = torch.randn(8, generator=gen) * 2e-3  # 16-bit rounding: the reference and a layout each off the truth
    ref, truth = run("tp1", exact["bias"] + noise), run("tp1", exact["bias"])
    layouts = [run("tp2", exact["bias"] - noise), run("tp4", exact["bias"] / 2), run("pp2", exact["bias"] - noise, 2.0)]
    tol = Tolerances.bf16()
    report = CheckReport(reference=ref, runs={r.layout: r for r in layouts}, tolerances=tol,
                         results=[compare_runs(r, ref, tol) for r in layouts])
    assert [r.passed for r in report.results] == [False, False, False], report.table()
    judged = judge_against_truth(report, truth)
    assert [r.passed for r in judged.results] == [True, False, False], judged.table()
    tp2, tp4, pp2 = judged.results
    assert tp2.truth.startswith("step 1: against the fp32 truth bias is ") and "bound max(0.05, 2x)" in tp2.truth
    assert "from the fp32 truth (one 16-bit process" in tp4.failures[0], tp4.failures
    assert [f.split(":")[1] for f in pp2.failures] == [" loss 2 vs 1 (1.00e+00 rel)"], pp2.failures
    assert "PASS\n" in judged.table() and judged.table().endswith("FAIL")


def test_the_fp32_truth_starts_from_the_16_bit_runs_weights():
    """``check_layouts(..., round_params_to="bfloat16")`` on the bf16 recipe made fp32 (what ``check`` judges 16-bit
    gradients against): every initial parameter is the bf16 run's, bit for bit."""
    from pathlib import Path

    from lightning_megatron.check.cli import _in_fp32
    from lightning_megatron.check.parity import check_layouts
    from lightning_megatron.check.recipe import factories, load_recipe

    def first_weights(recipe, **kwargs):
        recipe.data.update(global_batch_size=2, micro_batch_size=2, max_seq_length=32)
        report = check_layouts(**factories(recipe, 1, 2), layouts=[], global_batch_size=2, micro_batch_size=2,
                               steps=1, trainer_kwargs=recipe.trainer_kwargs(1), record_params=True, **kwargs)
        return report.reference.init_params

    base = Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml"
    overrides = {"config.params_dtype": "bfloat16"}
    bf16 = load_recipe(str(base), overrides)
    bf16.precision = "bf16-true"
    exact = load_recipe(str(base), overrides)
    assert _in_fp32(exact) is None and exact.precision == "32-true"
    ours, theirs = first_weights(bf16), first_weights(exact, round_params_to="bfloat16")
    assert ours.keys() == theirs.keys() and len(ours) > 30
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not all(torch.equal(ours[k], v) for k, v in first_weights(exact).items())  # unrounded: not the same


def test_update_error_is_relative_to_the_update():
    """Pure: ``update_error`` (the rule of every final-parameter comparison: ``check`` and the tests'
    ``megatron_testing.assert_final_params_close``) is ``rms(p - p_ref) / rms(p_ref - p_init)`` per tensor,
    a tensor that did not move is measured against ``floor`` x the largest update, a shape mismatch is inf.
    On Adam-like updates (every element +-lr per step, 3 steps) of a [96, 32] weight: one element whose
    update is off by 1% of a step passes (the CPU-dependent element of issue 34: 1.1e-5 at lr 1e-3); one
    element with the wrong sign, a 1% wrong lr, or a missing step fail (the real runs' version:
    tests/test_gpt_parallel.py::test_final_parameter_rule_on_the_real_runs)."""
    from lightning_megatron.check.parity import Tolerances, update_error

    g = torch.Generator().manual_seed(0)
    init = {"w": 0.02 * torch.randn(96, 32, generator=g), "still": torch.zeros(32)}
    steps = [1e-3 * torch.randn(96, 32, generator=g).sign()] * 3  # rms of the update: 3e-3
    ref = {"w": init["w"] - sum(steps), "still": init["still"]}
    tol = Tolerances().param_rtol

    def err(**changed: torch.Tensor) -> dict[str, float]:
        return update_error({**ref, **changed}, ref, init)

    assert err() == {"w": 0.0, "still": 0.0}
    off = torch.randn(96, 32, generator=g)
    assert err(w=ref["w"] + 1e-6 * off)["w"] == pytest.approx(float(1e-6 * off.pow(2).mean().sqrt()) / 3e-3, rel=1e-4)
    assert err(still=init["still"] + 3e-9)["still"] == pytest.approx(3e-9 / 3e-6, rel=1e-6)  # floor 1e-3 x 3e-3
    assert err(w=ref["w"][:95])["w"] == float("inf")
    noise = ref["w"].clone()
    noise[40, 11] += 1.1e-5
    assert err(w=noise)["w"] <= tol / 10
    flipped = ref["w"].clone()
    flipped[5, 7] = init["w"][5, 7] + sum(steps)[5, 7]  # that element moved the other way
    for name, final in (("one element's sign", flipped), ("lr 1% off", init["w"] - 1.01 * sum(steps)),
                        ("a step missing", init["w"] - sum(steps[:2]))):
        assert err(w=final)["w"] > 3 * tol, (name, err(w=final))


def test_a_16_bit_reference_that_overflowed_is_said_and_the_optimizer_is_an_override(tmp_path):
    """An fp16 recipe's check started at Megatron's loss scale 2^32: every step overflowed in the reference and the
    layout alike (the optimizer skipped it), and each layout was judged a divergence ("gradients of output_layer:
    nan"). A reference whose gradients are not finite is said as such, with the fix; and the fix is a flag:
    ``--megatron_optimizer.initial_loss_scale`` (check refused every section but model and data)."""
    import math
    from pathlib import Path

    from lightning_megatron.check.parity import LayoutRun, Tolerances, compare_runs
    from lightning_megatron.check.recipe import load_recipe, parse_overrides

    def run(norm: float) -> LayoutRun:
        return LayoutRun(layout="ep2", losses=[9.0362], grad_norms=[norm], grads={}, params={}, memory=[],
                         collectives=[])

    result = compare_runs(run(math.nan), run(math.nan), Tolerances())
    assert not result.passed and result.failures[0].startswith(
        "step 1: the reference's gradients are not finite (an fp16 loss scale that overflowed: the optimizer skipped "
        "the step), nothing compared"), result.failures
    assert "--megatron_optimizer.initial_loss_scale" in result.failures[0]
    overrides = parse_overrides(["--megatron_optimizer.initial_loss_scale", "1024", "--model.config.num_layers", "1"],
                                ("model", "data", "megatron_optimizer"))
    base = Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml"
    recipe = load_recipe(base, overrides["model"], overrides["data"], overrides["megatron_optimizer"])
    [(name, args)] = [c for c in recipe.callbacks if c[0] == "MegatronOptimizerCallback"]
    assert args["config"]["initial_loss_scale"] == 1024


def test_the_trainer_s_precision_is_an_override_and_other_trainer_options_are_named():
    """``fit --config r.yaml --trainer.precision bf16-mixed`` trains the recipe in bf16; ``check`` of the same command
    line said ``unknown argument '--trainer.precision'``: the one Trainer option that changes what a layout computes
    is an override; any other is refused naming what the check uses instead."""
    from pathlib import Path

    from lightning_megatron.check.cli import tolerances
    from lightning_megatron.check.parity import Tolerances
    from lightning_megatron.check.recipe import load_recipe, parse_overrides

    prefixes = ("model", "data", "megatron_optimizer", "trainer")
    base = Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml"
    overrides = parse_overrides(["--trainer.precision", "bf16-mixed"], prefixes)
    recipe = load_recipe(base, overrides["model"], overrides["data"], overrides["megatron_optimizer"],
                         overrides["trainer"])
    assert recipe.precision == "bf16-mixed" and recipe.trainer_kwargs(2)["precision"] == "bf16-mixed"
    assert load_recipe(base).precision == "32-true"  # the recipe's own
    # fp32 parameters under autocast: 16-bit matmuls, judged at the 16-bit bounds (fp32's failed every layout)
    assert tolerances(recipe) == Tolerances.bf16() and tolerances(load_recipe(base)) == Tolerances()
    for flag, named in (("--trainer.max_steps", "--steps"), ("--trainer.devices", "--layouts"),
                        ("--trainer.strategy.init_args.tensor_model_parallel_size", "--layouts")):
        overrides = parse_overrides([flag, "2"], prefixes)
        with pytest.raises(ValueError, match=f"{flag} is not an override of check.*{named}"):
            load_recipe(base, trainer_overrides=overrides["trainer"])


def test_a_classifier_recipe_is_checked_and_its_memory_predicted(capsys):
    """``check --config recipes/bert_tiny_finetune.yaml`` (what ``finetune fit`` trains: BERT's classifier over the
    recipe's labelled data) built the pretraining module and died in every rank ("unexpected keyword argument
    'classifier_dropout'"). It checks the classifier now, ``num_classes`` from the data as ``finetune`` links it,
    and predicts its memory: no LM head runs (its logits were predicted, twice the activations measured), and the
    classifier keeps the first token only (it kept a view of the whole final norm's output, under sequence
    parallelism the gathered sequence)."""
    from pathlib import Path

    from lightning_megatron.check.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny_finetune.yaml"
    assert main(["--config", str(recipe), "--layouts", "tp2sp", "--steps", "1", "--global-batch-size", "8",
                 "--micro-batch-size", "4", "--estimate-memory"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "tp2sp          PASS" in out, out
    rows = [line.split() for line in out.split("memory per rank")[1].splitlines()[2:] if line.strip()]
    assert [(r[0], r[1]) for r in rows] == [("tp1", "0"), ("tp2sp", "0")], out
    for row in rows:  # params, grads, optimizer state, activations
        for cell in row[2:6]:
            predicted, measured = (float(x) for x in cell.split("/"))
            assert abs(predicted / measured - 1) < 0.02, out


def test_a_recipes_optimizer_scheduler_and_cpu_tuning_are_what_its_layouts_run(capfd, tmp_path):
    """``check`` ran AdamW for a recipe whose top-level ``optimizer:`` named SGD (and dropped its ``lr_scheduler:``
    and its ``cpu_tuning``), and let pass what ``fit`` refuses (gradient accumulation, a misspelled decay style). The
    layouts run the recipe's optimizer, scheduler and CPU tuning now: SGD's one momentum buffer is as large as the
    fp32 parameters (AdamW's two moments were twice), measured and predicted; what fit refuses, check refuses.
    With ``model.compile`` the layers stay compiled every step (the recorder's hooks recompiled each layer until
    torch's limit of 8 sent the later steps eager, unsaid), which the header says."""
    from pathlib import Path

    from lightning_megatron.check.cli import main

    base = Path(__file__).resolve().parents[1] / "recipes" / "gpt_tiny.yaml"
    recipe = tmp_path / "sgd.yaml"
    recipe.write_text(f"base: {base}\nlr_schedule: null\noptimizer:\n  class_path: torch.optim.SGD\n  init_args:\n"
                      f"    momentum: 0.9\nlr_scheduler:\n  class_path: torch.optim.lr_scheduler.StepLR\n"
                      f"  init_args:\n    step_size: 1\n    gamma: 0.5\n")
    assert main(["--config", str(recipe), "--layouts", "tp2", "--steps", "2", "--global-batch-size", "4",
                 "--micro-batch-size", "2", "--data.seq_length", "32", "--model.config.num_layers", "2",
                 "--model.compile", "true", "--estimate-memory"]) == 0, capfd.readouterr().out
    out, err = capfd.readouterr()
    assert "dropout off, layers compiled (model.compile)" in out and "recompile_limit" not in out + err, out + err
    assert "the recipe's optimizer: torch.optim.SGD {'momentum': 0.9}" in out, out
    assert "the recipe's lr_scheduler: torch.optim.lr_scheduler.StepLR" in out, out
    assert "the recipe's cpu_tuning on every layout: CPUTuning(" in out and "tp2            PASS" in out, out
    rows = [line.split() for line in out.split("memory per rank")[1].splitlines()[2:] if line.strip()]
    for row in rows:  # params, grads, optimizer state (predicted / measured)
        params, state = (tuple(float(x) for x in row[i].split("/")) for i in (2, 4))
        assert abs(state[1] / params[1] - 1) < 0.01 and abs(state[0] / state[1] - 1) < 0.02, out
    refused = tmp_path / "refused.yaml"
    refused.write_text(f"base: {base}\ntrainer:\n  accumulate_grad_batches: 2\nlr_schedule:\n  lr_decay_style: cosin\n")
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(refused), "--layouts", "tp2"])
    err = capfd.readouterr().err
    assert exit_.value.code == 2 and "accumulate_grad_batches=2" in err and "lr_decay_style='cosin'" in err, err
    # said before a check runs: a schedule starting at lr 0 compares no update at step 2 (a layout doubling its
    # update passed 2 steps of gpt_tiny); a 16-bit recipe's bounds pass a layout a few percent off (--fp32 does not)
    from lightning_megatron.check.cli import notes
    from lightning_megatron.check.recipe import load_recipe

    [lr0] = notes(load_recipe(base), 2, False)
    assert "starts at lr 0 (init_lr 0, lr_warmup_steps 30)" in lr0 and lr0.endswith("add --steps 3"), lr0
    bf16 = tmp_path / "bf16.yaml"
    bf16.write_text(f"base: {base}\nlr_schedule: null\ntrainer:\n  precision: bf16-true\nmodel:\n  init_args:\n"
                    f"    config:\n      params_dtype: bfloat16\n")
    assert [n.split(" (")[0] for n in notes(load_recipe(bf16), 3, False)] == ["16-bit bounds are loose"]
    assert notes(load_recipe(bf16), 3, True) == [] and notes(load_recipe(base), 3, False)[0].endswith("step 3 on")
