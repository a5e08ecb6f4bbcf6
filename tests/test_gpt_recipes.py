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
GPT_DATA = "lightning_megatron.data.gpt_datamodule.GPTDataModule"


def test_gpt_tiny_recipe_builds_the_gpt2_shape():
    recipe = load_recipe(ROOT / "recipes" / "gpt_tiny.yaml")
    assert recipe.model_class == GPT_MODULE and recipe.data_class == GPT_DATA
    assert recipe.dropout == {"hidden_dropout": 0.1, "attention_dropout": 0.1}  # check turns them off
    assert {name for name, _ in recipe.callbacks} == {"MegatronOptimizerCallback", "OptimizerParamSchedulerCallback"}
    assert recipe.data["seq_length"] <= recipe.model["max_sequence_length"]
    from lightning_megatron.models.gpt.module import GPTLightningModule

    module = GPTLightningModule(**recipe.model, vocab_size=30522)
    module.configure_model()
    params = dict(module.sharded_named_parameters())
    h, f, layers, v = 128, 512, 4, 30592  # vocab padded to a multiple of 128
    layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv, proj, fc1, fc2 with biases; 2 LayerNorms
    assert sum(p.numel() for p in params.values()) == layers * layer + v * h + 128 * h + 2 * h
    assert "output_layer.weight" not in params  # tied
