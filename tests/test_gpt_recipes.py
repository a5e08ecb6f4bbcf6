"""The decoder recipes (``recipes/gpt_tiny.yaml``, ``recipes/llama_*.yaml``): read as ``check`` reads them,
their module built on one process, and the GPU-sized ones accepted by ``check --estimate-memory``.

In-process (no spawn): the recipe's ``model`` section builds a GPTLightningModule whose parameter count
is the closed form of its shape; the data section names the GPT datamodule.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_megatron.check.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
GPT_MODULE = "lightning_megatron.models.gpt.module.GPTLightningModule"
GPT_DATA = "lightning_megatron.datamodules.gpt.GPTDataModule"


def test_gpt_tiny_recipe_builds_the_gpt2_shape():
    recipe = load_recipe(ROOT / "recipes" / "gpt_tiny.yaml")
    assert recipe.model_class == GPT_MODULE and recipe.data_class == GPT_DATA
    assert recipe.dropout == {"config.hidden_dropout": 0.1, "config.attention_dropout": 0.1}  # check turns them off
    assert {name for name, _ in recipe.callbacks} == {"MegatronOptimizerCallback", "OptimizerParamSchedulerCallback"}
    assert recipe.data["seq_length"] <= recipe.model["config"]["max_sequence_length"]
    from lightning_megatron.models.gpt.module import GPTLightningModule

    module = GPTLightningModule(**{**recipe.model, "config": {**recipe.model["config"], "vocab_size": 30522}})
    module.configure_model()
    params = dict(module.sharded_named_parameters())
    h, f, layers, v = 128, 512, 4, 30592  # vocab padded to a multiple of 128
    layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv, proj, fc1, fc2 with biases; 2 LayerNorms
    assert sum(p.numel() for p in params.values()) == layers * layer + v * h + 128 * h + 2 * h
    assert "output_layer.weight" not in params  # tied


def test_llama_1b_recipe_is_accepted_by_estimate_memory_and_its_layout_is_the_fastest(capsys):
    """``check --estimate-memory --estimate-time --gpus 8`` takes the Llama recipe (the module's declared sizes,
    no model built), marks the recipe's own layout, DP=8 with the distributed optimizer, among those that fit
    in 80 GB and says where it ranks: first (TP=2 x PP=2 x DP=2 with SP, which it used before, is predicted
    slower for memory the model does not need: its collectives, its bubble, and its hosts dispatching every op
    for half the device work); another layout of the recipe is reported with the fastest."""
    import dataclasses

    from lightning_megatron.check.cli import _parser, main
    from lightning_megatron.check.memory_cli import fitting_layouts
    from lightning_megatron.check.time_cli import timing_inputs
    from lightning_megatron.parallel_dims import ParallelDims

    recipe = load_recipe(ROOT / "recipes" / "llama_1b.yaml")
    assert recipe.model_class == GPT_MODULE and recipe.data_class == GPT_DATA
    m = recipe.model["config"]
    assert (m["spec"], m["position_embedding_type"], m["gated_linear_unit"], m["add_bias_linear"],
            m["untie_embeddings_and_output_weights"]) == ("llama_layer_spec", "rope", True, False, True)
    assert m["num_attention_heads"] % m["num_query_groups"] == 0 and m["num_query_groups"] % 2 == 0  # TP=2 possible
    assert recipe.layout == ParallelDims(dp=8, zero1=True)
    argv = ["--config", str(ROOT / "recipes" / "llama_1b.yaml"), "--estimate-memory", "--estimate-time", "--gpus", "8",
            "--gpu-memory", "80GB", "--device", "h100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if line.endswith("<- the recipe's")]
    assert row.startswith("dp8zero1 ") and out.splitlines()[3] == row, out  # the first row: the fastest
    assert "the recipe's layout dp8zero1: 18.71 GiB on its fullest rank; 1st of 51 that fit" in out, out
    # the decoder takes context parallelism: CP layouts are among those tried (2,048 tokens split into 2 CP chunks)
    assert {"cp2dp4zero1", "tp2cp2dp2spzero1", "cp8", "tp4cp2sp"} <= {line.split()[0] for line in out.splitlines()}
    slower = dataclasses.replace(recipe, layout=ParallelDims(tp=2, pp=2, dp=2, sequence_parallel=True))
    fitting_layouts(slower, 8, 80 * 10**9, timing_inputs(slower, _parser().parse_known_args(argv)[0]))
    out = capsys.readouterr().out
    assert "the recipe's layout tp2pp2dp2sp: 9.61 GiB on its fullest rank; 19th of 51" in out, out
    assert "the fastest, dp8zero1, is predicted 1.63x as fast with 18.71 GiB" in out, out
    # --top 3: the three fastest that fit, the recipe's own row where it is further down, and how many are left out
    assert main(argv + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    more = lines.index("  ... 48 more layouts (--top 0 lists every one)")
    assert [line.split()[0] for line in lines[3:more]] == ["dp8zero1", "dp8", "pp2dp4zero1"], out
    assert "1st of 51 that fit" in out, out  # the ranking is over every layout still
    fitting_layouts(slower, 8, 80 * 10**9, timing_inputs(slower, _parser().parse_known_args(argv)[0]), top=3)
    out = capsys.readouterr().out
    lines = out.splitlines()
    more = lines.index("  ... 47 more layouts (--top 0 lists every one)")
    assert [line.split()[0] for line in lines[3:more]] == ["dp8zero1", "dp8", "pp2dp4zero1", "tp2pp2dp2sp"], out
    assert lines[more - 1].endswith("<- the recipe's"), out
    assert "19th of 51" in out, out
    for wrong, said in ((argv[:4] + ["--top", "3"], "--top 3 shortens the list of layouts of --gpus N; add --gpus"),
                        (argv + ["--top", "-1"], "--top -1: a number of layouts, >= 0")):
        with pytest.raises(SystemExit):
            main(wrong)
        assert said in capsys.readouterr().err


def test_a_compiled_loss_is_estimated_keeping_the_logits_at_one_tp_rank(tmp_path, capsys):
    """``model.compile: true`` (a recipe on ``base: llama_1b.yaml``): at one TP rank the compiled loss keeps the
    16-bit logits for its backward where the vocab-parallel function keeps an fp32 softmax, so ``check
    --estimate-memory`` puts 2 bytes a logit less on the last stage (micro batch 4 x 2,048 tokens x 32,000 columns:
    0.49 GiB); with two TP ranks the function stays, and so does its estimate."""
    from lightning_megatron.check.cli import main

    compiled = tmp_path / "llama_1b_compiled.yaml"
    compiled.write_text(f"base: {ROOT / 'recipes' / 'llama_1b.yaml'}\nmodel:\n  init_args:\n    compile: true\n")

    def fullest(recipe: Path, layout: str) -> float:
        argv = ["--config", str(recipe), "--estimate-memory", "--gpus", "8", "--gpu-memory", "80GB"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        [row] = [line for line in out.splitlines() if line.startswith(f"{layout} ")]
        return float(row.split()[5])  # the GiB column: params, grads, optimizer and activations

    base = ROOT / "recipes" / "llama_1b.yaml"
    logits = 4 * 2048 * 32000 / 2**30
    assert abs(fullest(base, "dp8zero1") - fullest(compiled, "dp8zero1") - 2 * logits) < 0.015
    assert fullest(base, "tp2dp4zero1") == fullest(compiled, "tp2dp4zero1")


def test_llama_1b_module_has_1_1b_parameters():
    """The recipe's module, built on one process with one layer (the shapes of every layer):
    the parameter count of TinyLlama-1.1B, 1,100,048,384, from the per-layer count."""
    from lightning_megatron.models.gpt.module import GPTLightningModule

    model = load_recipe(ROOT / "recipes" / "llama_1b.yaml").model
    layers = model["config"]["num_layers"]
    small = GPTLightningModule(**{**model, "config": {**model["config"], "params_dtype": "float32", "num_layers": 1}})
    small.configure_model()
    params = dict(small.sharded_named_parameters())
    per_layer = sum(p.numel() for n, p in params.items() if n.startswith("decoder.layers.0."))
    rest = sum(p.numel() for n, p in params.items() if not n.startswith("decoder.layers."))
    assert layers * per_layer + rest == 1_100_048_384


def _built_per_rank(config: dict, tp: int, pp: int, stage: int) -> int:
    """Parameter elements one TP rank of ``stage`` holds: that stage's chunk built at TP=1, each column- or
    row-split tensor (Megatron's rule: qkv and fc1 weights and biases, proj and fc2 weights) counted 1/tp,
    the vocab-parallel ones at the vocabulary padded for ``tp``."""
    from lightning_megatron.models.gpt import GPTConfig, GPTModel
    from lightning_megatron.tensor_parallel import pad_vocab_size

    record = GPTConfig(**config).with_layout(1, False)
    per_stage = record.num_layers // pp
    chunk = GPTModel(record, record.spec, record.vocab_size, record.max_sequence_length,
                     position_embedding_type=record.position_embedding_type,
                     share_embeddings_and_output_weights=not record.untie_embeddings_and_output_weights,
                     pre_process=stage == 0, post_process=stage == pp - 1,
                     layer_range=range(stage * per_stage, (stage + 1) * per_stage))
    vocab_rows = pad_vocab_size(record.vocab_size, tp, 128) // tp
    total = 0
    for name, p in chunk.named_parameters():
        if "word_embeddings" in name or name.startswith("output_layer"):
            total += vocab_rows * p.shape[1]
        else:
            split = any(k in name for k in ("linear_qkv.", "linear_fc1.", "linear_proj.weight", "linear_fc2.weight"))
            total += p.numel() // tp if split else p.numel()
    return total


SMALL_LLAMA = {"hidden_size": 256, "num_attention_heads": 32, "num_query_groups": 4, "ffn_hidden_size": 704}


@pytest.mark.parametrize("recipe,tp,pp", [("gpt_tiny", 1, 1), ("gpt_tiny", 2, 2), ("llama_1b", 1, 2), ("llama_1b", 2, 2)])
def test_declared_parameters_per_stage_equal_the_built_chunks(recipe, tp, pp):
    """``estimate_shape``'s parameters per TP rank and pipeline stage (from which --estimate-memory sizes
    params, grads and optimizer state) equal what the module builds there: grouped-query qkv, the gated
    fc1, the untied output layer or the tied embedding's copy on a last stage, vocabulary padding, no
    pooler (the Llama recipe at a smaller width with the same head structure, vocabulary 30000)."""
    from lightning_megatron.models.gpt.module import GPTLightningModule

    rc = load_recipe(ROOT / "recipes" / f"{recipe}.yaml")
    config = {**rc.model["config"], "vocab_size": 30000, "num_layers": 4, "params_dtype": "float32",
              **(SMALL_LLAMA if recipe == "llama_1b" else {})}
    shape = GPTLightningModule.estimate_shape({**rc.model, "config": config}, rc.data, micro_batch_size=1,
                                              global_batch_size=8)
    for stage in range(pp):
        assert shape.stage_parameters(tp, pp, stage) == _built_per_rank(config, tp, pp, stage), stage


def test_mixtral_recipe_is_accepted_by_estimate_memory_and_time(capsys):
    """``check --estimate-memory --estimate-time --gpus 64`` takes the Mixtral-8x7B-shaped recipe: its layout
    (EP=8 x PP=4 x VP=4 x DP=16 with ZeRO-1) read with its expert-parallel size, 46.7B parameters (Mixtral's),
    the experts split over EP in the per-GPU memory, and the layout first of those that fit in 80 GB."""
    from lightning_megatron.check.cli import main
    from lightning_megatron.parallel_dims import ParallelDims

    recipe = load_recipe(ROOT / "recipes" / "mixtral_8x7b.yaml")
    assert recipe.layout == ParallelDims(pp=4, vp=4, ep=8, dp=16, zero1=True)
    argv = ["--config", str(ROOT / "recipes" / "mixtral_8x7b.yaml"), "--estimate-memory", "--estimate-time",
            "--gpus", "64", "--gpu-memory", "80GB", "--device", "h100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "8 SwiGLU experts of 14336 (top-2, active 28672)" in out and ": 46702.8 M parameters;" in out, out
    [row] = [line for line in out.splitlines() if line.endswith("<- the recipe's")]
    assert row.startswith("ep8pp4vp4dp16zero1 ") and " yes " in row and out.splitlines()[3] == row, row
    # each GPU holds 1/8 of the experts: without EP the same layout needs 8x their bytes
    without = [line for line in out.splitlines() if line.startswith("pp4vp4dp16zero1 ")]
    assert without and float(without[0].split()[5]) > 1.5 * float(row.split()[5]), (without, row)


def test_lora_recipes_read_and_the_8b_one_is_accepted_by_estimate_memory(capsys):
    """The LoRA recipes: the tiny one fine-tunes gpt_tiny's checkpoint on the packaged chats (SFTDataModule), the
    Llama-3-8B-shaped one is read with its adapters (their gradients and optimizer state only: the frozen 8B
    base adds weights, not state) and its layout, DP=8 with ZeRO-1, ranks first of those that fit in 80 GB."""
    from lightning_megatron.check.cli import main
    from lightning_megatron.parallel_dims import ParallelDims

    tiny = load_recipe(ROOT / "recipes" / "gpt_tiny_lora.yaml")
    assert tiny.data_class == "lightning_megatron.datamodules.sft.SFTDataModule"
    assert tiny.model["init_from"] == "runs/gpt_tiny/checkpoints/last.ckpt" and tiny.model["lora"]["rank"] == 8
    recipe = load_recipe(ROOT / "recipes" / "llama3_8b_lora.yaml")
    assert recipe.layout == ParallelDims(dp=8, zero1=True) and recipe.model["lora"]["rank"] == 16
    argv = ["--config", str(ROOT / "recipes" / "llama3_8b_lora.yaml"), "--estimate-memory", "--estimate-time",
            "--gpus", "8", "--gpu-memory", "80GB", "--device", "h100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if line.endswith("<- the recipe's")]
    assert row.startswith("dp8zero1 ") and out.splitlines()[3] == row, out
    params, grads, optimizer = (float(x) for x in row.split()[1:4])
    assert 14.9 < params < 15.1 and grads < 0.2 and optimizer < 0.2, row  # 8.03B bf16 weights; adapters' state
